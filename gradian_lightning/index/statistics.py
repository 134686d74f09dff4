"""Second moments of an index's stored rows, written when the index closes, from the rows on disk.

    index.path/statistics/           zarr group, attribute "rows" = rows counted
      sumsq   [D] f64                Σ_rows r_j²: per-coordinate sums of squares
      eigvals [M, s] f64, eigvecs [M, s, r] f32   the eigendecomposition of each module's mean
                                     second moment F_m = Σ_rows R_mᵀR_m / rows (module blocks of one
                                     size s = k² <= GRAM_MAX_SIZE only): eigvals are all s of F's
                                     eigenvalues, eigvecs the vectors of the first r = min(rows, s)
                                     of them (`stored_rank`); any `query.damping` then costs one small
                                     matmul, F_m = V diag(w) Vᵀ
      whitened_norms [N, M] f32      |(F_m + λI)^-½ r_m| of each row and module at λ = the default
                                     query.damping (attribute "whitened_damping"), written by the
                                     writer when the index is complete; attribute last, so a close
                                     killed half-way leaves no attribute and readers whiten instead

Why r = min(rows, s) vectors (the thin form): F is a mean over rows, so its rank is at most the
rows counted, and below s rows eigenvalues r.. are exactly 0 and their vectors are any basis of
the rest of the space, where (F + λI)^-½ is λ^-½: (F + λI)^-½ = V diag((w + λ)^-½) Vᵀ + λ^-½ (I − V Vᵀ)
holds all of it (`whitening_basis`), and so do EK-FAC's partial traces and corrected eigenvalues
(`kronecker_whitening_basis`), which are sums over V's columns. So the statistics of N < s rows are
4·M·s·N bytes, 4× the int8 rows themselves, not the 377 MB of s vectors a module at SmolLM2's MLP
at k = 32. Up to s/2 rows (SVD_MAX_ROWS) the close takes a thin SVD of each module's [N, s] rows
(`_thin_eigen`, O(N²s + N³)) instead of summing an s×s gram and solving it (O(Ns² + s³)); nearer
s the gram's eigh is the cheaper of the two, and the top r of its vectors are kept. Bytes and
time both grow with N up to the full form at N >= s.

Why the whitened norms are stored: with them a fisher query whitens only its own rows, twice
(qᵀ(F + λI)⁻¹r = (W²q)·r), and scores a chunk as the none path does, one scaled decode and one
GEMM, instead of multiplying every k²-block of every row by a k²×k² factor (10x slower).

Counted rows are the stored values (decoded from the storage dtype, so a query preconditions
exactly what it reads) of complete rows that are finite and have at least one supervised token.

Why they are read back from disk at close (`write_statistics`) rather than summed while rows
arrive: the sums Σ R_mᵀR_m are M·k⁴ float64, 755 MB for SmolLM2's MLP at k = 32, and summed a slab
of modules per pass they never sit whole beside the model. Only their eigendecomposition is
stored, the vectors in float32 (what whitening multiplies in anyway): 377 MB there at s rows or
more, where the sums and float64 vectors beside them were 1.5 GB. And being a function of the
complete rows on disk, the statistics are the same however many killed, resumed or appending runs
wrote those rows. Ranks never double-count either: their rows are gathered to the one writer on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr

from gradian_lightning.index.layout import equal_block_size

# A module's second moment is s² float64 while it is summed: 8 MiB at k = 32 (s = 1024). Beyond that
# (k = 64: 128 MiB a module) only the per-coordinate sums are kept, and `fisher` is not available.
GRAM_MAX_SIZE = 1024
STATISTICS_GROUP = "statistics"  # the zarr subgroup of the index root group that holds them
COUNTED_ROWS = "rows"  # the attribute of the rows counted, written after every array: they are finished
WHITENED_NORMS = "whitened_norms"
# The damping the stored whitened norms are for. The writer stores them for the default
# query.damping (specs.DEFAULT_DAMPING), so that a default fisher query never whitens a chunk;
# queries at any other damping whiten the chunks themselves (query/scorer.py, `Scorer.shortcut`).
WHITENED_DAMPING = "whitened_damping"


def gram_block_size(blocks: Sequence[Dict[str, Any]], width: int) -> Optional[int]:
    """The common block size s when the k²×k² second moments are kept, else None."""
    size = equal_block_size(blocks, width)
    return size if size is not None and size <= GRAM_MAX_SIZE else None


def stored_rank(size: int, count: int) -> int:
    """r, the eigenvectors a module's statistics keep: min(counted rows, s), at least 1. F is a mean
    over `count` rows, so its eigenvalues past the first `count` are 0 (module docstring)."""
    return max(1, min(count, size))


def statistics_bytes(blocks: Sequence[Dict[str, Any]], width: int, rows: int) -> int:
    """Bytes the `statistics` group of an index of `rows` rows holds, before compression: sumsq
    [D] float64, and where second moments are kept, eigvecs [M, s, r] float32 (r = min(rows, s),
    `stored_rank`), eigvals [M, s] float64 and whitened_norms [rows, M] float32. Below s rows that
    is about 4·M·s·rows bytes (4× int8 rows); from s rows up 4·M·s², 377 MB for 90 modules at k = 32
    (s = 1,024), 24 MB at k = 16."""
    size = gram_block_size(blocks, width)
    total = width * 8
    if size is not None:
        rank = stored_rank(size, rows)
        total += len(blocks) * size * rank * 4 + len(blocks) * size * 8 + rows * len(blocks) * 4
    return total


def statistics_steps(blocks: Sequence[Dict[str, Any]], width: int, damping: Optional[float]) -> int:
    """The steps `write_statistics` reports to its progress bar: a step per module's statistics, and
    where it writes whitened norms (`damping`, second moments kept), one more per module's norms."""
    return len(blocks) * (2 if damping is not None and gram_block_size(blocks, width) is not None else 1)


def whitening_scales(eigvals: np.ndarray, damping: float) -> Optional[np.ndarray]:
    """(w + λ)^-½ [s] float64 of one module from F's eigenvalues w [s] >= 0, λ = `damping` × their
    mean; None for a module whose rows are all zero (mean eigenvalue 0): nothing to whiten."""
    level = eigvals.mean()
    return None if level <= 0 else 1.0 / np.sqrt(eigvals + damping * level)


def whitening_basis(eigvals: np.ndarray, eigvecs: np.ndarray, damping: float) -> Tuple[np.ndarray, np.ndarray, float]:
    """(B [s, r] float64, d [r] float64, c): (F + λI)^-½ of one module = B diag(d) Bᵀ + c·I, from
    F's eigendecomposition: eigvals w [s] >= 0 and the vectors V [s, r] of the first r of them
    (`stored_rank`; w[r:] = 0 when r < s). With all s, V diag((w + λ)^-½) Vᵀ; with r < s, plus
    λ^-½ (I − V Vᵀ) on the directions no row visited. `whitening_scales`; the identity for an
    all-zero module. Applied to a few rows as it stands (2·s·r multiply-adds a row, no s³ product)."""
    scales = whitening_scales(eigvals, damping)
    size, rank = eigvecs.shape
    if scales is None:
        return np.zeros((size, 0)), np.zeros(0), 1.0
    if rank == size:
        return np.asarray(eigvecs, dtype=np.float64), scales, 0.0
    rest = float(scales[rank])  # λ^-½: w is 0 from r on
    return np.asarray(eigvecs, dtype=np.float64), scales[:rank] - rest, rest


def basis_factor(basis: np.ndarray, weights: np.ndarray, rest: float) -> np.ndarray:
    """B diag(d) Bᵀ + c·I [s, s] float32 of a `whitening_basis` (B [s, r], d [r], c)."""
    factor = (basis * weights) @ basis.T
    if rest:
        factor[np.diag_indices(len(factor))] += rest
    return factor.astype(np.float32)


def kronecker_whitening_basis(
    eigvals: np.ndarray, eigvecs: np.ndarray, damping: float
) -> Tuple[np.ndarray, np.ndarray, float]:
    """(F̃ + λI)^-½ of one module as `whitening_basis` gives (F + λI)^-½: (B, d, c), here
    (Q, (qᵀ F q + λ)^-½ for each column q of Q, 0). F̃ = F kept only on the diagonal of a Kronecker
    eigenbasis Q = Q_out ⊗ Q_in (EK-FAC, in the projected space): Q_out and Q_in are the eigenvectors
    of F's two partial traces (the k×k second moments of a row block's rows and of its columns,
    a [k_out, k_in] block being stored row-major), and F̃'s eigenvalues are F's own variances along
    Q (eigenvalue correction). k² numbers per module instead of fisher's k⁴, so few rows estimate them
    well; λ = `damping` × their mean, which is F's mean eigenvalue. eigvals [s], eigvecs [s, r] as
    `whitening_basis` takes them: both the partial traces and the variances are sums over F's
    eigenpairs, and the r..s-1 ones are 0."""
    size, rank = eigvecs.shape
    k = int(round(size**0.5))
    level = eigvals.mean()
    if level <= 0 or k * k != size:
        return np.zeros((size, 0)), np.zeros(0), 1.0
    w = eigvals[:rank]
    vectors = eigvecs.reshape(k, k, rank)  # V[(o, i), j]
    _, q_out = np.linalg.eigh(np.einsum("aij,bij,j->ab", vectors, vectors, w))
    _, q_in = np.linalg.eigh(np.einsum("oaj,obj,j->ab", vectors, vectors, w))
    q = np.kron(q_out, q_in)
    corrected = ((eigvecs.T @ q) ** 2 * w[:, None]).sum(0)  # qᵀ F q for every column q of Q
    return q, 1.0 / np.sqrt(corrected + damping * level), 0.0


def whiten(rows: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """float32 rows [n, M·s] with each module block multiplied by its factor ([M, s, s] float32, symmetric)."""
    m, s = factors.shape[0], factors.shape[1]
    return torch.einsum("nmi,mij->nmj", rows.reshape(len(rows), m, s), factors).reshape(len(rows), m * s)


ADD_ROWS = 4096  # rows RowStatistics.add converts to float64 at once
# Second moments summed at once while an index closes (float64): 32 modules at k = 16 (3 passes for
# SmolLM2's 90 MLP modules), 2 at k = 32 (8 MiB each, 45 passes). The gram is never held whole
# beside the model: at k = 32 it was 755 MB, 1.14x the peak RSS of a plain training step, and a
# 64 MiB slab still lifted the close 0.18 GiB above the capture's own peak (benchmarks/RESULTS.md
# §10). A pass rereads the rows (from the page cache, for an index that fits in memory) but decodes
# and multiplies only its slab's columns: the multiply-adds are the same however the modules are split.
# Up to s/2 counted rows a module holds its counted rows instead of its gram (float64 [rows, s], for
# `_thin_eigen`): as many modules a slab as fit the same bytes, 32 at 64 rows and k = 32.
GRAM_SLAB_BYTES = 16 << 20
# A read of rows at close: at most this many bytes of stored rows (zarr reads whole grads chunks,
# every column) and of the float64 copies of its slabs' columns.
READ_BYTES = 16 << 20
NORM_ROWS = 4096  # rows of a whitened_norms chunk, at least (whole reads of rows: no chunk is rewritten)
# The most counted rows, as a share of s, whose eigenvectors come from an SVD of the rows themselves.
# Timed for one module at s = 1,024 (numpy's OpenBLAS, one thread, on the loaded 2-core box), SVD
# against gram + eigh: 0.5 s against 2.3 s at 256 rows, 1.9 against 2.0 at 512, 2.8 against 2.5
# at 768, 5.2 against 2.9 at 1,023. They meet at s/2.
SVD_MAX_ROWS = 0.5


def _eigen(mean_gram: np.ndarray) -> tuple:
    # eigh of a mean second moment; rounding can leave tiny negative eigenvalues, which are 0.
    w, v = np.linalg.eigh(mean_gram)
    return np.clip(w, 0.0, None), v


def _top_eigen(mean_gram: np.ndarray, rank: int) -> tuple:
    """(w [s], V [s, r]) of a mean second moment of `rank` = r <= s rows from its eigh (`_eigen`):
    all s pairs when r = s, else the top r, with w[r:] = 0 (what rounding left there: F's rank is
    at most r)."""
    w, v = _eigen(mean_gram)
    if rank == len(w):
        return w, v
    top = np.zeros_like(w)
    top[:rank] = w[-rank:][::-1]
    return top, v[:, -rank:][:, ::-1]


def _thin_eigen(rows: np.ndarray, count: int) -> tuple:
    """(w [s] float64 >= 0, V [s, r] float64) of one module's F = RᵀR / count from its counted rows
    R [count, s] float64 themselves, count <= s/2 (SVD_MAX_ROWS): the thin SVD R / √count = U S Vᵀ
    gives F's first r = count eigenpairs (S², V), and w[r:] = 0. O(count²·s), against eigh's O(s³);
    and V is orthonormal however small S gets, which V = RᵀU/S from the count×count gram is not."""
    w = np.zeros(rows.shape[1])
    if count == 0:
        return w, np.zeros((rows.shape[1], 1))
    _, singular, vt = np.linalg.svd(rows / np.sqrt(count), full_matrices=False)
    w[: len(singular)] = singular**2
    return w, vt.T


def _whitened_norms(rows: torch.Tensor, basis: torch.Tensor, scales: torch.Tensor, rest: torch.Tensor) -> np.ndarray:
    """|(F + λI)^-½ r| [n, m] float32 of float32 rows [n, m·s] for m modules, from each module's
    stored eigenvectors `basis` [m, s, r], their (w + λ)^-½ `scales` [m, r], and `rest` [m] the
    weight of the part of r outside V's columns: λ^-1 for a thin V (r < s), 0 for a full one, 1 for
    an all-zero module (basis 0: its norm is |r|). |(F + λI)^-½ r|² = |diag(scales) Vᵀr|² +
    rest·(|r|² − |Vᵀr|²): V is orthonormal, so no s×s factor is made. In `basis`'s dtype (float64
    for a thin V, where |r|² − |Vᵀr|² cancels)."""
    blocks = rows.reshape(len(rows), len(basis), -1).to(basis.dtype)
    projected = torch.einsum("nmi,mir->nmr", blocks, basis)
    squares = (projected * scales).square().sum(2)
    if bool((rest > 0).any()):
        squares += rest * (blocks.square().sum(2) - projected.square().sum(2)).clamp_min(0)
    return squares.sqrt().float().numpy()


def write_statistics(
    group: zarr.Group,
    read: Callable[[int, int, int, int], torch.Tensor],
    keep: np.ndarray,
    blocks: Sequence[Dict[str, Any]],
    width: int,
    chunk: int,
    row_bytes: int,
    damping: Optional[float] = None,
    progress: Optional[Any] = None,
) -> None:
    """Write (or replace) the `statistics` subgroup of an index group opened for writing, from the
    rows stored in it: `read(lo, hi, a, b)` returns rows lo..hi-1 of module blocks a..b-1 as a reader
    decodes them (float32 [hi - lo, (b - a)·s], or [hi - lo, D] when a, b = 0, M), `keep` [N] bool
    marks the counted rows (`counted`, and complete), `chunk` and `row_bytes` are the grads array's
    rows per chunk and bytes per stored row. With `damping`, also each row's whitened module norms
    at that damping (module docstring: why). `progress`, a tqdm bar of `statistics_steps` steps, is
    updated as each module's statistics, then its whitened norms, are written.

    One pass over the rows per slab of modules (GRAM_SLAB_BYTES of gram, or up to s/2 counted rows
    of the counted rows themselves, at a time), and where whitened norms are written, one more: pass p
    sums slab p's moments and writes slab p-1's whitened norms, from the eigenvectors the end of
    pass p-1 made. So memory is a slab, not the M·k⁴ gram, and the statistics are a function of the
    stored rows alone, however many runs wrote them.

    The "rows" attribute is written after every array (`finished_statistics`): a close killed
    half-way leaves statistics that readers ignore, summing their own from the rows instead.
    """
    stats = group.require_group(STATISTICS_GROUP)
    # First: the old arrays are of other rows, and from here until the end they are half written.
    stats.attrs.pop(WHITENED_DAMPING, None)
    stats.attrs.pop(COUNTED_ROWS, None)
    for name in list(stats.array_keys()):
        del stats[name]
    num_rows, modules, count = len(keep), len(blocks), int(keep.sum())
    size = gram_block_size(blocks, width)
    sumsq = np.zeros(width)
    if size is None:  # no gram: one pass for the per-coordinate sums
        for lo in range(0, num_rows, chunk):
            hi = min(lo + chunk, num_rows)
            _add_sumsq(sumsq, read(lo, hi, 0, modules)[torch.from_numpy(keep[lo:hi])])
        stats.create_array("sumsq", data=sumsq)
        stats.attrs[COUNTED_ROWS] = count
        if progress is not None:
            progress.update(modules)
        return
    rank = stored_rank(size, count)
    thin = rank < size  # F has rank <= count: r < s vectors kept (module docstring)
    hold_rows = count <= SVD_MAX_ROWS * size  # the counted rows themselves, for `_thin_eigen`, not a gram
    per_slab = min(modules, max(1, GRAM_SLAB_BYTES // ((rank if hold_rows else size) * size * 8)))
    slabs = [(a, min(a + per_slab, modules)) for a in range(0, modules, per_slab)]
    # Rows a read takes: whole grads chunks, READ_BYTES of them stored and of two slabs in float64.
    step = max(1, min(READ_BYTES // row_bytes, READ_BYTES // (2 * per_slab * size * 8)) // chunk) * chunk
    # The eigenvectors are stored uncompressed: zstd keeps 95% of their bytes and would be a third
    # of the close's time.
    eigvecs = stats.create_array(
        "eigvecs", shape=(modules, size, rank), chunks=(1, size, rank), dtype=np.float32, compressors=None
    )
    eigvals = np.empty((modules, size))
    norms = None
    if damping is not None:
        # A chunk is whole reads of rows by one slab of modules, so each is written once, whole.
        rows_per_chunk = -(-NORM_ROWS // step) * step
        norms = stats.create_array(
            WHITENED_NORMS,
            shape=(num_rows, modules),
            chunks=(rows_per_chunk, per_slab),
            dtype=np.float32,
            fill_value=0.0,
        )
    # (a, b, eigenvectors [b - a, s, r], (w + λ)^-½ [b - a, r], rest [b - a]) of the slab whose
    # norms this pass writes (`_whitened_norms`)
    whitening: Optional[Tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = None
    for p in range(len(slabs) + (norms is not None)):
        gram_slab = slabs[p] if p < len(slabs) else None
        a = whitening[0] if whitening is not None else gram_slab[0]
        b = gram_slab[1] if gram_slab is not None else whitening[1]
        # The slab's gram [b - a, s, s], or (hold_rows) its counted rows' columns [count, (b - a)·s]
        moments = None
        if gram_slab is not None:
            width_of_slab = (gram_slab[1] - gram_slab[0]) * size
            moments = (
                np.empty((count, width_of_slab)) if hold_rows else np.zeros((gram_slab[1] - gram_slab[0], size, size))
            )
        filled = 0  # hold_rows: counted rows copied into `moments` so far
        written, pending = 0, []  # whitened norms of rows written..lo-1, not yet in a whole chunk
        for lo in range(0, num_rows, step):
            hi = min(lo + step, num_rows)
            rows = read(lo, hi, a, b)
            if gram_slab is not None:
                columns = rows[:, (gram_slab[0] - a) * size :][torch.from_numpy(keep[lo:hi])]
                _add_sumsq(sumsq[gram_slab[0] * size : gram_slab[1] * size], columns)
                if hold_rows:
                    moments[filled : filled + len(columns)] = columns.numpy()
                    filled += len(columns)
                else:
                    _add_gram(moments, columns, size)
            if whitening is not None:
                mine = rows[:, : (whitening[1] - whitening[0]) * size]
                pending += [
                    _whitened_norms(mine[r : r + ADD_ROWS], *whitening[2:]) for r in range(0, hi - lo, ADD_ROWS)
                ]
                if hi % norms.chunks[0] == 0 or hi == num_rows:
                    norms[written:hi, whitening[0] : whitening[1]] = np.concatenate(pending)
                    written, pending = hi, []
        if whitening is not None and progress is not None:
            progress.update(whitening[1] - whitening[0])
        whitening = None  # freed before the next slab's is made
        if gram_slab is not None:
            ga, gb = gram_slab
            dtype = np.float64 if thin else np.float32  # `_whitened_norms`: float64 where |r|² − |Vᵀr|² cancels
            basis = np.zeros((gb - ga, size, rank), dtype=dtype) if norms is not None else None
            scales, rest = np.zeros((gb - ga, rank), dtype=dtype), np.zeros(gb - ga, dtype=dtype)
            for m in range(ga, gb):
                # The eigendecomposition of the mean second moment, once per index: a query's
                # (F + λI)^-½ for any damping λ is then V diag((w + λ)^-½) Vᵀ, no eigh per query.
                if hold_rows:
                    eigvals[m], vectors = _thin_eigen(moments[:, (m - ga) * size : (m - ga + 1) * size], count)
                else:
                    eigvals[m], vectors = _top_eigen(moments[m - ga] / max(count, 1), rank)
                vectors = vectors.astype(np.float32)  # as stored: the norms are of what queries whiten with
                eigvecs[m] = vectors
                if basis is not None:
                    scale = whitening_scales(eigvals[m], damping)
                    if scale is None:  # an all-zero module is not whitened: its norm is |r|
                        rest[m - ga] = 1.0
                    else:
                        basis[m - ga], scales[m - ga] = vectors, scale[:rank]
                        rest[m - ga] = scale[rank] ** 2 if thin else 0.0  # λ^-1 on the directions past V
                if progress is not None:
                    progress.update(1)
            moments = None
            if basis is not None:
                whitening = (ga, gb, *(torch.from_numpy(x) for x in (basis, scales, rest)))
    stats.create_array("sumsq", data=sumsq)
    stats.create_array("eigvals", data=eigvals)
    stats.attrs[COUNTED_ROWS] = count
    if norms is not None:
        stats.attrs[WHITENED_DAMPING] = damping  # last: only a finished close makes the norms valid


def finished_statistics(group: zarr.Group) -> Optional[zarr.Group]:
    """The `statistics` subgroup of an index group, if a writer's close finished writing it (its
    "rows" attribute, written after the arrays); None if there is none or it was cut short."""
    stats = group.get(STATISTICS_GROUP)
    return stats if isinstance(stats, zarr.Group) and COUNTED_ROWS in stats.attrs else None


def _add_sumsq(sumsq: np.ndarray, rows: torch.Tensor) -> None:
    # Into float64 sums ADD_ROWS rows at a time: a float64 copy of many rows whole is a large temporary.
    for lo in range(0, len(rows), ADD_ROWS):
        sumsq += rows[lo : lo + ADD_ROWS].to(torch.float64).square().sum(dim=0).numpy()


def _add_gram(gram: np.ndarray, rows: torch.Tensor, size: int) -> None:
    # Into each module's gram in place: an einsum over the modules would make a gram-sized temporary.
    target = torch.from_numpy(gram)
    for lo in range(0, len(rows), ADD_ROWS):
        part = rows[lo : lo + ADD_ROWS]
        for m in range(len(gram)):
            block = part[:, m * size : (m + 1) * size].to(torch.float64)
            target[m].addmm_(block.T, block)


@dataclass
class RowStatistics:
    """Sums over counted rows: `count` rows; `sumsq` float64 [D]; `gram` float64 [M, s, s] or None.
    As stored (`load`: the gram is not, its eigendecomposition is), or summed by a reader over an
    index written without them (`add`)."""

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
        self.count += len(rows)
        _add_sumsq(self.sumsq, rows)
        if self.gram is not None:
            _add_gram(self.gram, rows, self.gram.shape[1])

    def eigen(self) -> tuple:
        """(eigvals [M, s] float64 clipped at 0, eigvecs [M, s, s] float64) of each module's mean
        second moment gram[m] / count."""
        w, v = np.empty(self.gram.shape[:2]), np.empty_like(self.gram)
        for m in range(len(self.gram)):
            w[m], v[m] = _eigen(self.gram[m] / max(self.count, 1))
        return w, v

    @classmethod
    def load(cls, group: zarr.Group) -> Optional["RowStatistics"]:
        """The count and sums stored in an index group (the gram is not stored: its `eigvals` and
        `eigvecs` are, in the same subgroup), or None when it has none (a writer that never closed,
        or whose close was killed)."""
        stats = finished_statistics(group)
        if stats is None:
            return None
        return cls(int(stats.attrs[COUNTED_ROWS]), stats["sumsq"][:], None)


def counted(finite: np.ndarray, supervised: np.ndarray) -> np.ndarray:
    """Bool mask of rows that enter the statistics: finite gradient, at least one supervised token."""
    return np.asarray(finite, dtype=bool) & (np.asarray(supervised) > 0)
