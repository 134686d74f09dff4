"""Optional packages: importing one that an extra brings, or one line saying which extra to install.

A plain `pip install gradian-lightning` runs every command; what needs more (the Dask engine, plots)
refuses in one line naming the extra, instead of an ImportError's traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gradian_lightning.errors import MissingExtraError


def require_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """`module` imported, or `MissingExtraError`: "<purpose> needs <package>; pip install "gradian-lightning[<extra>]"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise MissingExtraError(
            f'{purpose} needs {package}, which is not installed here; pip install "gradian-lightning[{extra}]"'
        ) from None
