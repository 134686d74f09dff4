"""`IndexReader`: read access to an index written by `IndexWriter` (layout in `layout.py`).

It knows nothing of scoring: `gradian_lightning.query` adds ranking on top of it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr

from gradian_lightning.errors import IndexFormatError, IndexMismatchError
from gradian_lightning.index.checkpoints import checkpoint_entries
from gradian_lightning.index.layout import ATTRIBUTE, NORMS, SCALES, IndexMeta, decode, has_member, read_meta
from gradian_lightning.index.location import Location
from gradian_lightning.index.statistics import (
    STATISTICS_GROUP,
    WHITENED_DAMPING,
    WHITENED_NORMS,
    RowStatistics,
    counted,
)

# Bytes of per-row arrays (flags, norms) one read fetches while streaming: see `IndexReader._span`.
METADATA_READ_BYTES = 4 * 2**20


def raw_row_dtype(array: zarr.Array) -> Optional[np.dtype]:
    """The dtype (byte order included) a stored row of `array` [N, W] has in its chunk's bytes, when
    a row's bytes can be read alone: a zarr v3 array whose codecs are exactly the `bytes` codec
    (no compressor, no transpose, no sharding) and whose chunks span every column, so that row r
    of a chunk of c rows is bytes r·W·itemsize..(r+1)·W·itemsize of its file (an edge chunk is
    stored at full size). None otherwise: such arrays are read a stored chunk at a time."""
    from zarr.codecs import BytesCodec

    meta = array.metadata
    if meta.zarr_format != 3 or array.ndim != 2 or array.chunks[1] != array.shape[1]:
        return None
    if len(meta.codecs) != 1 or not isinstance(meta.codecs[0], BytesCodec):
        return None
    endian = meta.codecs[0].endian
    order = sys.byteorder if endian is None else endian.value  # None: one-byte values, no order
    return array.dtype.newbyteorder("<" if order == "little" else ">")


def _runs(positions: np.ndarray, chunk: int) -> List[Tuple[int, int]]:
    # [(first, count)]: sorted unique `positions` cut into runs of consecutive rows of one stored
    # chunk, each one contiguous byte range of that chunk's file.
    if len(positions) == 0:
        return []
    starts = np.flatnonzero((np.diff(positions) != 1) | (np.diff(positions // chunk) != 0)) + 1
    bounds = np.concatenate([[0], starts, [len(positions)]])
    return [(int(positions[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]


def read_raw_rows(array: zarr.Array, positions: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Rows [n, W] of `array` (in `array.dtype`) at sorted unique `positions`, each read as its own
    byte range of its chunk's file (`raw_row_dtype`'s layout): a candidate costs its W values, not
    its stored chunk. A chunk never written reads as the fill value, as zarr reads it.

    A local store is read with one `pread` per run of rows (zarr's own ranged reads take a thread
    hop each: 1.1 s for 6,400 rows, against 0.17 s); any other store through its
    `get_partial_values`, which fetches the ranges concurrently."""
    chunk, width = array.chunks[0], array.shape[1]
    row_bytes = width * dtype.itemsize
    out = np.empty((len(positions), width), dtype=dtype)
    runs = _runs(positions, chunk)
    keys = {n: f"{array.path}/{array.metadata.encode_chunk_key((n, 0))}" for n in {first // chunk for first, _ in runs}}
    store = array.store_path.store
    from zarr.storage import LocalStore

    at = 0
    if isinstance(store, LocalStore):
        # One open per chunk file, one pread per run in it (runs come in position order, so a
        # chunk's runs are consecutive): 6,400 candidates read in 0.25 s, not 0.47 s.
        root, fd, opened = str(store.root), None, None
        try:
            for first, count in runs:
                target, number = out[at : at + count], first // chunk
                at += count
                if number != opened:
                    if fd is not None:
                        os.close(fd)
                    fd, opened = None, number
                    try:
                        fd = os.open(f"{root}/{keys[number]}", os.O_RDONLY)
                    except FileNotFoundError:
                        pass
                if fd is None:
                    target[...] = array.fill_value
                elif os.preadv(fd, [memoryview(target).cast("B")], (first % chunk) * row_bytes) != count * row_bytes:
                    raise IndexFormatError(
                        f"{root}/{keys[number]!s} is shorter than a stored chunk of {chunk} rows; the index is damaged: rebuild it with `gradian index`"
                    )
        finally:
            if fd is not None:
                os.close(fd)
    else:
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        ranges = [
            (keys[first // chunk], RangeByteRequest((first % chunk) * row_bytes, (first % chunk + count) * row_bytes))
            for first, count in runs
        ]
        for (_, count), got in zip(runs, sync(store.get_partial_values(default_buffer_prototype(), ranges))):
            target = out[at : at + count]
            if got is None:
                target[...] = array.fill_value
            else:
                target[...] = np.frombuffer(got.to_bytes(), dtype=dtype).reshape(count, width)
            at += count
    return out.astype(array.dtype, copy=False)


class IndexReader:
    """Read access to an index: its metadata (`meta`, an `IndexMeta`), per-row arrays and rows decoded to float32.

    `gradian_lightning.open_index(path)` returns an `Index` (query/topk.py) that holds one and ranks its rows.
    """

    def __init__(self, path: str | Path, checkpoint: Optional[int] = None) -> None:
        self.path = Location(path)  # a local directory or an fsspec URL; str() gives it back
        self.meta = read_meta(self.path)
        self.group = self.path.open_group("r")
        # A checkpointed index (checkpoints.py) reads as its newest checkpoint unless told which.
        self.checkpoints = checkpoint_entries(self.meta)
        steps = [int(e["step"]) for e in self.checkpoints]
        entry = (
            self.checkpoints[-1]
            if checkpoint is None or checkpoint not in steps
            else self.checkpoints[steps.index(checkpoint)]
        )
        if checkpoint is not None and checkpoint not in steps:
            raise IndexFormatError(
                f"{str(self.path)!r} holds no checkpoint at step {checkpoint}; its steps are {steps}"
            )
        self.step = int(entry["step"])
        if entry["group"]:
            self.group = self.group[entry["group"]]
            attrs = {**dict(self.group.attrs[ATTRIBUTE]), "checkpoints": list(self.checkpoints)}
            self.meta = IndexMeta.from_attrs(attrs, repr(str(self.path)))
        self.grads = self.group["grads"]
        self.storage_dtype = self.meta.storage_dtype
        self._mask: Tuple[int, np.ndarray] = (0, np.zeros(0, dtype=bool))  # cached block for `rankable`
        self._norms_array = self.group[NORMS]
        self._scales_array = self.group.get(SCALES) if self.storage_dtype == "int8" else None
        if self.storage_dtype == "int8" and not isinstance(self._scales_array, zarr.Array):
            raise IndexFormatError(
                f"{str(self.path)!r} stores int8 rows without their per-module scales (the index's 'scales' array); rebuild the index with `gradian index`"
            )
        self.module_blocks = self.meta.blocks
        self._blocks: Dict[str, Tuple[int, torch.Tensor]] = {}  # name -> (first row, cached rows) for `_per_row`
        stats = self.group[STATISTICS_GROUP] if has_member(self.group, STATISTICS_GROUP, zarr.Group) else None
        # The damping the stored whitened norms are for; None when there are none (or a close was killed before it said so).
        self.whitened_damping: Optional[float] = stats.attrs.get(WHITENED_DAMPING) if stats is not None else None
        self._whitened_array = stats[WHITENED_NORMS] if self.whitened_damping is not None else None

    def __len__(self) -> int:
        return self.meta.num_rows

    def column(self, name: str, indices: Optional[Sequence[int]] = None) -> np.ndarray:
        """A per-row array (id, loss, supervised_tokens, truncated_tokens, finite, complete), whole or at `indices`."""
        if indices is None:
            return self.group[name][:]
        return self.group[name].oindex[np.asarray(indices, dtype=np.int64)]

    def _span(self, lo: int, hi: int, chunk: int, row_bytes: int) -> slice:
        # The rows one read of a per-row array covers: whole chunks from lo's chunk, about
        # METADATA_READ_BYTES of them and at least lo..hi-1. Each read is a round trip through
        # zarr's event loop (about a millisecond on a loaded machine), so one read serves many
        # grads chunks, and memory stays bounded by that constant, not by N.
        start = lo - lo % chunk
        rows = max(chunk, METADATA_READ_BYTES // max(row_bytes, 1) // chunk * chunk)
        return slice(start, min(max(hi, start + rows), len(self)))

    def rankable(self, lo: int, hi: int) -> np.ndarray:
        """Bool [hi - lo]: rows lo..hi-1 that may appear in query results (written, finite, supervised)."""
        start, mask = self._mask
        if not (start <= lo and hi <= start + len(mask)):
            rows = self._span(lo, hi, self.group["complete"].chunks[0], 6)  # bool, bool, int32 per row
            mask = (
                self.group["complete"][rows] & self.group["finite"][rows] & (self.group["supervised_tokens"][rows] > 0)
            )
            self._mask = (rows.start, mask)
            start = rows.start
        return mask[lo - start : hi - start]

    def _per_row(self, name: str, array, lo: int, hi: int) -> torch.Tensor:
        # Rows lo..hi-1 of an [N, M] float32 array, read a span at a time (`_span`) and cached.
        start, block = self._blocks.get(name, (0, torch.zeros(0, 0)))
        if not (start <= lo and hi <= start + len(block)):
            rows = self._span(lo, hi, array.chunks[0], 4 * array.shape[1])
            start, block = rows.start, torch.from_numpy(array[rows])
            self._blocks[name] = (start, block)
        return block[lo - start : hi - start]

    def stored_norms(self, lo: int, hi: int) -> torch.Tensor:
        """float32 [hi - lo, M]: the per-module L2 norms of rows lo..hi-1 as the writer stored them
        (`layout.module_norms` of the decoded rows)."""
        return self._per_row(NORMS, self._norms_array, lo, hi)

    def whitened_norms(self, lo: int, hi: int) -> Optional[torch.Tensor]:
        """float32 [hi - lo, M]: |(F_m + λI)^-½ r_m| of rows lo..hi-1 at λ = `whitened_damping`
        (statistics.py), or None when the index stores none."""
        return None if self._whitened_array is None else self._per_row(WHITENED_NORMS, self._whitened_array, lo, hi)

    def stored(self, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi-1 as stored, not decoded ([hi - lo, D] in the storage encoding, `decode` reads it)."""
        return self.grads[lo:hi]

    def decode(self, stored: np.ndarray, lo: int, hi: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 [hi - lo, D]: rows lo..hi-1 as `stored` holds them (`stored(lo, hi)`), decoded
        with their scales where the encoding has them; into `out` when given."""
        scales = None if self._scales_array is None else self._per_row(SCALES, self._scales_array, lo, hi)
        return decode(stored, self.storage_dtype, out=out, scales=scales, blocks=self.module_blocks)

    def rows(self, indices: Sequence[int] | slice) -> torch.Tensor:
        """float32 rows [len(indices), D] for dataset positions `indices`."""
        if isinstance(indices, slice):
            stored = self.grads[indices]
            scales = None if self._scales_array is None else self._scales_array[indices]
        else:
            indices = np.asarray(indices, dtype=np.int64)
            stored = self.grads.oindex[indices, :]
            scales = None if self._scales_array is None else self._scales_array.oindex[indices, :]
        return decode(stored, self.storage_dtype, scales=scales, blocks=self.module_blocks)

    def rows_at(self, positions: Sequence[int]) -> torch.Tensor:
        """float32 rows [len(positions), D] at dataset `positions` (any order, repeats allowed):
        `rows(positions)` bit for bit, reading only the rows' own bytes where the grads (and scales)
        are stored raw (`raw_row_dtype`), so that a few thousand scattered rows (ANN candidates)
        cost their own bytes, not a stored chunk each (64 rows, 384 KiB, at 10⁶ rows of 6,144 bytes).
        An array stored otherwise (compressed: the scales of indexes written so far) is read a chunk
        at a time as `rows` reads it; that path gives the same numbers, only slower."""
        wanted = np.asarray(positions, dtype=np.int64)
        outside = wanted[(wanted < 0) | (wanted >= len(self))]
        if len(outside):  # the raw read would find no chunk file there and give fill values
            raise IndexMismatchError(
                f"row position {int(outside[0])} is not a row of the index at {str(self.path)!r}, which holds {len(self)} rows (0..{len(self) - 1}); pass dataset positions of this index"
            )
        unique, back = np.unique(wanted, return_inverse=True)  # sorted: each chunk file read once, in order

        def read(array: zarr.Array) -> np.ndarray:
            dtype = raw_row_dtype(array)
            return array.oindex[unique, :] if dtype is None else read_raw_rows(array, unique, dtype)

        stored = read(self.grads)
        scales = None if self._scales_array is None else read(self._scales_array)
        rows = decode(stored, self.storage_dtype, scales=scales, blocks=self.module_blocks)
        return rows if len(unique) == len(wanted) and (unique == wanted).all() else rows[torch.from_numpy(back)]

    def chunks(self) -> Iterator[Tuple[int, torch.Tensor]]:
        """(first row, float32 rows [c, D]) for each stored chunk, in order: streaming reads."""
        for lo, stored in self.stored_chunks():
            yield lo, self.decode(stored, lo, lo + len(stored))

    def stored_chunks(self) -> Iterator[Tuple[int, np.ndarray]]:
        """(first row, rows as stored [c, D]) for each stored chunk, in order: for callers that decode into their own buffer."""
        step = self.grads.chunks[0]
        for lo in range(0, len(self), step):
            yield lo, self.stored(lo, min(lo + step, len(self)))

    def statistics(self) -> RowStatistics:
        """The row statistics stored by the writer (count and sums; the second moments' eigen-
        decomposition is in the same subgroup); for an index whose writer never closed, one pass
        over its rows, gram included."""
        stored = RowStatistics.load(self.group)
        if stored is not None:
            return stored
        stats = RowStatistics.empty(self.module_blocks, self.meta.width)
        for lo, rows in self.chunks():
            hi = lo + len(rows)
            keep = self.group["complete"][lo:hi] & counted(
                self.group["finite"][lo:hi], self.group["supervised_tokens"][lo:hi]
            )
            stats.add(rows[torch.from_numpy(keep)])
        return stats

    def at(self, step: int) -> "IndexReader":
        """The same index read at checkpoint `step` (one of `self.checkpoints`), as this class."""
        return type(self)(self.path, checkpoint=step)
