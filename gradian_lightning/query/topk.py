"""Streaming top-k: rank an index's rows for query rows, one chunk at a time.

    index chunks -> `_read_ahead` (the next chunk read on a worker thread)
                 -> `streaming_topk`: per chunk [c, D], scores [Q, c] = queries @ rowsᵀ in float32
                    on one device, merged into a running top-k (and bottom-k) per query

Memory is the query rows, two chunks (one scored, one read ahead) and the running [Q, k] state:
it does not grow with N.
Rows with zero supervised tokens, NaN/inf gradients or not yet written are never ranked.
`score_all` gives every row's score by the same loop (for `gradian validate` and `gradian report`).
`open_index(path)` returns an `Index`: the store's reader and these two, by keyword.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gradian_lightning.errors import IndexMismatchError
from gradian_lightning.index.checkpoints import checkpoint_weights
from gradian_lightning.index.layout import equal_block_size, module_blocks, module_norms
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.precondition import Preconditioner, preconditioner, resolve, resolved_spec
from gradian_lightning.specs import QuerySpec, spec_from_arguments

# Scores held before they are merged into the running top-k: [Q, 4096] float32 is 16 KiB a query.
MERGE_COLUMNS = 4096


@dataclass
class Ranking:
    """The best rows per query, best first. Rows hold fewer than k entries when fewer rows are rankable.

    `indices` int64 [Q, k'] dataset positions; `scores` float32 [Q, k'], k' = min(k, rankable rows).
    """

    indices: torch.Tensor
    scores: torch.Tensor
    opponents: Optional["Ranking"] = None  # the most negative rows, most negative first, when asked for


def _unit(rows: torch.Tensor) -> torch.Tensor:
    # A zero row (nothing supervised, or an exactly zero gradient) scores 0 rather than NaN.
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(torch.finfo(rows.dtype).tiny)


def _merge(best: Ranking, scores: torch.Tensor, positions: torch.Tensor, k: int, largest: bool) -> Ranking:
    values = torch.cat([best.scores, scores], dim=1)
    indices = torch.cat([best.indices, positions.expand(scores.shape[0], -1)], dim=1)
    top = values.topk(min(k, values.shape[1]), dim=1, largest=largest, sorted=True)
    return Ranking(indices.gather(1, top.indices), top.values)


def _unit_modules(
    rows: torch.Tensor, blocks: Sequence[Dict[str, Any]], norms: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Scale each module's block of `rows` [n, D] to unit L2 norm, in place; a zero block stays zero.

    `norms` [n, M] are the blocks' norms when known (stored by the writer), else computed here.
    One multiply by the reciprocal either way, so stored and computed norms give the same bits.
    """
    norms = module_norms(rows, blocks) if norms is None else norms.to(rows.device)
    inverse = norms.clamp_min(torch.finfo(rows.dtype).tiny).reciprocal_()
    if equal_block_size(blocks, rows.shape[1]) is not None:  # projected: one multiply over a [n, M, k²] view
        rows.view(rows.shape[0], len(blocks), -1).mul_(inverse[:, :, None])
        return rows
    for m, b in enumerate(blocks):
        rows[:, int(b["offset"]) : int(b["offset"]) + int(b["size"])].mul_(inverse[:, m : m + 1])
    return rows


def prepare_queries(
    index: IndexReader,
    query_rows: torch.Tensor,
    spec: QuerySpec,
    device: Optional[torch.device | str] = None,
    whitened_norms: bool = False,
) -> Tuple[torch.Tensor, Optional[Preconditioner]]:
    """Query rows scaled once as `score_chunk` treats a chunk of `index`: preconditioned, then normalised.

    Returns (queries [Q, D] float32 on `device` (default: the rows' device), the preconditioner
    the chunks need or None). With `whitened_norms` (for fisher, when the caller scores chunks with
    the index's stored whitened norms, `uses_whitened_norms`), the queries are whitened a second
    time and no preconditioner is returned: (W·Wq)·r / |Wr| = (Wq)·(Wr) / |Wr|, so a chunk is
    only scaled, never whitened. Raises `IndexMismatchError` for rows of another width.
    """
    width = int(index.meta["width"])
    if query_rows.dim() != 2 or query_rows.shape[1] != width:
        raise IndexMismatchError(
            f"query rows have shape {tuple(query_rows.shape)} but the index at {str(index.path)!r} holds rows of width {width}; compute them with query_gradients on this index"
        )
    device = torch.device(device) if device is not None else query_rows.device
    queries = query_rows.detach().to(device=device, dtype=torch.float32)
    spec = resolved_spec(index, spec)
    transform = preconditioner(index, spec.precondition, spec.damping)
    if transform is not None:
        transform = transform.to(device)
        queries = transform(queries)
    if spec.score == "cosine" and spec.normalize == "module":
        blocks = module_blocks(index.meta)
        queries = _unit_modules(queries.clone(), blocks) / len(blocks)  # / M: scores are a mean of cosines
    elif spec.score == "cosine":
        queries = _unit(queries)
    if whitened_norms:
        queries, transform = transform(queries), None
    return queries, transform


def uses_whitened_norms(index: IndexReader, spec: QuerySpec) -> bool:
    """Whether fisher scores of `index` can skip whitening its rows: always for inner products, and
    for cosine when the index stores its rows' whitened norms for this damping (statistics.py)."""
    if resolve(index, spec.precondition) != "fisher":
        return False
    stored = index.whitened_damping
    return spec.score == "inner" or (stored is not None and float(stored) == float(spec.damping))


def score_chunk(
    queries: torch.Tensor,
    rows: torch.Tensor,
    blocks: Sequence[Dict[str, Any]],
    spec: QuerySpec,
    transform: Optional[Preconditioner] = None,
    norms: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Scores [Q, c] float32 of a chunk of decoded rows [c, D] against `prepare_queries` output [Q, D].

    `rows` must be a tensor the caller does not need afterwards (a decoded chunk): per-module
    cosine normalises it in place. `norms` [c, M]: the per-module norms of the rows as they are
    compared (`IndexReader.stored_norms`, or `whitened_norms` for queries prepared with
    `whitened_norms=True`), which spare cosine its norm pass; ignored under a preconditioner,
    whose rows have other norms. Both engines, local and Dask, score with this one function.
    """
    # An invariant of the callers, not a user's input: they resolve "auto" for their index first.
    assert "auto" not in (spec.normalize, spec.precondition), "resolve the spec first (precondition.resolved_spec)"
    score = spec.score
    if transform is not None:
        rows, norms = transform(rows), None
    by_module = score == "cosine" and spec.normalize == "module"
    if by_module:
        rows = _unit_modules(rows, blocks, norms)
    scores = queries @ rows.T  # [Q, c] float32
    if (
        score == "cosine" and not by_module
    ):  # dividing the scores by the row norms saves normalising a copy of the chunk
        row_norms = (
            torch.linalg.vector_norm(rows, dim=1)
            if norms is None
            else torch.linalg.vector_norm(norms.to(rows.device), dim=1)
        )
        scores /= row_norms.clamp_min(torch.finfo(rows.dtype).tiny)
    return scores


def _scored_chunks(
    index: IndexReader,
    query_rows: torch.Tensor | Dict[int, torch.Tensor],
    spec: QuerySpec,
    device: Optional[torch.device | str],
) -> Iterator[Tuple[int, int, np.ndarray, torch.Tensor]]:
    """(lo, hi, rankable mask [c], scores [Q, c] float32 on `device`) for every chunk of `index`
    with a rankable row: each chunk read once (ahead, on a worker thread), decoded into one reused
    buffer and scored as one matmul per checkpoint, the checkpoints' scores weighted and summed.
    The one scoring loop of `streaming_topk` and `score_all`; their arguments are its own."""
    spec = resolved_spec(index, spec)  # one meaning of "auto" for every checkpoint: they count the same rows
    if isinstance(query_rows, torch.Tensor):
        chosen = [(index, query_rows, 1.0)]
    else:
        chosen = []
        for entry, weight in checkpoint_weights(index.checkpoints, spec.checkpoints):
            step = int(entry["step"])
            if step not in query_rows:
                raise IndexMismatchError(
                    f"query rows were made at checkpoints {sorted(query_rows)} but query.checkpoints={spec.checkpoints!r} needs step {step} of the index at {str(index.path)!r}; make query rows with each checkpoint's weights"
                )
            chosen.append((index if step == index.step else index.at(step), query_rows[step], weight))
    device = torch.device(device) if device is not None else chosen[0][1].device
    parts = []  # (reader, queries, transform, weight, the reader's method giving the chunk's norms or None)
    for reader, rows, weight in chosen:
        # Fisher without whitening every chunk where the index allows it (`uses_whitened_norms`).
        whitened = uses_whitened_norms(reader, spec)
        queries, transform = prepare_queries(reader, rows, spec, device, whitened)
        norms_of = (
            None
            if spec.score != "cosine" or transform is not None
            else reader.whitened_norms
            if whitened
            else reader.stored_norms
        )
        parts.append((reader, queries, transform, weight, norms_of))
    buffer: Optional[torch.Tensor] = None  # one float32 chunk, decoded into for every chunk: no fresh pages per chunk
    for lo, hi, keep, stored in _read_ahead(parts[0][0], [reader for reader, *_ in parts]):
        if buffer is None or len(buffer) < hi - lo:
            buffer = torch.empty(hi - lo, stored[0].shape[1])
        scores = None
        for (reader, queries, transform, weight, norms_of), chunk in zip(parts, stored):
            rows = reader.decode(chunk, lo, hi, out=buffer[: hi - lo]).to(device)
            part = score_chunk(
                queries, rows, module_blocks(reader.meta), spec, transform, norms_of(lo, hi) if norms_of else None
            )
            scores = part.mul_(weight) if scores is None else scores.add_(part, alpha=weight)
        yield lo, hi, keep, scores


def streaming_topk(
    index: IndexReader,
    query_rows: torch.Tensor | Dict[int, torch.Tensor],
    spec: QuerySpec,
    *,
    device: Optional[torch.device | str] = None,
) -> tuple[Ranking, Optional[Ranking]]:
    """The `spec.top_k` best rows of `index` per query (and, when `spec.bottom_k` > 0, the bottom-k:
    most negative first). Returns (top, bottom or None).

    `query_rows` [Q, D] float32 made at the index's checkpoint (its newest), or a dict
    {checkpoint step: [Q, D]} with the rows made at each checkpoint's weights; then
    `spec.checkpoints` says whose scores are summed, weighted by their learning rates
    (index/checkpoints.py). `spec` (specs.QuerySpec) says how rows score: cosine per module
    (default; the mean over modules of the per-module cosines, so a module with large gradients
    cannot outvote the rest: benchmarks/RANKING.md) or per row, or inner products, after the
    preconditioner (query/precondition.py) is applied to query and training rows.
    Each chunk is scored as one float32 matmul per checkpoint on `device` (default: the queries').
    """
    k, bottom_k = spec.rows_wanted(len(index)), spec.bottom_k
    first = next(iter(query_rows.values())) if isinstance(query_rows, dict) else query_rows
    device = torch.device(device) if device is not None else first.device
    empty = Ranking(
        torch.empty(len(first), 0, dtype=torch.long, device=device), torch.empty(len(first), 0, device=device)
    )
    top, bottom = empty, empty
    held: list = []  # (scores [Q, c], positions [c]) of chunks not yet merged into top/bottom

    def merge() -> None:
        nonlocal top, bottom
        scores, kept = torch.cat([s for s, _ in held], dim=1), torch.cat([p for _, p in held])
        held.clear()
        top = _merge(top, scores, kept, k, largest=True)
        if bottom_k:
            bottom = _merge(bottom, scores, kept, bottom_k, largest=False)

    for lo, hi, keep, scores in _scored_chunks(index, query_rows, spec, device):
        # Every row is decoded and scored, and the columns of rows that must go are dropped
        # afterwards: cheaper than copying the kept rows out of the chunk.
        kept = torch.arange(lo, hi)
        if not keep.all():
            keep = torch.from_numpy(keep)
            scores, kept = scores[:, keep.to(device)], kept[keep]
        held.append((scores, kept.to(device)))
        # Merging a few thousand scores at once: the top-k's fixed cost per call is paid once, not per chunk.
        if sum(len(p) for _, p in held) >= MERGE_COLUMNS:
            merge()
    if held:
        merge()
    return top, (bottom if bottom_k else None)


def score_all(
    index: IndexReader,
    query_rows: torch.Tensor | Dict[int, torch.Tensor],
    spec: QuerySpec,
    *,
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """Every query's score of every row of `index`: float32 [Q, N] on the CPU, NaN where a row is
    never ranked (not written, not finite, nothing supervised).

    The same scores `streaming_topk` ranks, by the same loop, with the same arguments (`spec`'s
    preconditioner, normalisation and checkpoints; its top_k and bottom_k are not used): what
    `gradian validate` and `gradian report` need of every row. Streamed chunk by chunk, so memory
    is the [Q, N] result plus one chunk.
    """
    first = next(iter(query_rows.values())) if isinstance(query_rows, dict) else query_rows
    out = torch.full((len(first), len(index)), float("nan"))
    for lo, hi, keep, scores in _scored_chunks(index, query_rows, spec, device):
        block = scores.cpu()
        block[:, ~torch.from_numpy(keep)] = float("nan")
        out[:, lo:hi] = block
    return out


def _read_ahead(
    lead: IndexReader, readers: Sequence[IndexReader]
) -> Iterator[Tuple[int, int, np.ndarray, List[np.ndarray]]]:
    """(lo, hi, rankable mask [c], each reader's rows lo..hi-1 as stored [c, D]) for every chunk of
    `lead` with a rankable row. The next chunk is read on a worker thread while the caller decodes
    and scores this one: the zarr read is the slowest step at small Q, and the two otherwise run
    one after the other (benchmarks/RESULTS.md §5: 0.51 -> 0.81 of the slower floor at Q = 8).
    Decoding stays with the caller, into its one reused buffer: on the worker it measured slower."""
    chunks = iter(lead.stored_chunks())  # advanced on the worker only: that is where the read happens

    def read() -> Optional[Tuple[int, int, np.ndarray, List[np.ndarray]]]:
        following = next(chunks, None)
        if following is None:
            return None
        lo, stored = following
        hi = lo + len(stored)
        return (
            lo,
            hi,
            np.logical_and.reduce([r.rankable(lo, hi) for r in readers]),
            [stored if r is lead else r.stored(lo, hi) for r in readers],
        )

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(read)
        while (item := pending.result()) is not None:
            pending = pool.submit(read)
            if item[2].any():
                yield item


class Index:
    """An index opened for querying: the store's `reader` and the scoring of its rows (`topk`,
    `score_all`).

    It is not a reader itself (the store knows nothing of scoring): what the reader has (`meta`,
    `rows`, `column`, `checkpoints`, ...) is looked up on `reader`, so an `Index` goes wherever an
    `IndexReader` is read, and `at(step)` gives the `Index` of one checkpoint.
    """

    def __init__(self, path: str | Path | IndexReader, checkpoint: Optional[int] = None) -> None:
        self.reader = path if isinstance(path, IndexReader) else IndexReader(path, checkpoint)

    def __getattr__(self, name: str) -> Any:
        # Only reached for what Index lacks: the reader's attributes and methods.
        return getattr(self.__dict__["reader"] if "reader" in self.__dict__ else None, name)

    def __len__(self) -> int:
        return len(self.reader)

    def at(self, step: int) -> "Index":
        """The same index at checkpoint `step` (one of `checkpoints`)."""
        return Index(self.reader.at(step))

    def topk(
        self,
        query_rows: torch.Tensor | Dict[int, torch.Tensor],
        k: Any = QuerySpec.top_k,
        *,
        device: Optional[torch.device | str] = None,
        **settings: Any,
    ) -> Ranking:
        """The k best rows per query (`streaming_topk`), with the `bottom_k` most negative ones
        in `opponents` when asked for.

        `query_rows` [Q, D] float32, e.g. from `gradian_lightning.query_gradients`, or
        {checkpoint step: [Q, D]}; `k` is the `QuerySpec`'s top_k and `settings` its other fields
        (specs.py: score, normalize, precondition, ...). The index is streamed chunk by chunk.
        """
        spec = spec_from_arguments(QuerySpec, "Index.topk", (), {"top_k": k, **settings}, ("query_rows", "k", "device"))
        top, bottom = streaming_topk(self.reader, query_rows, spec, device=device)
        return Ranking(top.indices, top.scores, opponents=bottom)

    def score_all(
        self,
        query_rows: torch.Tensor | Dict[int, torch.Tensor],
        *,
        device: Optional[torch.device | str] = None,
        **settings: Any,
    ) -> torch.Tensor:
        """Every query's score of every row, float32 [Q, N], NaN for rows never ranked (`score_all`);
        `settings` are the `QuerySpec`'s fields, as for `topk`."""
        spec = spec_from_arguments(QuerySpec, "Index.score_all", (), settings, ("query_rows", "device"))
        return score_all(self.reader, query_rows, spec, device=device)


def open_index(path: str | Path) -> Index:
    """Open the Gradian index at `path` for reading and ranking (layout: `gradian_lightning.index.layout`)."""
    return Index(path)
