"""The versions this release supports, and those installed: one declaration for doctor and the index.

`SUPPORTED` is the one declaration of the supported window; pyproject.toml's dependency bounds are
checked against it by tests/test_doctor.py. Every index records `package_versions()`.
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Dict, Tuple

# name -> (lowest supported, first unsupported): the half-open window [low, high).
SUPPORTED: Dict[str, Tuple[str, str]] = {
    "python": ("3.10", "3.14"),
    "torch": ("2.4", "2.14"),
    "lightning": ("2.4", "2.7"),
    "transformers": ("5.0", "6"),
    "zarr": ("3.0", "4"),
    "omegaconf": ("2.3", "2.5"),
    "numpy": ("1.24", "3"),
    "fsspec": ("2023.10", "2027"),
    "datasets": ("3.0", "6"),
}
PACKAGES = (
    "gradian-lightning",
    "torch",
    "lightning",
    "transformers",
    "zarr",
    "omegaconf",
    "numpy",
    "fsspec",
    "datasets",
)


def package_versions() -> Dict[str, str]:
    """Installed versions of the packages an index depends on, plus Python's."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found
