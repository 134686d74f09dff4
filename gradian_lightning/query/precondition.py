"""Preconditioners from an index's row statistics (index/statistics.py), applied to query and
training rows alike before they are scored.

    none    rows as stored
    diag    each coordinate j divided by sqrt(m_j + λ), m_j its mean square over the training rows
    fisher  each module block R_m multiplied by (F_m + λI)^-½, F_m = mean of R_mᵀR_m (k²×k²)
    ekfac   the same with F_m kept only on the diagonal of the Kronecker basis of its two partial
            traces (eigenvalue-corrected Kronecker factors, in the projected space): k² numbers a
            module instead of k⁴, so few rows estimate it (statistics.kronecker_whitening_factor)
    auto    fisher where the index keeps F (equal blocks of k² <= 1024) from at least k² counted
            rows, ekfac where it keeps F from fewer, diag where it keeps no F (the N sweep of
            benchmarks/studies/lds_sets and issue 10's grid); `resolve` names the one it picks

λ = `damping` × the mean eigenvalue of that module's second moment (for diag: the mean of its
m_j). Whitening both sides makes the inner product qᵀ(F + λI)⁻¹r, and per-module cosine then
compares directions in the whitened metric. A damping of 0, or a module with fewer counted rows
than k² (F singular), is warned about; damping 0 falls back to DAMPING_FLOOR so that no
direction the training rows never visited divides by zero. A module whose rows are all zero is
left as it is. The result is always finite for finite input.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional

import torch

from gradian_lightning.errors import ConfigError
from gradian_lightning.index.layout import module_blocks
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.index.statistics import (
    COUNTED_ROWS,
    GRAM_MAX_SIZE,
    finished_statistics,
    gram_block_size,
    whiten,
    whitening_factors,
)
from gradian_lightning.specs import QuerySpec

# λ relative to the mean eigenvalue when the setting is 0: small enough to keep the whitening,
# large enough that float32 rows times (w + λ)^-½ cannot overflow.
DAMPING_FLOOR = 1e-3


class Preconditioner:
    """Rows [n, D] float32 -> preconditioned rows [n, D] float32 (a new tensor)."""

    def __init__(self, scale: Optional[torch.Tensor] = None, factors: Optional[torch.Tensor] = None) -> None:
        self.scale, self.factors = scale, factors  # [D] / [M, s, s] float32

    def to(self, device: torch.device) -> "Preconditioner":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Preconditioner(move(self.scale), move(self.factors))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            return rows * self.scale
        return whiten(rows, self.factors)  # (F + λI)^-½ is symmetric: right-multiplying each block row applies it


def _damping(damping: float) -> float:
    # QuerySpec refused a negative damping; 0 is allowed, and means the floor.
    if damping == 0:
        warnings.warn(
            f"query.damping=0 would divide by directions the training rows never visited; using {DAMPING_FLOOR} × the mean eigenvalue",
            stacklevel=3,
        )
        return DAMPING_FLOOR
    return damping


# Counted rows per dimension of a module's k²×k² second moment before `auto` trusts fisher with it.
# The N sweep of benchmarks/studies/lds_sets at the default k = 32 (k² = 1,024; docs/configuration.md,
# "Choosing the scoring"): from 1,024 rows up, fisher with a whole-row cosine led ekfac on every set
# (facts-2048: +0.096 against +0.055); below, fisher fell under 0 where ekfac held (shared, 0.5 rows
# per dimension: -0.031 against +0.098; SmolLM2, 0.08: +0.277 against +0.400). The same held at k = 16.
# ekfac needs k² numbers a module where fisher needs k⁴.
FISHER_ROWS_PER_DIMENSION = 1
AUTO_FEW_ROWS = "ekfac"


def counted_rows(index: IndexReader) -> Optional[int]:
    """How many rows the index's statistics counted (None where no close finished writing them)."""
    stats = finished_statistics(index.group)
    return None if stats is None else int(stats.attrs[COUNTED_ROWS])


def resolve(index: IndexReader, precondition: str) -> str:
    """The preconditioner `precondition` means for `index`: itself, or for "auto" fisher where the
    index keeps the k²×k² second moments (grads.projection_dim <= 32) from at least
    FISHER_ROWS_PER_DIMENSION × k² counted rows, AUTO_FEW_ROWS where it has fewer rows, and diag
    where it keeps no second moments (k > 32: diag measured best there, issue 10)."""
    if precondition != "auto":
        return precondition
    size = gram_block_size(module_blocks(index.meta), int(index.meta["width"]))
    if size is None:
        return "diag"
    rows = counted_rows(index)
    return "fisher" if rows is not None and rows >= FISHER_ROWS_PER_DIMENSION * size else AUTO_FEW_ROWS


def resolved_spec(index: IndexReader, spec: QuerySpec) -> QuerySpec:
    """`spec` with each "auto" replaced by what it means for `index`: the preconditioner
    (`resolve`), and for query.normalize=auto a whole-row cosine under fisher, per-module otherwise.

    Whitened by the full F, modules are on one scale and a whole-row cosine lets the modules that
    moved most weigh most (k = 16: it led per-module cosine under fisher on 5 of 7 LDS sets, format
    +0.101 against +0.080; k = 32: level, facts-4096 +0.135 against +0.126). Under ekfac, diag or
    none, module scales differ and per-module cosine keeps one from outvoting the rest (SmolLM2 at
    k = 32: +0.400 against +0.363)."""
    precondition = resolve(index, spec.precondition)
    normalize = spec.normalize
    if normalize == "auto":
        normalize = "row" if precondition == "fisher" else "module"
    return replace(spec, precondition=precondition, normalize=normalize)


def preconditioner(index: IndexReader, precondition: str, damping: float) -> Optional[Preconditioner]:
    """The preconditioner of `index` (at its checkpoint) for `precondition` ("none": None), on the CPU."""
    precondition = resolve(index, precondition)
    if precondition == "none":
        return None
    damping = _damping(damping)
    group = finished_statistics(index.group)
    cached = group is not None and "eigvecs" in group.array_keys()  # the writer's eigendecomposition of F
    stats = index.statistics()
    blocks = module_blocks(index.meta)
    if stats.count == 0:
        warnings.warn(
            f"the index at {str(index.path)!r} has no counted rows to precondition with; query.precondition={precondition} is skipped",
            stacklevel=2,
        )
        return None
    if precondition == "diag":
        mean_sq = torch.from_numpy(stats.sumsq / stats.count)
        scale = torch.ones_like(mean_sq)
        for b in blocks:
            part = mean_sq[int(b["offset"]) : int(b["offset"]) + int(b["size"])]
            level = float(part.mean())
            if level > 0:
                scale[int(b["offset"]) : int(b["offset"]) + int(b["size"])] = (part + damping * level).rsqrt()
        return Preconditioner(scale=scale.float())
    if not cached and stats.gram is None:
        raise ConfigError(
            f"setting 'query.precondition'={precondition} needs module blocks of equal size at most {GRAM_MAX_SIZE} (grads.projection_dim <= 32) but the index at {str(index.path)!r} has none; use query.precondition=diag"
        )
    w, v = (group["eigvals"][:], group["eigvecs"]) if cached else stats.eigen()
    if stats.count < w.shape[1] and precondition == "fisher":
        warnings.warn(
            f"the index at {str(index.path)!r} has {stats.count} counted rows, fewer than k² = {w.shape[1]}: its second moment is rank-deficient and the damping sets the unseen directions",
            stacklevel=2,
        )
    factors = whitening_factors(w, v, damping, kronecker=precondition == "ekfac")
    return Preconditioner(factors=torch.from_numpy(factors))


def scoring_words(spec: QuerySpec) -> str:
    """How a spec resolved for its index (`resolved_spec`) scores, in the words the query's summary
    line and the report's header use: e.g. "whole-row cosine, preconditioner fisher (damping 1.0)"."""
    kind = {
        "cosine": "per-module cosine (mean over modules)" if spec.normalize == "module" else "whole-row cosine",
        "inner": "inner product",
    }[spec.score]
    damping = "" if spec.precondition == "none" else f" (damping {spec.damping})"
    return f"{kind}, preconditioner {spec.precondition}{damping}"
