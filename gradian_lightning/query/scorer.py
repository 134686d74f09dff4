"""`Scorer`: how the rows of one checkpoint of an index score against a batch of queries.

    Scorer(index, QuerySpec)      resolves "auto" once (the preconditioner, the normalisation),
                                  builds the preconditioner from the index's statistics
      .prepare(query rows [Q, D]) the queries scaled once as every chunk is compared with them
      .score(rows [c, D], lo, hi) scores [Q, c] of a chunk of decoded rows lo..hi-1
      .token_terms(parts [S, D])  each part's term of one row's score, parts summing to the row (token_scores.py)
      .describe()                 how it scores, in the words the output, summary and report use

The streaming top-k (topk.py), the Dask engine, `score_all`, token scores, validate and the report
all score through one. Several checkpoints are several scorers, each with its weight
(`checkpoint_scorers`), summed.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch

from gradian_lightning.errors import IndexMismatchError
from gradian_lightning.gradients.projection import ModuleBlock
from gradian_lightning.index.checkpoints import checkpoint_weights
from gradian_lightning.index.layout import equal_block_size, module_norms
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.precondition import Fisher, Preconditioner, auto_preconditioner, build_preconditioner
from gradian_lightning.specs import QuerySpec


def _unit(rows: torch.Tensor) -> torch.Tensor:
    # A zero row (nothing supervised, or an exactly zero gradient) scores 0 rather than NaN.
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(torch.finfo(rows.dtype).tiny)


def unit_modules(
    rows: torch.Tensor, blocks: Sequence[ModuleBlock], norms: Optional[torch.Tensor] = None
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
        rows[:, b.offset : b.offset + b.size].mul_(inverse[:, m : m + 1])
    return rows


def resolved_spec(index: IndexReader, spec: QuerySpec) -> QuerySpec:
    """`spec` with each "auto" replaced by what it means for `index`: the preconditioner
    (`auto_preconditioner`), query.score=auto as cosine, and for query.normalize=auto a whole-row
    cosine under fisher, per-module otherwise.

    Whitened by the full F, modules are on one scale and a whole-row cosine lets the modules that
    moved most weigh most; under ekfac, diag or none, module scales differ and per-module cosine
    keeps one from outvoting the rest (docs/configuration.md, "Choosing the scoring")."""
    precondition = auto_preconditioner(index) if spec.precondition == "auto" else spec.precondition
    normalize = spec.normalize
    if normalize == "auto":
        normalize = "row" if precondition == "fisher" else "module"
    score = "cosine" if spec.score == "auto" else spec.score
    return replace(spec, precondition=precondition, normalize=normalize, score=score)


class Scorer:
    """Scores of the rows of `index` (one checkpoint) for `spec`, with "auto" resolved once.

    `weight`: this checkpoint's weight when several are summed (index/checkpoints.py).
    `shortcut`: under fisher, score chunks without whitening them where the index allows it: for
    inner products always, and for cosine when the index stores its rows' whitened norms at this
    damping (statistics.py). The queries are then whitened twice, (W·Wq)·r / |Wr| = (Wq)·(Wr) / |Wr|,
    so a chunk is only scaled. Token terms need the whitened rows themselves: `shortcut=False`.
    """

    def __init__(
        self,
        index: IndexReader,
        spec: QuerySpec,
        device: Optional[torch.device | str] = None,
        weight: float = 1.0,
        shortcut: bool = True,
    ) -> None:
        self.index, self.spec, self.weight = index, resolved_spec(index, spec), weight
        self.blocks = index.meta.blocks
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        built = build_preconditioner(index, self.spec.precondition, self.spec.damping)
        self.preconditioner: Optional[Preconditioner] = None if built is None else built.to(self.device)
        stored = index.whitened_damping
        self.shortcut = (
            shortcut
            and type(self.preconditioner) is Fisher  # not EKFAC: the stored whitened norms are fisher's
            and (self.spec.score == "inner" or (stored is not None and float(stored) == float(self.spec.damping)))
        )
        self.queries: Optional[torch.Tensor] = None  # [Q, D] float32 on `device`, from `prepare`

    def __getstate__(self) -> Dict:
        # Sent to Dask workers without the reader: they score decoded chunks with computed norms.
        return {**self.__dict__, "index": None}

    @property
    def transform(self) -> Optional[Preconditioner]:
        """What a chunk's rows go through before they are compared: the preconditioner, or None."""
        return None if self.shortcut else self.preconditioner

    def prepare(self, query_rows: torch.Tensor) -> "Scorer":
        """Take query rows [Q, D] (from `query_gradients`), scaled once as `score` compares a chunk
        with them: preconditioned, then normalised (`queries`, float32 on `device`). Returns this
        scorer. Raises `IndexMismatchError` for rows of another width."""
        width = self.index.meta.width
        if query_rows.dim() != 2 or query_rows.shape[1] != width:
            raise IndexMismatchError(
                f"query rows have shape {tuple(query_rows.shape)} but the index at {str(self.index.path)!r} holds rows of width {width}; compute them with query_gradients on this index"
            )
        queries = query_rows.detach().to(device=self.device, dtype=torch.float32)
        if self.preconditioner is not None:
            queries = self.preconditioner.queries(queries)
        if self.spec.score == "cosine" and self.spec.normalize == "module":
            queries = unit_modules(queries.clone(), self.blocks) / len(self.blocks)  # / M: scores are a mean of cosines
        elif self.spec.score == "cosine":
            queries = _unit(queries)
        if self.shortcut:
            queries = self.preconditioner.queries(queries)
        self.queries = queries
        return self

    def for_known_norms(self) -> "Scorer":
        """This scorer for rows whose norms as compared the caller passes to `score` (`norms`; the
        ANN index keeps them): the preconditioner moved onto the queries as under `shortcut` (every
        preconditioner here is symmetric, so q̂ · P r = P q̂ · r), so the rows are never
        preconditioned. Without the index (as a Dask worker's scorer): rows scored without `norms`
        are preconditioned for their norms, never given another preconditioner's stored ones.
        Itself when there is nothing to move."""
        if self.preconditioner is None or self.shortcut:
            return self
        twin = copy.copy(self)
        twin.index, twin.shortcut, twin.queries = None, True, self.preconditioner.queries(self.queries)
        return twin

    def _norms(self, lo: Optional[int], hi: Optional[int]) -> Optional[torch.Tensor]:
        # [c, M]: the norms of the chunk's rows as they are compared, when the index stores them.
        if self.spec.score != "cosine" or self.transform is not None or lo is None or self.index is None:
            return None
        return self.index.whitened_norms(lo, hi) if self.shortcut else self.index.stored_norms(lo, hi)

    def score(
        self,
        rows: torch.Tensor,
        lo: Optional[int] = None,
        hi: Optional[int] = None,
        norms: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Scores [Q, c] float32 of a chunk of decoded rows [c, D] (rows lo..hi-1 of the index)
        against the prepared queries, unweighted.

        `rows` must be a tensor the caller does not need afterwards (a decoded chunk): per-module
        cosine normalises it in place. With lo and hi, cosine takes the chunk's norms from the
        index (stored, or whitened under the shortcut) instead of computing them; `norms` [c, M]
        gives them directly: each module's norm after the preconditioner (`for_known_norms`).
        """
        norms = self._norms(lo, hi) if norms is None else norms
        if self.shortcut and norms is None and self.spec.score == "cosine":
            # No stored whitened norms at hand (a Dask worker has no reader): whiten a copy for them.
            norms = module_norms(self.preconditioner(rows), self.blocks)
        if self.transform is not None:
            rows = self.transform(rows)
        by_module = self.spec.score == "cosine" and self.spec.normalize == "module"
        if by_module:
            rows = unit_modules(rows, self.blocks, norms)
        scores = self.queries @ rows.T  # [Q, c] float32
        if self.spec.score == "cosine" and not by_module:
            # dividing the scores by the row norms saves normalising a copy of the chunk
            row_norms = torch.linalg.vector_norm(rows if norms is None else norms.to(rows.device), dim=1)
            scores /= row_norms.clamp_min(torch.finfo(rows.dtype).tiny)
        return scores

    def token_terms(self, token_rows: torch.Tensor) -> torch.Tensor:
        """float64 [Q, S]: each token's term of one row's score, from the row's per-token rows
        [S, D] (they sum to the row): each token's row goes through the preconditioner and is
        divided by the norms of the whole row, so that the terms add up to the row's score.
        Needs a scorer made with `shortcut=False`."""
        assert not self.shortcut, "token terms need the whitened rows: Scorer(..., shortcut=False)"
        rows = token_rows.to(self.device, torch.float32)
        if self.preconditioner is not None:
            rows = self.preconditioner(rows)
        whole = rows.sum(0, keepdim=True)
        if self.spec.score == "cosine" and self.spec.normalize == "module":
            rows = unit_modules(rows.clone(), self.blocks, module_norms(whole, self.blocks).expand(len(rows), -1))
        elif self.spec.score == "cosine":
            rows = rows / whole.norm().clamp_min(torch.finfo(torch.float32).tiny)
        return self.queries.double() @ rows.double().T

    def describe(self) -> str:
        """How this scorer scores, in the words the query's output, summary line and the report use:
        e.g. "whole-row cosine, preconditioner fisher (damping 1.0)"."""
        spec = self.spec
        kind = {
            "cosine": "per-module cosine (mean over modules)" if spec.normalize == "module" else "whole-row cosine",
            "inner": "inner product",
        }[spec.score]
        damping = "" if spec.precondition == "none" else f" (damping {spec.damping})"
        return f"{kind}, preconditioner {spec.precondition}{damping}"


def checkpoint_scorers(
    index: IndexReader,
    query_rows: torch.Tensor | Dict[int, torch.Tensor],
    spec: QuerySpec,
    device: Optional[torch.device | str] = None,
    shortcut: bool = True,
) -> List[Scorer]:
    """One prepared `Scorer` per checkpoint whose scores are summed, each with its weight.

    `query_rows` [Q, D] float32 made at the index's checkpoint (its newest): one scorer of weight
    1; or {checkpoint step: [Q, D]} made at each checkpoint's weights, of which `spec.checkpoints`
    chooses (index/checkpoints.py). "auto" is resolved once, for `index`: every checkpoint counts
    the same rows. `device` defaults to the query rows'.
    """
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
    spec = resolved_spec(index, spec)
    return [Scorer(reader, spec, device, weight, shortcut).prepare(rows) for reader, rows, weight in chosen]
