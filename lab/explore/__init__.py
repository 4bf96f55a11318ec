"""``blocklab explore``: the measurement commands' reports as one local, interactive page.

``reports.Explorer`` computes each view with the report function its command prints (one source of
numbers); ``app`` serves them as JSON beside the page in ``static/`` (vanilla JS and SVG, nothing
fetched from anywhere but the server that served it).
"""
