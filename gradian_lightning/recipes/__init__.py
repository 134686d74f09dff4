"""Recipes: plain functions from a config to a result, under the CLI (see the package docstring)."""
