"""Streaming top-k: rank an index's rows for query rows, one chunk at a time.

    index chunks -> `_read_ahead` (the next chunk read on a worker thread)
                 -> `streaming_topk`: per chunk [c, D], scores [Q, c] from each checkpoint's
                    `Scorer` (scorer.py), weighted and summed, merged into a running top-k
                    (and bottom-k) per query

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

from gradian_lightning.errors import ConfigError
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.scorer import Scorer, checkpoint_scorers
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


def _scored_chunks(
    scorers: Sequence[Scorer], device: torch.device
) -> Iterator[Tuple[int, int, np.ndarray, torch.Tensor]]:
    """(lo, hi, rankable mask [c], scores [Q, c] float32 on `device`) for every chunk of the first
    scorer's index with a rankable row: each chunk read once (ahead, on a worker thread), decoded
    into one reused buffer and scored by each scorer (one checkpoint each), the scores weighted
    and summed. The one scoring loop of `streaming_topk` and `score_all`."""
    readers = [s.index for s in scorers]
    buffer: Optional[torch.Tensor] = None  # one float32 chunk, decoded into for every chunk: no fresh pages per chunk
    for lo, hi, keep, stored in _read_ahead(readers[0], readers):
        if buffer is None or len(buffer) < hi - lo:
            buffer = torch.empty(hi - lo, stored[0].shape[1])
        scores = None
        for scorer, chunk in zip(scorers, stored):
            rows = scorer.index.decode(chunk, lo, hi, out=buffer[: hi - lo]).to(device)
            part = scorer.score(rows, lo, hi)
            scores = part.mul_(scorer.weight) if scores is None else scores.add_(part, alpha=scorer.weight)
        yield lo, hi, keep, scores


def _merge(best: Ranking, scores: torch.Tensor, positions: torch.Tensor, k: int, largest: bool) -> Ranking:
    values = torch.cat([best.scores, scores], dim=1)
    indices = torch.cat([best.indices, positions.expand(scores.shape[0], -1)], dim=1)
    top = values.topk(min(k, values.shape[1]), dim=1, largest=largest, sorted=True)
    return Ranking(indices.gather(1, top.indices), top.values)


def streaming_topk(scorers: Sequence[Scorer]) -> tuple[Ranking, Optional[Ranking]]:
    """The `spec.top_k` best rows per query of the scorers' index, their scores summed (one scorer
    per checkpoint, `checkpoint_scorers`), and when `spec.bottom_k` > 0 the bottom-k, most
    negative first. Returns (top, bottom or None), on the scorers' device.

    How rows score is the scorers' (scorer.py): cosine per module (default; the mean over modules
    of the per-module cosines, so a module with large gradients cannot outvote the rest) or per
    row, or inner products, after the preconditioner. Each chunk is one float32 matmul per scorer.
    """
    first = scorers[0]
    k, bottom_k, device = first.spec.rows_wanted(len(first.index)), first.spec.bottom_k, first.device
    queries = len(first.queries)
    empty = Ranking(torch.empty(queries, 0, dtype=torch.long, device=device), torch.empty(queries, 0, device=device))
    top, bottom = empty, empty
    held: list = []  # (scores [Q, c], positions [c]) of chunks not yet merged into top/bottom

    def merge() -> None:
        nonlocal top, bottom
        scores, kept = torch.cat([s for s, _ in held], dim=1), torch.cat([p for _, p in held])
        held.clear()
        top = _merge(top, scores, kept, k, largest=True)
        if bottom_k:
            bottom = _merge(bottom, scores, kept, bottom_k, largest=False)

    for lo, hi, keep, scores in _scored_chunks(scorers, device):
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


def score_all(scorers: Sequence[Scorer]) -> torch.Tensor:
    """Every query's score of every row of the scorers' index, summed over the scorers: float32
    [Q, N] on the CPU, NaN where a row is never ranked (not written, not finite, nothing supervised).

    The same scores `streaming_topk` ranks, by the same loop: what `gradian validate` and
    `gradian report` need of every row. Streamed chunk by chunk, so memory is the [Q, N] result
    plus one chunk.
    """
    first = scorers[0]
    out = torch.full((len(first.queries), len(first.index)), float("nan"))
    for lo, hi, keep, scores in _scored_chunks(scorers, first.device):
        block = scores.cpu()
        block[:, ~torch.from_numpy(keep)] = float("nan")
        out[:, lo:hi] = block
    return out


def dense_topk(scores: torch.Tensor, spec: QuerySpec) -> tuple[Ranking, Optional[Ranking]]:
    """`streaming_topk`'s (top, bottom or None) from every row's scores [Q, N] at hand (the exact
    pass's), NaN for rows never ranked: the `spec.top_k` best finite rows per query, best first,
    and when `spec.bottom_k` > 0 the most negative, most negative first."""
    ranked = torch.nonzero(~torch.isnan(scores).all(dim=0)).flatten()  # the same rows for every query
    kept = scores[:, ranked]

    def best(k: int, largest: bool) -> Ranking:
        top = kept.topk(min(k, kept.shape[1]), dim=1, largest=largest, sorted=True)
        return Ranking(ranked[top.indices], top.values)

    top = best(spec.rows_wanted(scores.shape[1]), True)
    return top, (best(spec.bottom_k, False) if spec.bottom_k else None)


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


def refuse_exact(spec: QuerySpec, caller: str) -> None:
    """`ConfigError` for method=exact where only stored rows are at hand: the exact pass needs the
    model and the training data, which `run_query` and `dense_scores` have."""
    if spec.method == "exact":
        raise ConfigError(
            f"{caller}(method='exact') scores the stored rows only; for the exact pass call gradian_lightning.run_query(cfg) or dense_scores(cfg, [QuerySpec(method='exact', ...)]) with a config naming the model and data.train, or leave method=index"
        )


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
        refuse_exact(spec, "Index.topk")
        if spec.search != "exact":  # ann.py builds on this module, so it is called there, not from here
            raise ConfigError(
                f"Index.topk(search={spec.search!r}) is the exact scan; for the two-stage search call gradian_lightning.query.ann.ann_topk(checkpoint_scorers(index.reader, query_rows, QuerySpec(search='ann', ...), shortcut=False)), or leave search=exact"
            )
        top, bottom = streaming_topk(checkpoint_scorers(self.reader, query_rows, spec, device))
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
        refuse_exact(spec, "Index.score_all")
        return score_all(checkpoint_scorers(self.reader, query_rows, spec, device))


def open_index(path: str | Path) -> Index:
    """Open the Gradian index at `path` for reading and ranking (layout: `gradian_lightning.index.layout`)."""
    return Index(path)
