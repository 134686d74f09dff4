"""Preconditioners from an index's row statistics (index/statistics.py), applied to query and
training rows alike before they are scored. One class per kind; the `Scorer` (scorer.py) holds one.

    none    no preconditioner: rows as stored
    diag    `Diagonal`: each coordinate j divided by sqrt(m_j + λ), m_j its mean square over the training rows
    fisher  `Fisher`: each module block R_m multiplied by (F_m + λI)^-½, F_m = mean of R_mᵀR_m (k²×k²)
    ekfac   `EKFAC`: the same with F_m kept only on the diagonal of the Kronecker basis of its two
            partial traces (eigenvalue-corrected Kronecker factors, in the projected space): k²
            numbers a module instead of k⁴, so few rows estimate it (statistics.kronecker_whitening_basis)
    auto    `auto_preconditioner`: fisher where the index keeps F (equal blocks of k² <= 1024) from
            at least k² counted rows, ekfac where it keeps F from fewer, diag where it keeps no F

λ = `damping` × the mean eigenvalue of that module's second moment (for diag: the mean of its
m_j). Whitening both sides makes the inner product qᵀ(F + λI)⁻¹r, and per-module cosine then
compares directions in the whitened metric. A damping of 0, or a module with fewer counted rows
than k² (F singular), is warned about; damping 0 falls back to DAMPING_FLOOR so that no
direction the training rows never visited divides by zero. A module whose rows are all zero is
left as it is. The result is always finite for finite input.
"""

from __future__ import annotations

import hashlib
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple, Type

import numpy as np
import torch

from gradian_lightning.errors import ConfigError
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.index.statistics import (
    COUNTED_ROWS,
    GRAM_MAX_SIZE,
    RowStatistics,
    basis_factor,
    finished_statistics,
    gram_block_size,
    kronecker_whitening_basis,
    whiten,
    whitening_basis,
)

# λ relative to the mean eigenvalue when the setting is 0: small enough to keep the whitening,
# large enough that float32 rows times (w + λ)^-½ cannot overflow.
DAMPING_FLOOR = 1e-3
# Counted rows per dimension of a module's k²×k² second moment before `auto` trusts fisher with it.
# Below it F is mostly damping and ekfac, with k² numbers a module where fisher needs k⁴, held up
# on every LDS set (the N sweep in docs/configuration.md, "Choosing the scoring").
FISHER_ROWS_PER_DIMENSION = 1
AUTO_FEW_ROWS = "ekfac"
# Fisher and EKFAC preconditioners made in this process from an index's stored eigendecomposition,
# newest last (`Fisher.from_index`), with the factors they made: those were 0.3-0.5 s of every query
# batch at six 1,024-wide modules, as long as the rest of an ANN search. Keyed by the index (path, checkpoint), the kind, the
# damping and the statistics themselves (counted rows and digests of the eigenvalues and sums of
# squares, all rewritten by any close or append), so a changed index is never given stale factors.
# Two entries: each holds M·k⁴·8 bytes once its factors are made (bases and factors in float32:
# 50 MB at 6 modules of k = 32, 755 MB at SmolLM2's 90 MLP modules), half that before.
FACTORS: "OrderedDict[Tuple, Preconditioner]" = OrderedDict()
FACTORS_KEPT = 2


class Preconditioner(ABC):
    """Rows [n, D] float32 -> preconditioned rows [n, D] float32 (a new tensor); a symmetric linear map."""

    name = ""

    @classmethod
    @abstractmethod
    def from_index(cls, index: IndexReader, stats: RowStatistics, damping: float) -> "Preconditioner":
        """This preconditioner of `index` (at its checkpoint) from its statistics, on the CPU."""

    @abstractmethod
    def to(self, device: torch.device) -> "Preconditioner": ...

    @abstractmethod
    def __call__(self, rows: torch.Tensor) -> torch.Tensor: ...

    def queries(self, rows: torch.Tensor) -> torch.Tensor:
        """The same map for a few rows, queries [Q, D]: where a preconditioner has a cheaper form for
        them (Fisher), that one; the same numbers to float rounding, always the same form."""
        return self(rows)


class Diagonal(Preconditioner):
    """Each coordinate scaled by (m_j + λ)^-½: `scale` [D] float32."""

    name = "diag"

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    @classmethod
    def from_index(cls, index: IndexReader, stats: RowStatistics, damping: float) -> "Diagonal":
        mean_sq = torch.from_numpy(stats.sumsq / stats.count)
        scale = torch.ones_like(mean_sq)
        for b in index.meta.blocks:
            part = mean_sq[b.offset : b.offset + b.size]
            level = float(part.mean())
            if level > 0:
                scale[b.offset : b.offset + b.size] = (part + damping * level).rsqrt()
        return cls(scale.float())

    def to(self, device: torch.device) -> "Diagonal":
        return Diagonal(self.scale.to(device))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return rows * self.scale


class Fisher(Preconditioner):
    """Each module block multiplied by its (F_m + λI)^-½, symmetric, kept in two forms:
    `bases`, per module (B [s, r] float32, d [r] float64, c) with (F_m + λI)^-½ = B diag(d) Bᵀ + c·I
    (statistics.whitening_basis), and `factors` [M, s, s] float32, that product multiplied out.

    Queries (`queries`) are whitened through the bases, 2·s·r multiply-adds a row and module, in
    float64; stored rows (`__call__`: a build's or an unshortcut scan's chunks) through the factors,
    made on first use: M·s³ multiply-adds (0.3-0.5 s at six 1,024-wide modules, as long as the rest
    of an ANN search, which whitens only queries)."""

    name = "fisher"
    kronecker = False  # EKFAC: F kept on the diagonal of its Kronecker eigenbasis

    def __init__(self, bases: List[Tuple[torch.Tensor, torch.Tensor, float]], factors: Optional[torch.Tensor] = None):
        self.bases, self._factors = bases, factors

    def __getstate__(self) -> Dict:
        # Sent to Dask workers with the factors made: a worker whitens chunks' rows (for their norms)
        # with every task it unpickles this in, and must not multiply them out for each.
        return {"bases": self.bases, "_factors": self.factors}

    @property
    def factors(self) -> torch.Tensor:
        """float32 [M, s, s]: each module's (F_m + λI)^-½ (made on first use, then kept)."""
        if self._factors is None:
            made = [torch.from_numpy(basis_factor(b.cpu().numpy(), d.cpu().numpy(), c)) for b, d, c in self.bases]
            self._factors = torch.stack(made).to(self.bases[0][0].device)
        return self._factors

    @classmethod
    def from_index(cls, index: IndexReader, stats: RowStatistics, damping: float) -> "Fisher":
        group = finished_statistics(index.group)
        cached = group is not None and "eigvecs" in group.array_keys()  # the writer's eigendecomposition of F
        if not cached and stats.gram is None:
            raise ConfigError(
                f"setting 'query.precondition'={cls.name} needs module blocks of equal size at most {GRAM_MAX_SIZE} (grads.projection_dim <= 32) but the index at {str(index.path)!r} has none; use query.precondition=diag"
            )
        w, v = (group["eigvals"][:], group["eigvecs"]) if cached else stats.eigen()
        if stats.count < w.shape[1] and not cls.kronecker:
            warnings.warn(
                f"the index at {str(index.path)!r} has {stats.count} counted rows, fewer than k² = {w.shape[1]}: its second moment is rank-deficient and the damping sets the unseen directions",
                stacklevel=4,
            )

        def made() -> "Fisher":
            basis = kronecker_whitening_basis if cls.kronecker else whitening_basis
            # One module at a time: stored eigenvectors are read a module at a time.
            parts = [basis(w[m], np.asarray(v[m], dtype=np.float64), damping) for m in range(len(w))]
            # B is kept in float32 (the stored vectors' own precision; EK-FAC's Q rounded to it) and
            # raised to float64 a module at a time where it is used: kept in float64 it was twice
            # the factors it replaced (755 against 377 MB at SmolLM2's 90 MLP modules, k = 32).
            return cls([(torch.from_numpy(b.astype(np.float32)), torch.from_numpy(d), float(c)) for b, d, c in parts])

        if not cached:  # summed here from the rows: nothing stored to key them by
            return made()
        digest = hashlib.sha256(np.ascontiguousarray(w).tobytes() + np.ascontiguousarray(stats.sumsq).tobytes())
        key = (str(index.path), index.step, cls.kronecker, float(damping), stats.count, digest.hexdigest())
        if key not in FACTORS:
            FACTORS[key] = made()
            while len(FACTORS) > FACTORS_KEPT:
                FACTORS.popitem(last=False)
        FACTORS.move_to_end(key)
        return FACTORS[key]  # shared: its tensors are never written to, its factors made once for all

    def to(self, device: torch.device) -> "Fisher":
        if all(b.device == torch.device(device) for b, _, _ in self.bases):
            return self  # the same object: factors it makes are kept for the next batch too
        bases = [(b.to(device), d.to(device), c) for b, d, c in self.bases]
        return type(self)(bases, None if self._factors is None else self._factors.to(device))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return whiten(rows, self.factors)  # (F + λI)^-½ is symmetric: right-multiplying each block row applies it

    def queries(self, rows: torch.Tensor) -> torch.Tensor:
        # Each module block r ↦ ((r B) ⊙ d) Bᵀ + c r, in float64, back to float32.
        size = self.bases[0][0].shape[0]
        blocks = rows.reshape(len(rows), len(self.bases), size).double()
        out = torch.empty_like(blocks)
        for m, (b, d, c) in enumerate(self.bases):
            b = b.double()
            out[:, m] = ((blocks[:, m] @ b) * d) @ b.T + c * blocks[:, m]
        return out.reshape(rows.shape).float()


class EKFAC(Fisher):
    name = "ekfac"
    kronecker = True


PRECONDITIONERS: Dict[str, Type[Preconditioner]] = {c.name: c for c in (Diagonal, Fisher, EKFAC)}


def counted_rows(index: IndexReader) -> Optional[int]:
    """How many rows the index's statistics counted (None where no close finished writing them)."""
    stats = finished_statistics(index.group)
    return None if stats is None else int(stats.attrs[COUNTED_ROWS])


def auto_preconditioner(index: IndexReader) -> str:
    """What query.precondition=auto means for `index`: fisher where the index keeps the k²×k²
    second moments (grads.projection_dim <= 32) from at least FISHER_ROWS_PER_DIMENSION × k²
    counted rows, AUTO_FEW_ROWS where it has fewer rows, and diag where it keeps no second moments
    (k > 32: diag measured best there)."""
    size = gram_block_size(index.meta.blocks, index.meta.width)
    if size is None:
        return "diag"
    rows = counted_rows(index)
    return "fisher" if rows is not None and rows >= FISHER_ROWS_PER_DIMENSION * size else AUTO_FEW_ROWS


def build_preconditioner(index: IndexReader, name: str, damping: float) -> Optional[Preconditioner]:
    """The preconditioner `name` (not "auto"; "none": None) of `index` at its checkpoint, on the CPU."""
    if name == "none":
        return None
    if damping == 0:  # QuerySpec refused a negative damping; 0 is allowed, and means the floor
        warnings.warn(
            f"query.damping=0 would divide by directions the training rows never visited; using {DAMPING_FLOOR} × the mean eigenvalue",
            stacklevel=3,
        )
        damping = DAMPING_FLOOR
    stats = index.statistics()
    if stats.count == 0:
        warnings.warn(
            f"the index at {str(index.path)!r} has no counted rows to precondition with; query.precondition={name} is skipped",
            stacklevel=3,
        )
        return None
    return PRECONDITIONERS[name].from_index(index, stats, damping)
