"""Fitted factors kept in an index, so that a second exact query or validate does not refit them.

    index.path/factors/<name>/       one zarr group per fitted set (the exact pass names it
                                     "step-<step>-<kind>"): one float32 array per tensor of the
                                     set, under its own key ("<module>/q_a", ...); attributes
                                     "key" (what the set was fitted from, plain JSON) and
                                     "complete" (true), written after every array

The store knows nothing of what the tensors mean: the caller gives a `key` that changes whenever
the fit would (query/exact_scoring.py: the modules, the training data's fingerprints, the rows,
max_seq_length, the weights, the precision). A set is read back only when "complete" is there and
its "key" equals the caller's; anything else (a fit killed half-way, other rows, other weights)
reads as no set, and the next write replaces it. Crash safety is the rows' convention
(writer.py, statistics.py): arrays first, the attribute that says they are finished last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import zarr

from gradian_lightning.index.location import Location

FACTORS_GROUP = "factors"
KEY = "key"
COMPLETE = "complete"  # written last: a set without it was cut short and is ignored


def _plain(key: Dict[str, Any]) -> Any:
    # The key as stored: JSON, so that a tuple and a list, or 1 and 1.0, compare as they are stored.
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def read_factor_set(path: str | Path, name: str, key: Dict[str, Any]) -> Optional[Dict[str, np.ndarray]]:
    """The arrays of set `name` in the index at `path` when it is complete and was fitted under
    `key`, else None (none there, cut short, or fitted from something else)."""
    try:
        group = Location(path).open_group("r")[f"{FACTORS_GROUP}/{name}"]
    except KeyError:
        return None
    if not isinstance(group, zarr.Group) or not group.attrs.get(COMPLETE) or group.attrs.get(KEY) != _plain(key):
        return None
    return {array_key: np.asarray(array[...]) for array_key, array in _arrays(group)}


def _arrays(group: zarr.Group, prefix: str = "") -> list:
    # Every array under `group`, by its path below it ("<module>/q_a": a module's name holds dots, not slashes).
    out = [(f"{prefix}{name}", array) for name, array in group.arrays()]
    for name, sub in group.groups():
        out += _arrays(sub, f"{prefix}{name}/")
    return out


def write_factor_set(path: str | Path, name: str, key: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    """Write (or replace) set `name` of the index at `path`: every array, then `key`, then "complete"."""
    root = Location(path).open_group("a")
    factors = root.require_group(FACTORS_GROUP)
    if name in factors:
        del factors[name]  # first: from here until "complete" the set is half written
    group = factors.create_group(name)
    for array_key, values in arrays.items():
        group.create_array(array_key, data=np.ascontiguousarray(values))
    group.attrs[KEY] = _plain(key)
    group.attrs[COMPLETE] = True  # last
