"""The one exception class for mistakes a user can fix: a wrong path, a model that is not there, bad
input. ``blocklab`` (lab.cli) prints its message as one line and exits with status 2; anything else
is a bug and keeps its traceback.

It is a ValueError, so library callers that already catch ValueError for bad input still do.
"""


class UserError(ValueError):
    """Something the user gave (a path, a model, a spec) that cannot be used; the message says what."""
