"""`IndexReader`: read access to an index written by `IndexWriter` (layout in `layout.py`).

It knows nothing of scoring: `gradian_lightning.query` adds ranking on top of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from gradian_lightning.errors import IndexFormatError
from gradian_lightning.index.checkpoints import checkpoint_entries
from gradian_lightning.index.layout import ATTRIBUTE, decode, read_meta
from gradian_lightning.index.location import Location
from gradian_lightning.index.statistics import RowStatistics, counted, layout_blocks


class IndexReader:
    """Read access to an index: its metadata, per-row arrays and rows decoded to float32.

    `gradian_lightning.open_index(path)` returns its subclass `Index`, which also ranks rows (`topk`).
    """

    def __init__(self, path: str | Path, checkpoint: Optional[int] = None) -> None:
        self.path = Location(path)  # a local directory or an fsspec URL; str() gives it back
        self.meta = read_meta(self.path)
        self.group = self.path.open_group("r")
        # A checkpointed index (checkpoints.py) reads as its newest checkpoint unless told which.
        self.checkpoints = checkpoint_entries(self.meta)
        steps = [int(e["step"]) for e in self.checkpoints]
        entry = self.checkpoints[-1] if checkpoint is None or checkpoint not in steps else self.checkpoints[steps.index(checkpoint)]
        if checkpoint is not None and checkpoint not in steps:
            raise IndexFormatError(f"{str(self.path)!r} holds no checkpoint at step {checkpoint}; its steps are {steps}")
        self.step = int(entry["step"])
        if entry["group"]:
            self.group = self.group[entry["group"]]
            self.meta = {**dict(self.group.attrs[ATTRIBUTE]), "checkpoints": self.checkpoints}
        self.grads = self.group["grads"]
        self.storage_dtype = self.meta["storage_dtype"]
        self._mask: Tuple[int, np.ndarray] = (0, np.zeros(0, dtype=bool))  # cached block for `rankable`

    def __len__(self) -> int:
        return int(self.meta["num_rows"])

    def column(self, name: str, indices: Optional[Sequence[int]] = None) -> np.ndarray:
        """A per-row array (id, loss, supervised_tokens, truncated_tokens, finite, complete), whole or at `indices`."""
        if indices is None:
            return self.group[name][:]
        return self.group[name].oindex[np.asarray(indices, dtype=np.int64)]

    def rankable(self, lo: int, hi: int) -> np.ndarray:
        """Bool [hi - lo]: rows lo..hi-1 that may appear in query results (written, finite, supervised)."""
        start, mask = self._mask
        if not (start <= lo and hi <= start + len(mask)):
            # Read a whole chunk of the per-row arrays at once: one read serves many grads chunks,
            # and memory stays bounded by the chunk, not by N.
            start = lo - lo % self.group["complete"].chunks[0]
            rows = slice(start, min(max(hi, start + self.group["complete"].chunks[0]), len(self)))
            mask = self.group["complete"][rows] & self.group["finite"][rows] & (self.group["supervised_tokens"][rows] > 0)
            self._mask = (start, mask)
        return mask[lo - start : hi - start]

    def rows(self, indices: Sequence[int] | slice) -> torch.Tensor:
        """float32 rows [len(indices), D] for dataset positions `indices`."""
        if isinstance(indices, slice):
            return decode(self.grads[indices], self.storage_dtype)
        indices = np.asarray(indices, dtype=np.int64)
        return decode(self.grads.oindex[indices, :], self.storage_dtype)

    def chunks(self) -> Iterator[Tuple[int, torch.Tensor]]:
        """(first row, float32 rows [c, D]) for each stored chunk, in order: streaming reads."""
        step = self.grads.chunks[0]
        for lo in range(0, len(self), step):
            yield lo, self.rows(slice(lo, min(lo + step, len(self))))

    def statistics(self) -> RowStatistics:
        """The row statistics stored by the writer; for an index written before they existed, one pass over its rows."""
        stored = RowStatistics.load(self.group)
        if stored is not None:
            return stored
        stats = RowStatistics.empty(layout_blocks(self.meta), int(self.meta["width"]))
        for lo, rows in self.chunks():
            hi = lo + len(rows)
            keep = self.group["complete"][lo:hi] & counted(self.group["finite"][lo:hi], self.group["supervised_tokens"][lo:hi])
            stats.add(rows[torch.from_numpy(keep)])
        return stats

    def at(self, step: int) -> "IndexReader":
        """The same index read at checkpoint `step` (one of `self.checkpoints`), as this class."""
        return type(self)(self.path, checkpoint=step)
