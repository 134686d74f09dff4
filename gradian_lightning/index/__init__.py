"""The on-disk zarr index (layout, writer, reader) and the Lightning callback that fills it (see the package docstring)."""
