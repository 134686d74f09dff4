"""Scoring an index: query rows made like its rows, then a streaming top-k (see the package docstring)."""
