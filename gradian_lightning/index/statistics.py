"""Second moments of an index's stored rows, gathered by the writer in the same pass as the rows.

    index.path/statistics/           zarr group, attribute "rows" = rows counted
      sumsq   [D] f64                Σ_rows r_j²: per-coordinate sums of squares
      gram    [M, s, s] f64          Σ_rows R_mᵀR_m per module block m of size s = k² (present only
                                     when every block has one size s <= GRAM_MAX_SIZE)
      eigvals [M, s] f64, eigvecs [M, s, s] f64   the eigendecomposition of gram / rows, cached
                                     once so that any `query.damping` costs one small matmul
      whitened_norms [N, M] f32      |(F_m + λI)^-½ r_m| of each row and module at λ = the default
                                     query.damping (attribute "whitened_damping"), written by the
                                     writer when the index is complete; attribute last, so a close
                                     killed half-way leaves no attribute and readers whiten instead

Why the whitened norms are stored: with them a fisher query whitens only its own rows, twice
(qᵀ(F + λI)⁻¹ r = (W²q)·r), and scores a chunk as the none path does, one scaled decode and one
GEMM, instead of multiplying every k²-block of every row by a k²×k² factor (10x slower).

Counted rows are the stored values (decoded from the storage dtype, so a query preconditions
exactly what it reads) of rows that are finite and have at least one supervised token.

Why it is never double-counted after a resume: the writer sums, in memory, only the rows it
flushes itself (a row already complete on disk is never flushed again), and on close adds the
rows that were complete before it started, read back from disk. So the stored statistics are a
function of the set of complete rows, whatever sessions wrote them. Ranks never double-count
either: their rows are gathered to the one writer on rank 0. Statistics are plain sums, so two
row sets' statistics merge with `+`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch
import zarr

from gradian_lightning.index.layout import equal_block_size, has_member

# gram is s² float64 per module: 8 MiB per module at k = 32 (s = 1024). Beyond that (k = 64:
# 128 MiB per module) only the per-coordinate sums are kept, and `fisher` is not available.
GRAM_MAX_SIZE = 1024
SLAB_BYTES = 4 << 20  # the eigenvectors are computed and written this many bytes of modules at a time
STATISTICS_GROUP = "statistics"  # the zarr subgroup of the index root group that holds them
WHITENED_NORMS = "whitened_norms"
WHITENED_DAMPING = "whitened_damping"
# The damping the writer stores whitened norms for: the default query.damping (specs.QuerySpec; a
# test keeps the two equal), so that a default fisher query never whitens a chunk. Queries at any
# other damping whiten the chunks themselves (query/topk.py `uses_whitened_norms`).
WHITENED_NORMS_DAMPING = 1.0


def gram_block_size(blocks: Sequence[Dict[str, Any]], width: int) -> Optional[int]:
    """The common block size s when the k²×k² second moments are kept, else None."""
    size = equal_block_size(blocks, width)
    return size if size is not None and size <= GRAM_MAX_SIZE else None


def statistics_bytes(blocks: Sequence[Dict[str, Any]], width: int, rows: int) -> int:
    """Bytes the `statistics` group of an index of `rows` rows holds, before compression: sumsq
    [D] float64, and where gram is kept, gram and eigvecs [M, s, s] float64, eigvals [M, s] float64
    and whitened_norms [rows, M] float32. Fixed but for the last: 16·M·s² bytes, 94 MB for 90
    modules at k = 16 (s = 256), 1.5 GB at k = 32."""
    size = gram_block_size(blocks, width)
    total = width * 8
    if size is not None:
        total += 2 * len(blocks) * size * size * 8 + len(blocks) * size * 8 + rows * len(blocks) * 4
    return total


def whitening_factor(eigvals: np.ndarray, eigvecs: np.ndarray, damping: float) -> np.ndarray:
    """(F + λI)^-½ [s, s] float32 of one module from F's eigendecomposition (eigvals [s] >= 0,
    eigvecs [s, s]); λ = `damping` × the mean eigenvalue. A module whose rows are all zero (mean
    eigenvalue 0) gets the identity: nothing to whiten."""
    level = eigvals.mean()
    if level <= 0:
        return np.eye(len(eigvals), dtype=np.float32)
    return ((eigvecs * (1.0 / np.sqrt(eigvals + damping * level))) @ eigvecs.T).astype(
        np.float32
    )  # V diag((w + λ)^-½) Vᵀ


def kronecker_whitening_factor(eigvals: np.ndarray, eigvecs: np.ndarray, damping: float) -> np.ndarray:
    """(F̃ + λI)^-½ [s, s] float32 of one module, F̃ = F kept only on the diagonal of a Kronecker
    eigenbasis Q = Q_out ⊗ Q_in (EK-FAC, in the projected space): Q_out and Q_in are the eigenvectors
    of F's two partial traces (the k×k second moments of a row block's rows and of its columns,
    a [k_out, k_in] block being stored row-major), and F̃'s eigenvalues are F's own variances along
    Q (eigenvalue correction). k² numbers per module instead of fisher's k⁴, so few rows estimate them
    well; λ = `damping` × their mean, which is F's mean eigenvalue."""
    size = len(eigvals)
    k = int(round(size**0.5))
    level = eigvals.mean()
    if level <= 0 or k * k != size:
        return np.eye(size, dtype=np.float32)
    f = ((eigvecs * eigvals) @ eigvecs.T).reshape(k, k, k, k)  # F[(o, i), (o', i')]
    _, q_out = np.linalg.eigh(np.einsum("aibi->ab", f))
    _, q_in = np.linalg.eigh(np.einsum("oaob->ab", f))
    q = np.kron(q_out, q_in)
    corrected = ((eigvecs.T @ q) ** 2 * eigvals[:, None]).sum(0)  # qᵀ F q for every column q of Q
    return ((q * (1.0 / np.sqrt(corrected + damping * level))) @ q.T).astype(np.float32)


def whitening_factors(eigvals: np.ndarray, eigvecs: np.ndarray, damping: float, kronecker: bool = False) -> np.ndarray:
    """`whitening_factor` (`kronecker`: `kronecker_whitening_factor`) of every module: [M, s, s]
    float32 from eigvals [M, s], eigvecs [M, s, s]."""
    factors = np.empty(eigvecs.shape, dtype=np.float32)
    # One module at a time: the temporaries are one [s, s] block, not another [M, s, s] array.
    factor = kronecker_whitening_factor if kronecker else whitening_factor
    for m, (w, v) in enumerate(zip(eigvals, eigvecs)):
        factors[m] = factor(w, v, damping)
    return factors


def whiten(rows: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """float32 rows [n, M·s] with each module block multiplied by its factor ([M, s, s] float32, symmetric)."""
    m, s = factors.shape[0], factors.shape[1]
    return torch.einsum("nmi,mij->nmj", rows.reshape(len(rows), m, s), factors).reshape(len(rows), m * s)


ADD_ROWS = 4096  # rows RowStatistics.add converts to float64 at once


@dataclass
class RowStatistics:
    """Sums over counted rows. `count` rows; `sumsq` float64 [D]; `gram` float64 [M, s, s] or None."""

    count: int
    sumsq: np.ndarray
    gram: Optional[np.ndarray]

    @classmethod
    def empty(cls, blocks: Sequence[Dict[str, Any]], width: int) -> "RowStatistics":
        size = gram_block_size(blocks, width)
        gram = np.zeros((len(blocks), size, size)) if size is not None else None
        return cls(0, np.zeros(width), gram)

    def add(self, rows: torch.Tensor) -> None:
        """Add rows [n, D] (the counted ones only: the caller drops empty and non-finite rows)."""
        # ADD_ROWS rows at a time: a chunk of narrow rows holds 65,536 of them, and its float64
        # copy and squares whole were 40 MB of temporaries at every flush (benchmarks/RESULTS.md §9).
        for lo in range(0, len(rows), ADD_ROWS):
            part = rows[lo : lo + ADD_ROWS].detach().to(torch.float64)
            self.count += len(part)
            self.sumsq += part.square().sum(dim=0).numpy()
            if self.gram is not None:
                # Into the gram in place, a module at a time: an einsum over all modules would make a
                # temporary of the gram's size (47 MB for the MLP at k = 16) at every flush.
                gram, size = torch.from_numpy(self.gram), self.gram.shape[1]
                for m in range(len(gram)):
                    block = part[:, m * size : (m + 1) * size]
                    gram[m].addmm_(block.T, block)

    def __add__(self, other: "RowStatistics") -> "RowStatistics":
        gram = None if self.gram is None or other.gram is None else self.gram + other.gram
        return RowStatistics(self.count + other.count, self.sumsq + other.sumsq, gram)

    def save(self, group: zarr.Group, damping: Optional[float] = None) -> Optional[np.ndarray]:
        """Write (or replace) the `statistics` subgroup of an index group opened for writing.

        Returns the whitening factors at `damping` ([M, s, s] float32, `whitening_factor`) when
        `damping` is given and gram is kept, else None.
        """
        stats = group.require_group(STATISTICS_GROUP)
        stats.attrs.pop(WHITENED_DAMPING, None)  # first: the whitened norms are of the old statistics
        for name in list(stats.array_keys()):
            del stats[name]
        stats.create_array("sumsq", data=self.sumsq)
        factors = None
        if self.gram is not None:
            # The eigendecomposition of the mean second moment, once per index: a query's
            # (F + λI)^-½ for any damping λ is then V diag((w + λ)^-½) Vᵀ, no eigh per query.
            # The eigenvectors a slab of modules at a time (about 4 MiB), so that closing an index
            # costs one slab's temporaries beside the gram (47 MB for the MLP at k = 16), not an
            # array of the gram's size. They are stored uncompressed: zstd keeps 95% of their bytes
            # (69% of a gram's) and would be a third of the close's time.
            blocks, size = self.gram.shape[:2]
            chunks = (1, size, size)
            stats.create_array("gram", data=self.gram, chunks=chunks)
            eigvecs = stats.create_array(
                "eigvecs", shape=self.gram.shape, chunks=chunks, dtype=np.float64, compressors=None
            )
            eigvals = np.empty((blocks, size))
            factors = np.empty(self.gram.shape, dtype=np.float32) if damping is not None else None
            slab = max(1, SLAB_BYTES // (size * size * 8))
            for lo in range(0, blocks, slab):
                hi = min(lo + slab, blocks)
                vectors = np.empty((hi - lo, size, size))
                for m in range(lo, hi):
                    eigvals[m], vectors[m - lo] = self.module_eigen(m)
                    if factors is not None:
                        factors[m] = whitening_factor(eigvals[m], vectors[m - lo], damping)
                eigvecs[lo:hi] = vectors
            stats.create_array("eigvals", data=eigvals)
        stats.attrs["rows"] = int(self.count)
        return factors

    def module_eigen(self, m: int) -> tuple:
        """(eigvals [s] float64 clipped at 0, eigvecs [s, s] float64) of module m's mean second
        moment gram[m] / count."""
        w, v = np.linalg.eigh(self.gram[m] / max(self.count, 1))
        return np.clip(w, 0.0, None), v

    def eigen(self) -> tuple:
        """`module_eigen` of every module: (eigvals [M, s], eigvecs [M, s, s]) float64."""
        w, v = np.empty(self.gram.shape[:2]), np.empty_like(self.gram)
        for m in range(len(self.gram)):
            w[m], v[m] = self.module_eigen(m)
        return w, v

    @classmethod
    def load(cls, group: zarr.Group, gram: bool = True) -> Optional["RowStatistics"]:
        """The statistics stored in an index group (without `gram` when false: it is M·k⁴ float64),
        or None when it has none (written before they existed)."""
        if not has_member(group, STATISTICS_GROUP, zarr.Group):
            return None
        stats = group[STATISTICS_GROUP]
        gram = stats["gram"][:] if gram and "gram" in stats.array_keys() else None
        return cls(int(stats.attrs["rows"]), stats["sumsq"][:], gram)


def counted(finite: np.ndarray, supervised: np.ndarray) -> np.ndarray:
    """Bool mask of rows that enter the statistics: finite gradient, at least one supervised token."""
    return np.asarray(finite, dtype=bool) & (np.asarray(supervised) > 0)
