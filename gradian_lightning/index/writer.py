"""`IndexWriter`: rows at their dataset positions, a whole chunk at a time; resumes killed runs.

The layout it writes is described in `layout.py`.
"""

from __future__ import annotations

import contextlib
import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr
from tqdm.auto import tqdm

from gradian_lightning.data import ID_BATCH, id_hashes
from gradian_lightning.errors import ConfigError, DataError, GradianError, IndexWriteError
from gradian_lightning.gradients.projection import ModuleBlock
from gradian_lightning.index.layout import (
    ATTRIBUTE,
    FORMAT_VERSION,
    NORMS,
    NUMPY_DTYPE,
    ROW_ARRAYS,
    SCALES,
    IndexMeta,
    chunk_rows,
    decode,
    encode,
    fingerprint,
    has_member,
    identity,
    module_norms,
    row_block,
    stored_meta,
)
from gradian_lightning.index.location import Location
from gradian_lightning.index.statistics import (
    STATISTICS_GROUP,
    WHITENED_DAMPING,
    counted,
    statistics_steps,
    write_statistics,
)
from gradian_lightning.specs import DEFAULT_DAMPING

# The close's progress line (`IndexWriter.close`) shows once its statistics have taken this long:
# a close of a few seconds (k <= 16, or few rows) prints nothing, a long one (k = 32 from 1,024 rows:
# one 1,024² eigendecomposition a module) says what it is doing and how far it is.
CLOSE_PROGRESS_DELAY_S = 2.0


def _flatten(value: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def differing_keys(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """The dotted keys of `layout.identity` (what the fingerprint hashes) that differ between two indexes' metadata.

    Each entry reads `key (stored -> now)`; lists (the module layout) are compared whole.
    """
    try:
        was, now = _flatten(identity(old)), _flatten(identity(new))
    except KeyError:  # written by IndexWriter directly, without a spec or model
        keys = [k for k in ("fingerprint", "num_rows") if old.get(k) != new.get(k)]
        return [f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in keys] or ["fingerprint"]
    if old.get("num_rows") != new.get("num_rows"):
        was["num_rows"], now["num_rows"] = old.get("num_rows"), new.get("num_rows")
    keys = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    return [
        k if isinstance(was.get(k), list) or isinstance(now.get(k), list) else f"{k} ({was.get(k)!r} -> {now.get(k)!r})"
        for k in keys
    ] or ["fingerprint"]


def _weights(attrs: Dict[str, Any]) -> Optional[str]:
    """The digest of the weights an index's rows were made with (None when not recorded)."""
    return (attrs.get("model") or {}).get("weights_sha256")


class StoredIds:
    """The ids of the first `rows` rows of the index `group` at `path`, held as sorted 64-bit
    hashes and their positions (16 bytes a row), to refuse appended rows that repeat one."""

    def __init__(self, group: zarr.Group, rows: int, path: Any) -> None:
        self.group, self.path = group, path
        hashes = id_hashes(
            (group["id"][lo : min(lo + ID_BATCH, rows)].tolist() for lo in range(0, rows, ID_BATCH)), rows
        )
        self.order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[self.order]

    def refuse(self, ids: Iterable[Any]) -> None:
        """`DataError` naming the first of `ids` (appended rows' ids) that a stored row holds."""
        for value in ids:
            h = hash(str(value))
            at = int(np.searchsorted(self.hashes, h))
            while at < len(self.hashes) and self.hashes[at] == h:
                if str(self.group["id"][int(self.order[at])]) == str(value):
                    raise DataError(
                        f"appended row id {str(value)!r} is also the id of row {int(self.order[at]) + 1} of the index at {str(self.path)!r}; ids name rows in results, so appended rows need ids of their own (rows without an id column are numbered on by gradian index)"
                    )
                at += 1


@dataclass
class _Buffered:
    """Rows of one `IndexWriter.write` call that fall in one chunk, kept until the chunk is flushed:
    dataset positions [b], stored rows [b, D] and int8 scales [b, M] (or None), ids, and the loss,
    supervised, truncated and finite columns [b]."""

    positions: np.ndarray
    stored: Any
    scales: Any
    ids: List[str]
    columns: Tuple[np.ndarray, ...]


class IndexWriter:
    """Writes rows at their dataset positions, a whole chunk at a time, and resumes killed runs.

    `path` is a local directory or an fsspec URL (`location.py`). If it holds an index with the same
    `meta["fingerprint"]` and `global_step`, rows already marked complete are kept (`kept_rows`)
    and `todo` excludes them. An index of the same fingerprint at
    another step (the same job, other weights) is replaced. Anything else at `path` is replaced
    only when `overwrite` is true: a different index or a foreign directory is never lost silently,
    and the refusal names the differing keys of `layout.identity(meta)`. `rows_per_chunk` overrides the
    ~4 MiB grads chunk of at most 16,384 rows (`layout.chunk_rows`): the unit a killed run loses at most.
    """

    def __init__(
        self,
        path: str | Path,
        num_rows: int,
        width: int,
        storage_dtype: str,
        meta: Dict[str, Any],
        overwrite: bool = False,
        rows_per_chunk: Optional[int] = None,
        append: bool = False,
    ) -> None:
        self.path, self.num_rows, self.width, self.storage_dtype = Location(path), num_rows, width, storage_dtype
        # append: this run's num_rows rows go after the `offset` rows of the complete index at path
        # (`_open_to_append`); `write` and `todo` then speak of this run's rows, 0 .. num_rows - 1.
        self.append, self.offset = append, 0
        self._old_ids: Optional[StoredIds] = None
        # The metadata and statistics' whitened damping of the complete index this run grew, and
        # whether a refused row put them back (the writer then writes nothing more).
        self._found: Optional[Tuple[Dict[str, Any], Any]] = None
        self._undone = False
        # The spec's one record of the storage dtype is what this writer encodes with.
        given = dict(meta)
        spec = {**given.get("spec", {}), "storage_dtype": storage_dtype}
        # The module layout is the one record of the width: rows written without one are one block.
        modules = given.get("modules") or [row_block(width).to_entry()]
        if sum(int(b["size"]) for b in modules) != width:
            raise GradianError(
                f"IndexWriter(width={width}) does not match its module layout ({sum(int(b['size']) for b in modules)} values a row)"
            )
        self.attrs = {
            **given,
            "format_version": FORMAT_VERSION,
            "num_rows": num_rows,
            "modules": modules,
            "spec": spec,
            "complete": False,
        }
        # A chunk never outgrows the index: uncompressed, the padding of a partial chunk is written out.
        self.chunk = min(rows_per_chunk or chunk_rows(width, storage_dtype), max(num_rows, 1))
        if overwrite:
            self.path.refuse_working_folder()  # before the lock file is made in it
        self._lock = self.path.writer_lock()  # before anything is read or removed
        try:
            self.group = self._open_or_create(overwrite)
        except BaseException:
            self._release(refused=True)
            raise
        self.chunk = self.group["grads"].chunks[0]  # a resumed index keeps the chunking it was made with
        self.blocks = [ModuleBlock.from_entry(b) for b in self.attrs["modules"]]
        self.done = np.asarray(self.group["complete"][:], dtype=bool)
        self.kept_rows = int(self.done[self.offset :].sum())  # rows an earlier, interrupted run already wrote
        # Rows written but not yet flushed, per chunk: one `_Buffered` a batch, as arrays. Per-row
        # Python objects (a dict entry, tuples, a view of the row) cost about 1 KB a row, and a chunk
        # of narrow rows holds 131,072 of them at ~4 MiB of int8 (k = 4): 10^6 rows then peaked at
        # 1.5x the RSS of 10^4 (benchmarks/RESULTS.md §9). `_buffered` marks their positions.
        self._pending: Dict[int, List[_Buffered]] = {}
        self._buffered = np.zeros(len(self.done), dtype=bool)
        self.nonfinite_rows: List[int] = []

    @property
    def step(self) -> Optional[int]:
        """The global step of the weights the rows are made with, as the caller said (meta)."""
        return self.attrs.get("global_step")

    @property
    def todo(self) -> np.ndarray:
        """Bool [num_rows of this run]: rows still to be written."""
        return ~self.done[self.offset :]

    def _open_or_create(self, overwrite: bool) -> zarr.Group:
        try:
            return self._open_or_create_unchecked(overwrite)
        except GradianError:
            raise
        except (
            Exception
        ) as err:  # each filesystem says "read-only" its own way: PermissionError, OSError(EROFS), ValueError, ...
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ConfigError(
                f"setting 'index.path'={str(self.path)!r} cannot be written ({type(err).__name__}: {first}); point index.path at a writable directory or bucket"
            ) from None

    def _open_or_create_unchecked(self, overwrite: bool) -> zarr.Group:
        if not self.path.is_empty():
            old = stored_meta(self.path)
            if old is not None and old.get("format_version") != FORMAT_VERSION and not overwrite:
                IndexMeta.from_attrs(old, repr(str(self.path)))  # refused in one line, naming the version
            if (
                self.append
                and old is not None
                and (old.get("segments") or old.get("fingerprint") != self.attrs.get("fingerprint"))
            ):
                return self._open_to_append(old)
            same_job = (
                old is not None
                and old.get("fingerprint") == self.attrs.get("fingerprint")
                and old.get("num_rows") == self.num_rows
            )
            # index.overwrite=true replaces even an index of this job, unless it is an unfinished one
            # of these weights: its rows are the ones this run would compute, so a rerun resumes.
            resumable = not overwrite or (
                same_job and not old.get("complete") and _weights(old) == _weights(self.attrs)
            )
            if same_job and old.get("global_step") == self.attrs.get("global_step") and resumable:
                group = self.path.open_group("r+")
                group.attrs[ATTRIBUTE] = {
                    **old,
                    "complete": False,
                }  # the first write: a read-only store fails here, not after the first chunk
                return group
            if not (same_job or overwrite):
                if old is None:
                    raise self.path.not_an_index()
                raise ConfigError(
                    f"index.path {str(self.path)!r} holds a Gradian index of another configuration (differing: {', '.join(differing_keys(old, self.attrs))}); "
                    "run with the stored settings to resume it, choose another index.path, or pass index.overwrite=true to replace it"
                )
            self.path.remove_index(holds_index=old is not None)
        # "a", not "w": zarr's "w" clears the folder, and with it the writer's lock file.
        group = self.path.open_group("a")
        # No compressor: zstd saved 7% on float16 gradients (benchmarks/RESULTS.md, index size) but
        # cut the read rate that bounds query throughput by 3-4x.
        group.create_array(
            "grads",
            shape=(self.num_rows, self.width),
            chunks=(self.chunk, self.width),
            dtype=NUMPY_DTYPE[self.storage_dtype],
            fill_value=0,
            compressors=None,
        )
        row_chunk = max(self.chunk, 4096)
        for name, (dtype, fill) in ROW_ARRAYS.items():
            group.create_array(name, shape=(self.num_rows,), chunks=(row_chunk,), dtype=dtype, fill_value=fill)
        # Chunked like the per-row arrays: a reader gets the norms of many grads chunks in one read.
        modules = len(self.attrs["modules"])
        # The scales are stored raw, like the rows: a scattered read (ANN candidates,
        # `IndexReader.rows_at`) then takes each row's M floats, where zstd (which saved 9%) made it
        # decompress every 4,096-row chunk a candidate falls in (0.1-0.16 s for 800 rows of 10⁶).
        for name in (NORMS, SCALES) if self.storage_dtype == "int8" else (NORMS,):
            group.create_array(
                name,
                shape=(self.num_rows, modules),
                chunks=(row_chunk, modules),
                dtype=np.float32,
                fill_value=0.0,
                **({"compressors": None} if name == SCALES else {}),
            )
        group.attrs[ATTRIBUTE] = self.attrs
        return group

    def _open_to_append(self, old: Dict[str, Any]) -> zarr.Group:
        """Open the index `old` describes to add this run's rows after its own: resuming this
        run if it is the index's last append, else checking the index takes them (the same
        identity but for the data, the same weights, complete) and growing every per-row array."""
        segments = IndexMeta.from_attrs(old, repr(str(self.path))).data_segments()
        run = {"data": self.attrs.get("data"), "rows": self.num_rows, "fingerprint": self.attrs.get("fingerprint")}
        last = segments[-1]
        if last.get("fingerprint") == run["fingerprint"] and last["rows"] == self.num_rows:
            self.offset = int(last["offset"])  # an interrupted (or finished) append of these rows: resume it
            self.num_rows, self.attrs = int(old["num_rows"]), {**old, "complete": False}
            group = self.path.open_group("r+")
            group.attrs[ATTRIBUTE] = self.attrs
            self._old_ids = StoredIds(group, self.offset, self.path)
            return group
        if old.get("checkpoints"):
            raise ConfigError(
                f"index.append=true adds rows to a one-checkpoint index, and {str(self.path)!r} holds checkpoints; choose another index.path"
            )
        same = {"data": None, "num_rows": 0}
        differing = [k for k in differing_keys({**old, **same}, {**self.attrs, **same}) if k != "fingerprint"]
        if differing:
            raise ConfigError(
                f"index.append=true adds rows made as the rows of the index at {str(self.path)!r} were, and these differ (differing: {', '.join(differing)}); append with its settings, or choose another index.path"
            )
        was, now = _weights(old), _weights(self.attrs)
        if was != now:
            raise ConfigError(
                f"index.append=true adds rows made with the weights the index at {str(self.path)!r} was built from (weights digest {was}); this model's are {now}; append with that model, or choose another index.path"
            )
        if not old.get("complete"):
            raise ConfigError(
                f"index.append=true adds rows to a complete index, and the one at {str(self.path)!r} is unfinished; rerun the command that was writing it to finish it first"
            )
        self.offset, total = int(old["num_rows"]), int(old["num_rows"]) + self.num_rows
        segments.append({**run, "offset": self.offset})
        self.num_rows = total
        self.attrs = {
            **old,
            "num_rows": total,
            "segments": segments,
            "fingerprint": fingerprint({"segments": [s["fingerprint"] for s in segments]}),
            "complete": False,
        }
        group = self.path.open_group("r+")
        for name in ("grads", NORMS, SCALES, *ROW_ARRAYS):
            if has_member(group, name, zarr.Array):
                array = group[name]
                array.resize((total, *array.shape[1:]))
                if name in ROW_ARRAYS:  # the new rows start unwritten, whatever a partial last chunk held
                    array[self.offset :] = np.full(self.num_rows - self.offset, ROW_ARRAYS[name][1], dtype=array.dtype)
        whitened = None
        if has_member(group, STATISTICS_GROUP, zarr.Group):
            # its whitened norms are of the old rows only
            whitened = group[STATISTICS_GROUP].attrs.pop(WHITENED_DAMPING, None)
        self._found = (old, whitened)  # what a refused appended row puts back (`_undo_append`)
        self._old_ids = StoredIds(group, self.offset, self.path)
        group.attrs[ATTRIBUTE] = self.attrs
        return group

    def write(
        self,
        indices: Sequence[int],
        grads: torch.Tensor,
        loss: torch.Tensor,
        supervised: torch.Tensor,
        truncated: torch.Tensor,
        ids: Sequence[str],
    ) -> None:
        """Buffer rows (float32 grads [b, D]; loss, supervised, truncated [b]) at `indices`, positions
        among this run's rows, and flush full chunks.

        Rows with NaN/inf are stored as zeros with `finite=False` and listed in `nonfinite_rows`.
        """
        positions = np.asarray([int(i) for i in indices], dtype=np.int64) + self.offset
        if self._old_ids is not None:
            try:
                self._old_ids.refuse(ids)
            except DataError:
                self._undo_append()
                raise
        finite = torch.isfinite(grads).all(dim=1) & torch.isfinite(loss)
        grads = torch.where(finite[:, None], grads, torch.zeros_like(grads))
        stored, scales = encode(grads, self.storage_dtype, self.blocks)
        # Skipped: rows already written (a resumed run) or buffered, and a row's second copy in this
        # batch (a distributed sampler pads ranks with repeated rows).
        first = np.zeros(len(positions), dtype=bool)
        first[np.unique(positions, return_index=True)[1]] = True
        take = np.flatnonzero(first & ~self.done[positions] & ~self._buffered[positions])
        finite_np = finite.cpu().numpy()
        self.nonfinite_rows += [int(i) for i in positions[take][~finite_np[take]]]
        self._buffered[positions[take]] = True
        columns = (*(torch.as_tensor(c).detach().cpu().numpy() for c in (loss, supervised, truncated)), finite_np)
        chunk_of = positions[take] // self.chunk
        touched = [int(c) for c in np.unique(chunk_of)]
        for c in touched:
            sel = take[chunk_of == c]
            self._pending.setdefault(c, []).append(
                _Buffered(
                    positions[sel],
                    stored[sel],
                    None if scales is None else scales[sel],
                    [ids[j] for j in sel],
                    tuple(column[sel] for column in columns),  # fancy indexing copies
                )
            )
        with self._disk_full_is_one_line():
            for c in touched:
                lo, hi = c * self.chunk, min((c + 1) * self.chunk, self.num_rows)
                if int(self.done[lo:hi].sum()) + int(self._buffered[lo:hi].sum()) == hi - lo:
                    self._flush(c)

    def _undo_append(self) -> None:
        """Put the complete index this append grew back as it was found, byte for byte: the rows
        past `offset` and their chunks go (a shared last chunk back to its fill values, as it was
        written), and the metadata and statistics' attributes return. Nothing is written after."""
        if self._found is None:
            return  # a resumed append: the index was already unfinished, and stays so
        (old, whitened), group = self._found, self.group
        for name in ("grads", NORMS, SCALES, *ROW_ARRAYS):
            if has_member(group, name, zarr.Array):
                array = group[name]
                edge = min(array.shape[0], -(-self.offset // array.chunks[0]) * array.chunks[0])
                if edge > self.offset:  # the old rows' last chunk also holds new rows: zarr keeps them past a shrink
                    array[self.offset : edge] = array.fill_value
                array.resize((self.offset, *array.shape[1:]))
        if whitened is not None:
            group[STATISTICS_GROUP].attrs[WHITENED_DAMPING] = whitened
        group.attrs[ATTRIBUTE] = old
        self._pending.clear()
        self._buffered = np.zeros(self.offset, dtype=bool)
        self.done, self.num_rows, self.attrs, self._undone = self.done[: self.offset], self.offset, old, True

    @contextlib.contextmanager
    def _disk_full_is_one_line(self) -> Iterator[None]:
        # A flush writes data before completion flags (_flush), so what is marked complete survives.
        try:
            yield
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise IndexWriteError(
                f"no space left where index.path {str(self.path)!r} is stored ({int(self.done.sum())} of {self.num_rows} rows are safely written); free some space, then rerun the same command: it resumes from those rows"
            ) from None

    def _release(self, refused: bool = False) -> None:
        if self._lock is not None:
            self.path.unlock(self._lock, refused)
            self._lock = None

    def _flush(self, c: int) -> None:
        parts = self._pending.pop(c)
        positions = np.concatenate([part.positions for part in parts])
        sort = np.argsort(positions, kind="stable")
        order = positions[sort]
        lo, hi = int(order[0]), int(order[-1]) + 1
        contiguous = hi - lo == len(order)
        where = slice(lo, hi) if contiguous else order
        # The data goes first and the completion flags last, so a killed run never leaves a row
        # marked complete whose data is not on disk.
        block = np.concatenate([np.asarray(part.stored) for part in parts])[sort]
        scales = (
            np.concatenate([np.asarray(part.scales) for part in parts])[sort] if self.storage_dtype == "int8" else None
        )
        # What a reader will see: the norms (and, read back at close, the statistics) are of these values.
        decoded = decode(block, self.storage_dtype, scales=scales, blocks=self.blocks)
        self._set("grads", where, block)
        if scales is not None:  # before `complete`, like the row itself
            self._set(SCALES, where, scales)
        self._set(NORMS, where, module_norms(decoded, self.blocks).numpy())
        ids = [i for part in parts for i in part.ids]
        self._set("id", where, np.asarray([ids[j] for j in sort], dtype=ROW_ARRAYS["id"][0]))
        for n, name in enumerate(("loss", "supervised_tokens", "truncated_tokens", "finite")):
            values = np.concatenate([part.columns[n] for part in parts])[sort]
            self._set(name, where, values.astype(ROW_ARRAYS[name][0]))
        self._set("complete", where, np.ones(len(order), dtype=bool))
        self.done[order] = True
        self._buffered[order] = False

    def _decoded(self, lo: int, hi: int, a: int, b: int) -> torch.Tensor:
        """float32 rows lo..hi-1 of module blocks a..b-1 as written, read back from disk."""
        blocks = self.blocks[a:b]
        first, last = blocks[0].offset, blocks[-1].offset + blocks[-1].size
        scales = self.group[SCALES][lo:hi, a:b] if self.storage_dtype == "int8" else None
        return decode(self.group["grads"][lo:hi, first:last], self.storage_dtype, scales=scales, blocks=blocks)

    def _set(self, name: str, where: slice | np.ndarray, values: np.ndarray) -> None:
        array = self.group[name]
        if isinstance(where, slice):
            array[where] = values
        else:
            array.oindex[where] = values

    def close(self, extra_meta: Optional[Dict[str, Any]] = None) -> bool:
        """Flush every buffered row, store the row statistics (and, once every row is written, the
        rows' whitened norms); mark the index complete when every row is. Returns that flag."""
        if self._undone:  # a refused append put the complete index back: leave it so
            self._release()
            return True
        try:
            with self._disk_full_is_one_line():
                for c in sorted(self._pending):
                    self._flush(c)
                complete = bool(self.done.all())
                keep = self.done & counted(self.group["finite"][:], self.group["supervised_tokens"][:])
                damping = DEFAULT_DAMPING if complete else None  # the default query's damping: it never whitens a chunk
                # Like Lightning's validation bar, gone when done: the summary line follows it.
                with tqdm(
                    total=statistics_steps(self.blocks, self.width, damping),
                    desc="closing the index: row statistics",
                    unit="module",
                    delay=CLOSE_PROGRESS_DELAY_S,
                    leave=False,
                    dynamic_ncols=True,
                ) as bar:
                    write_statistics(
                        self.group,
                        self._decoded,
                        keep,
                        self.blocks,
                        self.width,
                        self.chunk,
                        self.width * np.dtype(NUMPY_DTYPE[self.storage_dtype]).itemsize,
                        damping,
                        progress=bar,
                    )
                self.group.attrs[ATTRIBUTE] = {**self.attrs, **(extra_meta or {}), "complete": complete}
        finally:
            self._release()
        return complete
