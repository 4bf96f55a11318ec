"""The LitServe app that serves a blocklab model with a block set chosen per request."""
