"""blocklab: read a transformer Block as a pipeline: train it, break it, serve it, measure it."""

__version__ = "0.1.0"
