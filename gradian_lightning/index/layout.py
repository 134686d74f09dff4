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
`format_version`, `complete` (every row written), `num_rows`, `width`, `spec` (the `IndexSpec`
the rows were made with, specs.py: module filter, projection dim and seed, storage dtype, ...),
`fingerprint` (a hash of `identity(meta)` and num_rows: what must match to resume), `global_step`,
and what the writer was given: the module layout, model, data, package versions and the CLI's
config (its `grads` section without the spec's keys).

Readable with plain zarr: `zarr.open_group(path)["grads"][:10]`. `index.path` may be an fsspec URL
(s3://, gs://, file://, memory://): `location.py` opens it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr

from gradian_lightning.errors import IndexFormatError
from gradian_lightning.index.location import Location
from gradian_lightning.specs import IndexSpec

FORMAT_VERSION = 1
ATTRIBUTE = "gradian"
# Target size of one grads chunk, uncompressed. 4 MiB keeps a chunk and its float32 upcast in cache
# while a query scores it: 2x the streaming top-k throughput of 16 MiB (benchmarks/RESULTS.md §5).
CHUNK_BYTES = 4 * 2**20
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
    rows: torch.Tensor, storage_dtype: str, blocks: Sequence[Dict[str, Any]] = ()
) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """float32 rows [b, D] -> (numpy array [b, D] in the storage encoding, scales float32 [b, M] or None).

    int8 rounds each module block ({"offset", "size"}, `module_blocks`) to 255 levels of its own
    max |value|: one scale a block, since modules' gradients differ by orders of magnitude (no
    `blocks`: the row is one block). The other dtypes have no scales.
    """
    rows = rows.detach().cpu().float()
    if storage_dtype == "int8":
        blocks = _blocks_or_row(blocks, rows.shape[1])
        largest = [rows[:, int(b["offset"]) : int(b["offset"]) + int(b["size"])].abs().amax(dim=1) for b in blocks]
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
    blocks: Sequence[Dict[str, Any]] = (),
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


def round_trip(rows: torch.Tensor, storage_dtype: str, blocks: Sequence[Dict[str, Any]] = ()) -> torch.Tensor:
    """float32 rows [b, D] as a reader gets them back after they were stored as `storage_dtype`."""
    stored, scales = encode(rows, storage_dtype, blocks)
    return decode(stored, storage_dtype, scales=scales, blocks=blocks)


def _blocks_or_row(blocks: Sequence[Dict[str, Any]], width: int) -> Sequence[Dict[str, Any]]:
    # Rows written without a module layout are one block: the row.
    return blocks or [{"offset": 0, "size": width}]


def _per_column(scales: torch.Tensor, blocks: Sequence[Dict[str, Any]]) -> torch.Tensor:
    # [b, M] -> [b, D]: each block's scale repeated over its columns.
    return torch.repeat_interleave(scales, torch.tensor([int(b["size"]) for b in blocks]), dim=1)


def equal_block_size(blocks: Sequence[Dict[str, Any]], width: int) -> Optional[int]:
    """The common size s of module blocks that tile a row of `width` in equal parts (projected
    rows: s = k²), so that rows can be viewed as [n, M, s]; None otherwise (exact rows)."""
    sizes = {int(b["size"]) for b in blocks}
    if len(sizes) == 1 and sum(int(b["size"]) for b in blocks) == width:
        return sizes.pop()
    return None


def module_blocks(meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The module blocks ({"name", "offset", "size", ...}) that tile an index's rows, from its
    metadata; an index written by `IndexWriter` alone, without a module layout, is one block: the row."""
    return list(meta.get("modules") or [{"name": "row", "offset": 0, "size": int(meta["width"])}])


def module_norms(rows: torch.Tensor, blocks: Sequence[Dict[str, Any]]) -> torch.Tensor:
    """float32 [n, M]: the L2 norm of each module block ({"offset", "size"}) of float32 `rows` [n, D].

    The writer stores these for the stored (decoded) rows; a reader of an index without them
    computes them with this same function, so both give the same bits.
    """
    if equal_block_size(blocks, rows.shape[1]) is not None:  # projected: one norm over a [n, M, k²] view
        return torch.linalg.vector_norm(rows.view(rows.shape[0], len(blocks), -1), dim=2)
    return torch.stack(
        [
            torch.linalg.vector_norm(rows[:, int(b["offset"]) : int(b["offset"]) + int(b["size"])], dim=1)
            for b in blocks
        ],
        dim=1,
    )


def storage_dtype_of(meta: Dict[str, Any]) -> str:
    """The dtype the rows of an index with metadata `meta` are stored in."""
    return meta["spec"]["storage_dtype"]


def stored_spec(meta: Dict[str, Any]) -> IndexSpec:
    """The `IndexSpec` an index's rows were made with, from its metadata."""
    return IndexSpec(**meta["spec"])


def identity(meta: Dict[str, Any]) -> Dict[str, Any]:
    """What an index's rows depend on: the model, the module layout, the projection and storage dtype of its spec
    and the data. The fingerprint hashes it (with num_rows); a refusal to resume names the keys
    that differ."""
    return {  # KeyError for the metadata of an index written by IndexWriter alone: it has no model
        "model": meta["model"].get("name_or_path"),
        "modules": meta["modules"],
        **stored_spec(meta).rows_identity(),
        "data": meta.get("data"),
    }


def fingerprint(parts: Dict[str, Any]) -> str:
    """A short stable hash of plain data: what must match for a run to resume an index."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def chunk_rows(width: int, storage_dtype: str) -> int:
    """Rows per grads chunk: about CHUNK_BYTES of uncompressed data."""
    return max(1, CHUNK_BYTES // (width * np.dtype(NUMPY_DTYPE[storage_dtype]).itemsize))


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


def read_meta(path: str | Path | Location) -> Dict[str, Any]:
    """The "gradian" attribute of the index at `path` (a local path or a URL); `IndexFormatError` if it is not an index."""
    path = path if isinstance(path, Location) else Location(path)
    try:
        group = path.open_group("r")
        meta = dict(group.attrs[ATTRIBUTE])
    except Exception:
        raise IndexFormatError(
            f"{str(path)!r} is not a Gradian index (no zarr group with a '{ATTRIBUTE}' attribute); point index.path at one written by `gradian index`"
        ) from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise IndexFormatError(
            f"{str(path)!r} is a Gradian index of format version {version}, this gradian reads version {FORMAT_VERSION}; rebuild it with `gradian index` or install the gradian release that wrote it"
        )
    return meta
