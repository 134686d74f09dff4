"""The exact scoring pass: every training row scored against full-space query gradients, in one pass
over the training data, without storing any row.

Per selected module (weight [out, in], gradients in that orientation; gradients/factors.py):

    query:     g_q = Σ_t δ_t x_tᵀ [out, in], each query's exact gradient (`query_gradients_full`)
    direction: M_q = g_q (inner product, cosine), or (H + λ I)⁻¹ g_q in full space with K-FAC or
               EK-FAC factors (`Factors.precondition`, λ = damping × the module's mean eigenvalue),
               or f(H) g_q with approximate unrolling's f over a horizon h (`Factors.precondition`)
    score:     s[q, n] = Σ_modules ⟨M_q, G_n⟩ = Σ_modules Σ_t δ_tᵀ M_q x_t over row n's tokens

Parts (`parts`): the modules may be split into parts, each scored as its own cosine (norms over
that part's modules only, an unrolling's Ē that part's own) and the parts' cosines averaged, so
that each part weighs the same whatever its gradients' size and a row's score with itself is 1.
query.precondition=auto makes the output head a second part beside the index's modules
(exact_scoring.py): in one whole-row cosine its larger gradients drowned the MLP's
(benchmarks/studies/lds_sets/README.md, "the output head's gradient against BM25"). One part (the
default) is the whole-row cosine.

Units: the inner product is in nats² per squared weight unit, as the index's exact rows; an
influence score g_qᵀ (H + λ I)⁻¹ g_n has H in those units too (a second moment of gradients, per
example), so it is a pure number; `cosine` is the score over ‖g_q‖ ‖G_n‖, both norms over all
modules of a part together (with one part, the whole-row cosine) and, with factors, in the preconditioner's metric
‖g‖²_f = ⟨g, f(H) g⟩ (the cosine of f(H)^½ g_q and f(H)^½ G_n), also a pure number.
‖G_n‖² = Σ_modules Σ_t Σ_s (δ_t·δ_s)(x_t·x_s) is computed in the same factored form.

Two contraction orders give the same scores (`order`):
  - "examples" (the default): G_n made a few rows at a time ([c, out, in], one module's, within
    `CHUNK_ELEMENTS`) and scored as one matmul; 2·B·T·in·out + 2·Q·B·in·out multiply-adds a batch
    and module. G_n is transient, never stored or kept past its module's backward.
  - "tokens": Σ_t δ_tᵀ M_q x_t through a [Q, c, T, min(in, out)] temporary; no per-example weight
    gradient is made at all, for 2·Q·B·T·in·out: more whenever Q·T > Q + T (two queries and up),
    about Q times more at T ≫ Q. Measured (benchmarks/RESULTS.md §13): 1.9× the CPU time of
    "examples" on the tiny model at Q = 8; hence the default.
Both keep temporaries within gradients/factors.py's `CHUNK_ELEMENTS` whatever Q and B.

Memory per query: its direction M_q, one [out, in] matrix per module in `dtype`, the size of the
selected modules' weights (SmolLM2-135M's MLP: 79.6 M numbers, 318 MB in float32).
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence

import torch
from torch import nn

from gradian_lightning.errors import GradianError
from gradian_lightning.gradients.factors import Factors, TokenPass, example_chunks, in_output_basis
from gradian_lightning.specs import IndexSpec

ORDERS = ("examples", "tokens")


def query_gradients_full(tokens: TokenPass, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Each example's exact weight gradient of each module: name -> [B, out, in] in `tokens.dtype`."""
    grads: Dict[str, torch.Tensor] = {}

    def step(name: str, x: torch.Tensor, g: torch.Tensor) -> None:
        grads[name] = torch.bmm(g.transpose(1, 2), x)

    tokens.run(batch, step)
    return grads


def _scores_by_tokens(m: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """[Q, B] = Σ_t g[b, t]ᵀ m[q] x[b, t] for m [Q, out, in], x [B, T, in], g [B, T, out]."""
    q, (b, t, width) = m.shape[0], x.shape
    narrow = min(width, g.shape[-1])  # contract the wider side first: the temporary is [Q, c, T, narrow]
    out = x.new_empty(q, b)
    for lo, hi in example_chunks(b, q * t * narrow):
        if narrow == g.shape[-1]:  # m x_t, then dot with δ_t
            y = torch.einsum("qoi,bti->qbto", m, x[lo:hi])
            out[:, lo:hi] = torch.einsum("qbto,bto->qb", y, g[lo:hi])
        else:  # δ_tᵀ m, then dot with x_t
            y = torch.einsum("qoi,bto->qbti", m, g[lo:hi])
            out[:, lo:hi] = torch.einsum("qbti,bti->qb", y, x[lo:hi])
    return out


def _scores_by_examples(m: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The same [Q, B] through each row's gradient G_b [out, in], a chunk of rows at a time."""
    flat = m.flatten(1)  # [Q, out·in]
    parts = [
        flat @ torch.bmm(g[lo:hi].transpose(1, 2), x[lo:hi]).flatten(1).T
        for lo, hi in example_chunks(x.shape[0], m.shape[1] * m.shape[2])
    ]
    return torch.cat(parts, dim=1)


def _squared_norms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """‖G_b‖² [B] = Σ_t Σ_s (δ_t·δ_s)(x_t·x_s), from two [B, T, T] Gram matrices: no [out, in]."""
    out = x.new_empty(x.shape[0])
    for lo, hi in example_chunks(x.shape[0], 2 * x.shape[1] ** 2):
        xs, gs = x[lo:hi], g[lo:hi]
        out[lo:hi] = (torch.bmm(gs, gs.transpose(1, 2)) * torch.bmm(xs, xs.transpose(1, 2))).sum(dim=(1, 2))
    return out


class ExactPass:
    """Scores training rows exactly against one batch of queries (module docstring).

    Args:
        model, spec, modules: as `GradientRows` (the index's modules, by name).
        queries: the query batch (`input_ids`, `attention_mask`, `labels` [Q, T]).
        factors: K-FAC or EK-FAC `Factors` to precondition the queries with; None for the plain
            inner product.
        damping: λ as a fraction of each module's mean eigenvalue (0.1: the issue's best, flat
            from 0.001 to 0.1); ignored without factors or with a horizon.
        horizon: None for the influence function (H + λ I)⁻¹; h >= 0 for approximate unrolling
            over a training time h in units of 1 / Ē (`Factors.precondition`); needs factors.
        cosine: whole-row cosine: ⟨M_q, G_n⟩ / (‖g_q‖ ‖G_n‖), the norms in the preconditioner's
            metric ‖g‖²_f = ⟨g, f(H) g⟩ where factors are given (a whitened cosine), plain otherwise.
        order: "examples" or "tokens", the contraction (module docstring); the same scores.
        dtype: the arithmetic's (float32; float64 in tests).
        parts: the modules' names split into parts, each its own cosine, averaged (module
            docstring); None for one part of every module.

    `score(batch)` gives [Q, B] for one training batch; `score_all(batches, rows)` [Q, rows],
    each batch's columns at its `index` (dataset positions) or in order. The model, its `.grad`,
    modes and RNG are left as they were.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: IndexSpec,
        queries: Dict[str, torch.Tensor],
        factors: Optional[Factors] = None,
        damping: float = 0.1,
        cosine: bool = False,
        order: str = "examples",
        modules: Optional[Dict[str, nn.Module]] = None,
        dtype: torch.dtype = torch.float32,
        horizon: Optional[float] = None,
        parts: Optional[Sequence[Sequence[str]]] = None,
    ) -> None:
        if order not in ORDERS:
            raise GradianError(
                f"ExactPass(order={order!r}) is not a contraction order; use order='examples' or order='tokens'"
            )
        if horizon is not None and (factors is None or horizon < 0):
            raise GradianError(
                f"ExactPass(horizon={horizon!r}) unrolls over a training time >= 0 along the factors' eigenbases; pass factors with a horizon >= 0, or horizon=None"
            )
        self.tokens = TokenPass(model, spec, modules, dtype)
        self.cosine, self.order = cosine, order
        names = list(self.tokens.modules)
        parts = [list(names)] if parts is None else [list(p) for p in parts]
        if sorted(n for p in parts for n in p) != sorted(names):
            raise GradianError(
                f"ExactPass(parts=...) must split the modules {names} into parts, each module in one part; got {parts}"
            )
        self.part_of = {n: i for i, p in enumerate(parts) for n in p}
        grads = query_gradients_full(self.tokens, queries)
        # Each part's factors on their own: an unrolling's Ē is the part's (`Factors.part`).
        self.factors = None if factors is None else {n: factors.part(p) for p in parts for n in p}
        # f(E) [out, in] per module, for each row's norm in the metric: made once here, not per batch.
        self.metric = {}
        if cosine and factors is not None:
            self.metric = {name: self.factors[name].weights(name, damping, horizon) for name in grads}
        squared = torch.zeros(len(parts), grads[names[0]].shape[0], dtype=dtype)
        if factors is not None:
            # A module at a time, each raw gradient dropped once preconditioned: the directions
            # never sit beside a second full copy of themselves.
            for name in list(grads):
                g = grads.pop(name)
                m = self.factors[name].precondition(name, g, damping, horizon)
                squared[self.part_of[name]] += (g.to(m) * m).flatten(1).sum(1).to(squared)  # ‖g_q‖²_f = ⟨g_q, f(H) g_q⟩
                grads[name] = m
                del g
        else:
            for name, g in grads.items():
                squared[self.part_of[name]] += g.flatten(1).square().sum(1).to(squared)
        self.query_norms = squared.clamp_min(0).sqrt()  # [parts, Q]
        self.directions = grads  # name -> M_q [Q, out, in]

    def nbytes_per_query(self) -> int:
        """Bytes of one query's directions, all modules."""
        return sum(m[0].numel() * m.element_size() for m in self.directions.values())

    def score(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Scores [Q, B] of one training batch: with `cosine` the mean over parts of each part's
        cosine, else the sum of every module's inner product."""
        count, (q, b) = len(self.query_norms), (self.query_norms.shape[1], batch["input_ids"].shape[0])
        scores = torch.zeros(count, q, b, dtype=self.tokens.dtype)
        norms = torch.zeros(count, b, dtype=self.tokens.dtype)
        contract = _scores_by_tokens if self.order == "tokens" else _scores_by_examples

        def step(name: str, x: torch.Tensor, g: torch.Tensor) -> None:
            part = self.part_of[name]
            scores[part] += contract(self.directions[name].to(x), x, g).to(scores)
            if self.cosine and self.factors is not None:
                norms[part] += self._metric_squared_norms(name, x, g).to(norms)
            elif self.cosine:
                norms[part] += _squared_norms(x, g).to(norms)

        self.tokens.run(batch, step)
        if self.cosine:
            scores = scores / (self.query_norms[:, :, None].to(scores) * norms.sqrt()[:, None, :]).clamp_min(1e-30)
            return scores.mean(0)
        return scores.sum(0)

    def _metric_squared_norms(self, name: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """‖G_b‖²_f [B] = Σ_oi f(E) ⊙ (Q_Gᵀ G_b Q_A)², each row's gradient made in the eigenbases
        a few rows at a time ([c, out, in] within `CHUNK_ELEMENTS`)."""
        q_a, _, q_g, _ = self.factors[name].bases[name]
        weights = self.metric[name].to(x)
        x, g = x @ q_a.to(x), in_output_basis(g, q_g)
        out = x.new_empty(x.shape[0])
        for lo, hi in example_chunks(x.shape[0], g.shape[-1] * x.shape[-1]):
            rotated = torch.bmm(g[lo:hi].transpose(1, 2), x[lo:hi])
            out[lo:hi] = (rotated.square_() * weights).sum(dim=(1, 2))
        return out

    def score_all(self, batches: Iterable[Dict[str, torch.Tensor]], rows: int) -> torch.Tensor:
        """Scores [Q, rows] of every training row: one pass over `batches`."""
        out = torch.zeros(self.query_norms.shape[1], rows, dtype=self.tokens.dtype)
        at = 0
        for batch in batches:
            scores = self.score(batch).cpu()
            where = batch.get("index", torch.arange(at, at + scores.shape[1]))
            out[:, where] = scores.to(out)
            at += scores.shape[1]
        return out
