"""The on-disk index: one zarr v3 group. This module is the one description of its layout;
`writer.py` and `reader.py` share it.

    index.path/                      zarr group, attribute "gradian" = metadata (see below)
      grads              [N, D]      projected gradients, row-chunked, dtype = storage_dtype
                                     (bfloat16 is stored as its raw uint16 bits: zarr has no bfloat16;
                                     int8 as round(127 r / max|r|) per module block, with `scales`)
      id                 [N] str     the data row's `id` column, or its position
      loss               [N] f32     per-example loss, nats (sum over supervised tokens)
      supervised_tokens  [N] i32     supervised tokens that entered the loss
      truncated_tokens   [N] i32     supervised tokens cut by max_seq_length (-1: unknown)
      finite             [N] bool    false when the gradient had NaN/inf (the row is stored as zeros)
      complete           [N] bool    the row is written; set only after its data is on disk
      norms              [N, M] f32  L2 norm of each module block of the stored row (decoded to float32),
                                     M = the blocks of meta["modules"] (one: the row, without them);
                                     written with the row, before `complete`. Indexes written before
                                     it existed lack it: readers compute the norms from the rows.
      scales             [N, M] f32  int8 only: each module block's max|r| / 127, so that a block
                                     decodes as grads × scale (written with the row, before `complete`)
      statistics/                    second moments of the counted rows, written on close (statistics.py)

Row i is dataset position i, whatever order rows arrive in. Metadata attribute "gradian" holds
`format_version`, `complete` (every row written), `num_rows`, `modules` (the module blocks that
tile a row: name, shape, offset, size; the row width is their sum, stored nowhere else), `spec`
(the `IndexSpec` the rows were made with, specs.py: module filter, projection dim and seed,
storage dtype, ...), `fingerprint` (a hash of `identity(meta)` and num_rows: what must match to
resume), `global_step`, and what the writer was given: model, data, package versions and the
CLI's config (its `grads` section without the spec's keys). `IndexMeta` is that attribute read
once, typed: every reader uses it.

Readable with plain zarr: `zarr.open_group(path)["grads"][:10]`. `index.path` may be an fsspec URL
(s3://, gs://, file://, memory://): `location.py` opens it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr

from gradian_lightning.errors import IndexFormatError
from gradian_lightning.gradients.projection import ModuleBlock
from gradian_lightning.index.location import Location
from gradian_lightning.specs import IndexSpec

# 2: the width is the sum of the module blocks (an index written by IndexWriter alone has one,
# "row"), and every index stores its rows' per-module norms. Version 1 indexes are refused.
FORMAT_VERSION = 2
ATTRIBUTE = "gradian"
# Target size of one grads chunk, uncompressed. 4 MiB keeps a chunk and its float32 upcast in cache
# while a query scores it: 2x the streaming top-k throughput of 16 MiB (benchmarks/RESULTS.md §5).
CHUNK_BYTES = 4 * 2**20
# ...and at most this many rows. Rows wait in memory until their chunk is whole, with their ids and
# columns (~150 bytes a row beside the row's own), and a chunk is flushed at once: at k = 4, int8,
# two modules (32 bytes a row), 4 MiB is 131,072 rows, and indexing 10^6 of them peaked ~125 MiB
# above 10^4 (benchmarks/RESULTS.md §9). A default-width row (92 KB) fills 4 MiB at 45 rows.
CHUNK_MAX_ROWS = 16_384
NORMS = "norms"  # [N, M] float32 per-module L2 norms of the stored rows
SCALES = "scales"  # [N, M] float32 per-module scales of int8 rows
NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8}
INT8_MAX = 127
ROW_ARRAYS = {
    "id": (str, ""),
    "loss": (np.float32, 0.0),
    "supervised_tokens": (np.int32, 0),
    "truncated_tokens": (np.int32, -1),
    "finite": (bool, True),
    "complete": (bool, False),
}


def has_member(group: zarr.Group, name: str, kind: type) -> bool:
    """Whether `group` holds a `kind` (zarr.Array or zarr.Group) named `name`.

    Looked up by name, not by listing the group: a listing walks every entry of the index folder,
    and zarr warns on each one that is not a node (the writer's lock file, LOCK_FILE).
    """
    return isinstance(group.get(name), kind)


def encode(
    rows: torch.Tensor, storage_dtype: str, blocks: Sequence[ModuleBlock] = ()
) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """float32 rows [b, D] -> (numpy array [b, D] in the storage encoding, scales float32 [b, M] or None).

    int8 rounds each module block (`IndexMeta.blocks`) to 255 levels of its own
    max |value|: one scale a block, since modules' gradients differ by orders of magnitude (no
    `blocks`: the row is one block). The other dtypes have no scales.
    """
    rows = rows.detach().cpu().float()
    if storage_dtype == "int8":
        blocks = _blocks_or_row(blocks, rows.shape[1])
        largest = [rows[:, b.offset : b.offset + b.size].abs().amax(dim=1) for b in blocks]
        scales = torch.stack(largest, dim=1) / INT8_MAX  # [b, M]
        step = _per_column(scales.clamp_min(torch.finfo(torch.float32).tiny), blocks)
        return torch.round(rows / step).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).numpy(), scales.numpy()
    if storage_dtype == "bfloat16":
        return rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), None
    return rows.to(getattr(torch, storage_dtype)).numpy(), None


def decode(
    stored: np.ndarray,
    storage_dtype: str,
    out: Optional[torch.Tensor] = None,
    scales: Optional[np.ndarray | torch.Tensor] = None,
    blocks: Sequence[ModuleBlock] = (),
) -> torch.Tensor:
    """Stored rows [b, D] -> float32 tensor [b, D]; into `out` (float32 [b, D], reused) when given.
    int8 rows need their `scales` [b, M] and the `blocks` they were encoded with."""
    if storage_dtype == "bfloat16":
        rows = torch.from_numpy(np.ascontiguousarray(stored).view(np.int16)).view(torch.bfloat16)
    else:
        rows = torch.from_numpy(np.ascontiguousarray(stored))
    # torch upcasts float16 several times faster than NumPy's astype, and copying into a reused
    # buffer about 1.8x faster again than allocating (no fresh pages): it bounds query throughput
    # (benchmarks/query_throughput.py).
    rows = rows.float() if out is None else out.copy_(rows)
    if storage_dtype == "int8":
        if scales is None:
            raise IndexFormatError(
                "int8 rows cannot be decoded without their per-module scales (the index's 'scales' array); rebuild the index with `gradian index`"
            )
        scales = torch.as_tensor(scales, dtype=torch.float32)
        blocks = _blocks_or_row(blocks, rows.shape[1])
        size = equal_block_size(blocks, rows.shape[1])
        if size is not None:  # projected: one broadcast multiply over a [b, M, k²] view
            rows.view(rows.shape[0], len(blocks), size).mul_(scales[:, :, None])
        else:
            rows.mul_(_per_column(scales, blocks))
    return rows


def round_trip(rows: torch.Tensor, storage_dtype: str, blocks: Sequence[ModuleBlock] = ()) -> torch.Tensor:
    """float32 rows [b, D] as a reader gets them back after they were stored as `storage_dtype`."""
    stored, scales = encode(rows, storage_dtype, blocks)
    return decode(stored, storage_dtype, scales=scales, blocks=blocks)


def _blocks_or_row(blocks: Sequence[ModuleBlock], width: int) -> Sequence[ModuleBlock]:
    # Rows encoded without a module layout are one block: the row.
    return blocks or [row_block(width)]


def _per_column(scales: torch.Tensor, blocks: Sequence[ModuleBlock]) -> torch.Tensor:
    # [b, M] -> [b, D]: each block's scale repeated over its columns.
    return torch.repeat_interleave(scales, torch.tensor([b.size for b in blocks]), dim=1)


def row_block(width: int) -> ModuleBlock:
    """The one block of rows written by `IndexWriter` alone, without a module layout: the row."""
    return ModuleBlock("row", 1, width, (1, width), 0)


def equal_block_size(blocks: Sequence[ModuleBlock], width: int) -> Optional[int]:
    """The common size s of module blocks that tile a row of `width` in equal parts (projected
    rows: s = k²), so that rows can be viewed as [n, M, s]; None otherwise (exact rows)."""
    sizes = {b.size for b in blocks}
    if len(sizes) == 1 and sum(b.size for b in blocks) == width:
        return sizes.pop()
    return None


def module_norms(rows: torch.Tensor, blocks: Sequence[ModuleBlock]) -> torch.Tensor:
    """float32 [n, M]: the L2 norm of each module block of float32 `rows` [n, D].

    The writer stores these for the stored (decoded) rows; a reader of an index without them
    computes them with this same function, so both give the same bits.
    """
    if equal_block_size(blocks, rows.shape[1]) is not None:  # projected: one norm over a [n, M, k²] view
        return torch.linalg.vector_norm(rows.view(rows.shape[0], len(blocks), -1), dim=2)
    return torch.stack(
        [torch.linalg.vector_norm(rows[:, b.offset : b.offset + b.size], dim=1) for b in blocks],
        dim=1,
    )


def identity(meta: Dict[str, Any]) -> Dict[str, Any]:
    """What an index's rows depend on: the model, the module layout, the projection and storage dtype of its spec
    and the data. The fingerprint hashes it (with num_rows); a refusal to resume names the keys
    that differ."""
    return {  # KeyError for the metadata of an index written by IndexWriter alone: it has no model
        "model": meta["model"].get("name_or_path"),
        "modules": meta["modules"],
        **IndexSpec(**meta["spec"]).rows_identity(),
        "data": meta.get("data"),
    }


def fingerprint(parts: Dict[str, Any]) -> str:
    """A short stable hash of plain data: what must match for a run to resume an index."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def chunk_rows(width: int, storage_dtype: str) -> int:
    """Rows per grads chunk: about CHUNK_BYTES of uncompressed data, at most CHUNK_MAX_ROWS."""
    return max(1, min(CHUNK_MAX_ROWS, CHUNK_BYTES // (width * np.dtype(NUMPY_DTYPE[storage_dtype]).itemsize)))


def stored_meta(path: str | Path | Location) -> Optional[Dict[str, Any]]:
    """The "gradian" attribute at `path`; None where nothing is stored, or an empty folder, or
    something that is not a Gradian index (no zarr group, or one without the attribute).

    A store that holds a zarr group but cannot be read (a permission, a network error) raises
    `IndexFormatError` with the cause: a failed read is never taken for "no index here", since
    `index.overwrite` would then remove what it could not read.
    """
    path = path if isinstance(path, Location) else Location(path)
    if path.is_empty() or not path.has_file("zarr.json"):
        return None
    try:
        attrs = path.open_group("r").attrs
        meta = attrs.get(ATTRIBUTE)
    except (zarr.errors.ContainsArrayError, zarr.errors.GroupNotFoundError, zarr.errors.MetadataValidationError):
        return None  # a zarr array, or a group some other tool wrote: not a Gradian index
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise IndexFormatError(
            f"index.path {str(path)!r} could not be read ({type(err).__name__}: {first}); nothing was changed there; check the path and your access to it, then rerun"
        ) from None
    return dict(meta) if meta is not None else None


@dataclass(frozen=True)
class IndexMeta:
    """What an index (one checkpoint of it) holds: its "gradian" attribute, read and typed once.

    `blocks` tile each row (the width is their sum); `spec` is the `IndexSpec` the rows were made
    with; `model` {"name_or_path", "class", "vocab_size", "dtype", "weights_sha256"} and `data`
    {"path", "sha256", "max_seq_length", ...} are what the writer was given (empty for an index
    written by `IndexWriter` alone); `checkpoints` the entries of a checkpointed index
    (index/checkpoints.py), else empty; `segments` the appended runs (index.append), else empty.
    `attrs` is the attribute as stored, for writers that update it.
    """

    attrs: Dict[str, Any] = field(repr=False)
    num_rows: int
    complete: bool
    blocks: Tuple[ModuleBlock, ...]
    spec: IndexSpec
    model: Dict[str, Any]
    data: Dict[str, Any]
    global_step: Optional[int]
    lr: Optional[float]
    fingerprint: Optional[str]
    loss_kind: Optional[str]
    checkpoints: Tuple[Dict[str, Any], ...]
    segments: Tuple[Dict[str, Any], ...]

    @classmethod
    def from_attrs(cls, attrs: Dict[str, Any], where: str = "the index") -> "IndexMeta":
        """Type the "gradian" attribute `attrs`; `IndexFormatError` naming `where` for another format version."""
        version = attrs.get("format_version")
        if version != FORMAT_VERSION:
            raise IndexFormatError(
                f"{where} is a Gradian index of format version {version}, this gradian reads version {FORMAT_VERSION}; rebuild it with `gradian index` or install the gradian release that wrote it"
            )
        step = attrs.get("global_step")
        return cls(
            attrs=dict(attrs),
            num_rows=int(attrs["num_rows"]),
            complete=bool(attrs.get("complete")),
            blocks=tuple(ModuleBlock.from_entry(e) for e in attrs["modules"]),
            spec=IndexSpec(**attrs["spec"]),
            model=dict(attrs.get("model") or {}),
            data=dict(attrs.get("data") or {}),
            global_step=None if step is None else int(step),
            lr=attrs.get("lr"),
            fingerprint=attrs.get("fingerprint"),
            loss_kind=(attrs.get("loss") or {}).get("kind"),
            checkpoints=tuple(dict(e) for e in attrs.get("checkpoints") or ()),
            segments=tuple(dict(e) for e in attrs.get("segments") or ()),
        )

    @property
    def width(self) -> int:
        """Values in a row: the sum of the module blocks' sizes."""
        return sum(b.size for b in self.blocks)

    @property
    def storage_dtype(self) -> str:
        return self.spec.storage_dtype

    def data_segments(self) -> List[Dict[str, Any]]:
        """The sources of the rows, oldest first: {"data" (its `data_sources.describe_source`
        record), "offset" (its first row), "rows", "fingerprint" (of the run that wrote them)}; one
        for an index that was never appended to (index.append)."""
        first = {"data": self.data, "offset": 0, "rows": self.num_rows, "fingerprint": self.fingerprint}
        return [dict(s) for s in self.segments] or [first]

    @property
    def max_seq_length(self) -> Optional[int]:
        """The max_seq_length the rows were tokenized with, when the writer was told (from a config)."""
        return self.data.get("max_seq_length")


def read_meta(path: str | Path | Location) -> IndexMeta:
    """The metadata of the index at `path` (a local path or a URL); `IndexFormatError` if it is not an index."""
    path = path if isinstance(path, Location) else Location(path)
    try:
        group = path.open_group("r")
        attrs = dict(group.attrs[ATTRIBUTE])
    except Exception:
        raise IndexFormatError(
            f"{str(path)!r} is not a Gradian index (no zarr group with a '{ATTRIBUTE}' attribute); point index.path at one written by `gradian index`"
        ) from None
    return IndexMeta.from_attrs(attrs, repr(str(path)))
