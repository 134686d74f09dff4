"""The on-disk index: one zarr v3 group. The only module that knows the layout.

    index.path/                      zarr group, attribute "gradian" = metadata (see below)
      grads              [N, D]      projected gradients, row-chunked, dtype = storage_dtype
                                     (bfloat16 is stored as its raw uint16 bits: zarr has no bfloat16)
      id                 [N] str     the data row's `id` column, or its position
      loss               [N] f32     per-example loss, nats (sum over supervised tokens)
      supervised_tokens  [N] i32     supervised tokens that entered the loss
      truncated_tokens   [N] i32     supervised tokens cut by max_seq_length (-1: unknown)
      finite             [N] bool    false when the gradient had NaN/inf (the row is stored as zeros)
      complete           [N] bool    the row is written; set only after its data is on disk

Row i is dataset position i, whatever order rows arrive in. Metadata attribute "gradian" holds
`format_version`, `complete` (every row written), `num_rows`, `width`, `storage_dtype`,
`fingerprint` (what must match to resume), `global_step`, and what the writer was given:
the resolved config, the module layout, projection, model and package versions.

Readable with plain zarr: `zarr.open_group(path)["grads"][:10]`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr

from gradian_lightning.errors import ConfigError, IndexFormatError

FORMAT_VERSION = 1
ATTRIBUTE = "gradian"
# Target size of one grads chunk, uncompressed. 4 MiB keeps a chunk and its float32 upcast in cache
# while a query scores it: 2x the streaming top-k throughput of 16 MiB (benchmarks/RESULTS.md §5).
CHUNK_BYTES = 4 * 2**20
_NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
_ROW_ARRAYS = {
    "id": (str, ""),
    "loss": (np.float32, 0.0),
    "supervised_tokens": (np.int32, 0),
    "truncated_tokens": (np.int32, -1),
    "finite": (bool, True),
    "complete": (bool, False),
}


def encode(rows: torch.Tensor, storage_dtype: str) -> np.ndarray:
    """float32 rows [b, D] -> numpy array in the storage encoding."""
    rows = rows.detach().cpu()
    if storage_dtype == "bfloat16":
        return rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return rows.to(getattr(torch, storage_dtype)).numpy()


def decode(stored: np.ndarray, storage_dtype: str) -> torch.Tensor:
    """Stored rows -> float32 tensor [b, D]."""
    if storage_dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(stored).view(np.int16)).view(torch.bfloat16).float()
    # torch upcasts float16 several times faster than NumPy's astype: it bounds query throughput
    # (benchmarks/query_throughput.py).
    return torch.from_numpy(np.ascontiguousarray(stored)).float()


def fingerprint(parts: Dict[str, Any]) -> str:
    """A short stable hash of plain data: what must match for a run to resume an index."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def chunk_rows(width: int, storage_dtype: str) -> int:
    """Rows per grads chunk: about CHUNK_BYTES of uncompressed data."""
    return max(1, CHUNK_BYTES // (width * np.dtype(_NUMPY_DTYPE[storage_dtype]).itemsize))


def read_meta(path: str | Path) -> Dict[str, Any]:
    """The "gradian" attribute of the index at `path`; `IndexFormatError` if it is not an index."""
    path = Path(path)
    try:
        group = zarr.open_group(str(path), mode="r")
        meta = dict(group.attrs[ATTRIBUTE])
    except Exception:
        raise IndexFormatError(f"{str(path)!r} is not a Gradian index (no zarr group with a '{ATTRIBUTE}' attribute); point index.path at one written by `gradian index`") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise IndexFormatError(
            f"{str(path)!r} is a Gradian index of format version {version}, this gradian reads version {FORMAT_VERSION}; rebuild it with `gradian index` or install the gradian release that wrote it"
        )
    return meta


class IndexWriter:
    """Writes rows at their dataset positions, a whole chunk at a time, and resumes killed runs.

    If `path` holds an incomplete index with the same `meta["fingerprint"]` and `global_step`, rows
    already marked complete are kept and `todo` excludes them. An index of the same fingerprint at
    another step (the same job, other weights) is replaced. Anything else at `path` is replaced
    only when `overwrite` is true: a different index or a foreign directory is never lost silently.
    """

    def __init__(self, path: str | Path, num_rows: int, width: int, storage_dtype: str, meta: Dict[str, Any], overwrite: bool = False) -> None:
        self.path, self.num_rows, self.width, self.storage_dtype = Path(path), num_rows, width, storage_dtype
        self.meta = {**meta, "format_version": FORMAT_VERSION, "num_rows": num_rows, "width": width, "storage_dtype": storage_dtype, "complete": False}
        # A chunk never outgrows the index: uncompressed, the padding of a partial chunk is written out.
        self.chunk = min(chunk_rows(width, storage_dtype), max(num_rows, 1))
        self.group = self._open_or_create(overwrite)
        self.chunk = self.group["grads"].chunks[0]  # a resumed index keeps the chunking it was made with
        self.done = np.asarray(self.group["complete"][:], dtype=bool)
        self._pending: Dict[int, Dict[int, Tuple[np.ndarray, Tuple[Any, ...]]]] = {}
        self.nonfinite_rows: List[int] = []

    @property
    def todo(self) -> np.ndarray:
        """Bool [N]: rows still to be written."""
        return ~self.done

    def _open_or_create(self, overwrite: bool) -> zarr.Group:
        if self.path.exists():
            old = self._existing_meta()
            same_job = old is not None and old.get("fingerprint") == self.meta.get("fingerprint") and old.get("num_rows") == self.num_rows
            if same_job and old.get("global_step") == self.meta.get("global_step"):
                return zarr.open_group(str(self.path), mode="r+")
            if not (same_job or overwrite):
                what = "a Gradian index of another configuration" if old is not None else "something that is not a Gradian index"
                raise ConfigError(f"index.path {str(self.path)!r} holds {what}; choose another index.path or pass index.overwrite=true to replace it")
            if self.path.is_dir():
                shutil.rmtree(self.path)
            else:
                self.path.unlink()
        group = zarr.open_group(str(self.path), mode="w")
        # No compressor: zstd saved 7% on float16 gradients (benchmarks/RESULTS.md, index size) but
        # cut the read rate that bounds query throughput by 3-4x.
        group.create_array(
            "grads", shape=(self.num_rows, self.width), chunks=(self.chunk, self.width), dtype=_NUMPY_DTYPE[self.storage_dtype], fill_value=0, compressors=None
        )
        row_chunk = max(self.chunk, 4096)
        for name, (dtype, fill) in _ROW_ARRAYS.items():
            group.create_array(name, shape=(self.num_rows,), chunks=(row_chunk,), dtype=dtype, fill_value=fill)
        group.attrs[ATTRIBUTE] = self.meta
        return group

    def _existing_meta(self) -> Optional[Dict[str, Any]]:
        try:
            return dict(zarr.open_group(str(self.path), mode="r").attrs[ATTRIBUTE])
        except Exception:
            return None

    def write(self, indices: Sequence[int], grads: torch.Tensor, loss: torch.Tensor, supervised: torch.Tensor, truncated: torch.Tensor, ids: Sequence[str]) -> None:
        """Buffer rows (float32 grads [b, D]; loss, supervised, truncated [b]) and flush full chunks.

        Rows with NaN/inf are stored as zeros with `finite=False` and listed in `nonfinite_rows`.
        """
        finite = torch.isfinite(grads).all(dim=1) & torch.isfinite(loss)
        grads = torch.where(finite[:, None], grads, torch.zeros_like(grads))
        stored = encode(grads, self.storage_dtype)
        touched = set()
        for j, i in enumerate(int(i) for i in indices):
            if self.done[i]:
                continue  # resumed row, or a duplicate that a distributed sampler padded in
            if not bool(finite[j]):
                self.nonfinite_rows.append(i)
            c = i // self.chunk
            self._pending.setdefault(c, {})[i] = (stored[j], (ids[j], float(loss[j]), int(supervised[j]), int(truncated[j]), bool(finite[j])))
            touched.add(c)
        for c in touched:
            lo, hi = c * self.chunk, min((c + 1) * self.chunk, self.num_rows)
            if int(self.done[lo:hi].sum()) + len(self._pending[c]) == hi - lo:
                self._flush(c)

    def _flush(self, c: int) -> None:
        rows = self._pending.pop(c)
        order = np.array(sorted(rows), dtype=np.int64)
        lo, hi = int(order[0]), int(order[-1]) + 1
        contiguous = hi - lo == len(order)
        where = slice(lo, hi) if contiguous else order
        # The data goes first and the completion flags last, so a killed run never leaves a row
        # marked complete whose data is not on disk.
        block = np.stack([rows[i][0] for i in order])
        self._set("grads", where, block)
        columns = list(zip(*(rows[i][1] for i in order)))
        for name, values in zip(("id", "loss", "supervised_tokens", "truncated_tokens", "finite"), columns):
            self._set(name, where, np.asarray(values, dtype=_ROW_ARRAYS[name][0]))
        self._set("complete", where, np.ones(len(order), dtype=bool))
        self.done[order] = True

    def _set(self, name: str, where: slice | np.ndarray, values: np.ndarray) -> None:
        array = self.group[name]
        if isinstance(where, slice):
            array[where] = values
        else:
            array.oindex[where] = values

    def close(self, extra_meta: Optional[Dict[str, Any]] = None) -> bool:
        """Flush every buffered row; mark the index complete when every row is. Returns that flag."""
        for c in sorted(self._pending):
            self._flush(c)
        complete = bool(self.done.all())
        self.group.attrs[ATTRIBUTE] = {**self.meta, **(extra_meta or {}), "complete": complete}
        return complete


class IndexReader:
    """Read access to an index. `open_index(path)` makes one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.group = zarr.open_group(str(self.path), mode="r")
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

    def topk(
        self, query_rows: torch.Tensor, k: int, score: str = "cosine", bottom_k: int = 0, device: Optional[torch.device | str] = None, normalize: str = "module"
    ) -> Any:
        """The k best rows per query (`query.streaming_topk`): a `Ranking`, or (top, bottom) when `bottom_k` > 0.

        `query_rows` [Q, D] float32, e.g. from `gradian_lightning.query_gradients`; `score` is
        "cosine" or "inner"; `normalize` ("module" or "row") is what cosine scales to unit norm.
        The index is streamed chunk by chunk.
        """
        from gradian_lightning.query import streaming_topk

        top, bottom = streaming_topk(self, query_rows, k, score, bottom_k, device, normalize)
        return (top, bottom) if bottom_k else top

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


def open_index(path: str | Path) -> IndexReader:
    """Open the Gradian index at `path` for reading (see the module docstring for the layout)."""
    return IndexReader(path)
