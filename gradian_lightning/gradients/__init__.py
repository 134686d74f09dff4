"""The gradient path, plain torch: one batch -> one projected row per example (see the package docstring)."""
