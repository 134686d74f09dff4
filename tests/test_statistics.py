"""Row statistics written when an index closes: equal to a dense float64 pass over the stored rows,
whatever the order, the resumes or the slabs of modules the close sums at a time."""

import warnings

import numpy as np
import pytest
import torch
import zarr

from gradian_lightning import open_index
from gradian_lightning.gradients.projection import ModuleBlock
from gradian_lightning.index import layout, statistics
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.query.precondition import build_preconditioner

N, D = 11, 8
MODULES = [{"name": "a", "offset": 0, "size": 4}, {"name": "b", "offset": 4, "size": 4}]
META = {"fingerprint": "abc", "global_step": 0, "modules": MODULES}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(layout, "CHUNK_BYTES", 4 * 2 * D)  # 4 float16 rows per chunk


def rows():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(N, D, generator=g) * 3
    grads[4] = float("nan")  # non-finite: stored as zeros, not counted
    supervised = torch.full((N,), 3)
    supervised[6] = 0  # nothing supervised: not counted
    return grads, supervised


def write(writer, order):
    grads, supervised = rows()
    for i in order:
        writer.write([i], grads[i : i + 1], torch.ones(1), supervised[i : i + 1], torch.zeros(1), [f"r{i}"])


def stored_rows(storage="float16"):
    """float64 [N, D]: every row as a reader decodes it, computed here in numpy (int8: each module
    block in 255 levels of its own max |value|); the non-finite row is stored as zeros."""
    grads, _ = rows()
    values = torch.nan_to_num(grads, nan=0.0).double().numpy()
    values[4] = 0.0
    if storage != "int8":
        return torch.from_numpy(values).to(getattr(torch, storage)).double().numpy()
    out = np.zeros_like(values)
    for b in MODULES:
        block = values[:, b["offset"] : b["offset"] + b["size"]]
        scale = np.abs(block).max(axis=1, keepdims=True).astype(np.float32).astype(np.float64) / 127
        out[:, b["offset"] : b["offset"] + b["size"]] = np.round(block / np.where(scale > 0, scale, 1)) * scale
    return out


def dense(storage="float16"):
    keep = [i for i in range(N) if i not in (4, 6)]
    stored = stored_rows(storage)[keep]
    gram = np.stack(
        [stored[:, b["offset"] : b["offset"] + 4].T @ stored[:, b["offset"] : b["offset"] + 4] for b in MODULES]
    )
    return len(keep), (stored**2).sum(0), gram


def check_sums(stats, storage="float16"):
    count, sumsq, gram = dense(storage)
    assert stats.count == count
    np.testing.assert_allclose(stats.sumsq, sumsq, rtol=1e-6 if storage == "int8" else 1e-12)
    if stats.gram is not None:  # summed by the reader
        np.testing.assert_allclose(stats.gram, gram, rtol=1e-12, atol=1e-12)


def check(index, storage="float16"):
    """The stored count and sums, and the stored eigendecomposition (float32 vectors) of each
    module's mean second moment: V diag(w) Vᵀ is the dense float64 one."""
    check_sums(index.statistics(), storage)
    count, _, gram = dense(storage)
    group = index.group["statistics"]
    assert "gram" not in group.array_keys() and group["eigvecs"].dtype == np.float32
    w, v = group["eigvals"][:], group["eigvecs"][:].astype(np.float64)
    mean = gram / count
    np.testing.assert_allclose(np.einsum("mij,mj,mkj->mik", v, w, v), mean, rtol=0, atol=1e-6 * np.abs(mean).max())


def test_one_pass_equals_dense_float64_of_the_stored_rows(tmp_path):
    writer = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(writer, [7, 2, 9, 0, 10, 1, 3, 8, 4, 6, 5])
    assert writer.close()
    check(open_index(tmp_path / "ix"))


@pytest.mark.parametrize("closed", [True, False], ids=["closed-early", "killed"])
def test_two_resumed_halves_equal_one_pass(tmp_path, closed):
    first = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(first, [0, 1, 2, 3, 4, 9])  # one whole chunk flushed, rows 4 and 9 buffered in partial chunks
    if closed:
        assert not first.close()  # partial chunks flushed: a resume must not count them again
    second = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(second, range(N))  # the resumed job sends every row again; the done ones are skipped
    assert second.close()
    check(open_index(tmp_path / "ix"))


def test_one_module_a_pass_equals_all_at_once(tmp_path, monkeypatch):
    """The close sums the gram a slab of modules per pass, reading a few rows at a time, and writes
    each slab's whitened norms in the next pass: every split gives the one-slab statistics and norms."""
    writer = IndexWriter(tmp_path / "whole", N, D, "float16", META)
    write(writer, range(N))
    assert writer.close()
    monkeypatch.setattr(statistics, "GRAM_SLAB_BYTES", 4 * 4 * 8)  # one 4x4 float64 gram: a pass per module
    monkeypatch.setattr(statistics, "READ_BYTES", 1)  # one chunk of rows per read
    monkeypatch.setattr(statistics, "NORM_ROWS", 8)  # whitened norms in chunks of two reads: 8 + 3 rows
    writer = IndexWriter(tmp_path / "slabs", N, D, "float16", META)
    write(writer, range(N))
    assert writer.close()
    check(open_index(tmp_path / "slabs"))
    whole, slabs = open_index(tmp_path / "whole"), open_index(tmp_path / "slabs")
    assert slabs.group["statistics"]["whitened_norms"].chunks == (8, 1)
    assert slabs.whitened_damping == whole.whitened_damping is not None
    torch.testing.assert_close(slabs.whitened_norms(0, N), whole.whitened_norms(0, N), rtol=1e-6, atol=0)
    for name in ("eigvals", "eigvecs"):
        np.testing.assert_array_equal(slabs.group["statistics"][name][:], whole.group["statistics"][name][:])


def test_int8_rows_read_back_a_module_at_a_time_equal_dense_float64(tmp_path, monkeypatch):
    """Each slab's columns and scales are cut from the stored int8 rows: the statistics are those
    of the rows as a reader decodes them."""
    monkeypatch.setattr(statistics, "GRAM_SLAB_BYTES", 4 * 4 * 8)  # one module a pass
    writer = IndexWriter(tmp_path / "ix", N, D, "int8", META)
    write(writer, [3, 0, 10, 7, 1, 2, 4, 5, 6, 8, 9])
    assert writer.close()
    index = open_index(tmp_path / "ix")
    check(index, "int8")
    # and each row's whitened norms, |(F + λI)^-½ r| per module, λ = damping × F's mean eigenvalue
    count, _, gram = dense("int8")
    values, want = stored_rows("int8"), np.empty((N, len(MODULES)))
    for m, b in enumerate(MODULES):
        f = gram[m] / count
        w, v = np.linalg.eigh(f + index.whitened_damping * np.trace(f) / b["size"] * np.eye(b["size"]))
        want[:, m] = np.linalg.norm(values[:, b["offset"] : b["offset"] + b["size"]] @ v / np.sqrt(w), axis=1)
    np.testing.assert_allclose(index.whitened_norms(0, N).numpy(), want, rtol=1e-5)


def test_an_index_without_statistics_is_read_in_one_pass(tmp_path):
    writer = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(writer, range(N))
    writer.close()
    del zarr.open_group(str(tmp_path / "ix"), mode="r+")["statistics"]  # as a writer that never closed leaves it
    check_sums(open_index(tmp_path / "ix").statistics())


def test_a_close_killed_half_way_leaves_statistics_that_readers_ignore_and_a_rerun_replaces(tmp_path, monkeypatch):
    monkeypatch.setattr(statistics, "GRAM_SLAB_BYTES", 4 * 4 * 8)  # one module a slab: the first is written
    calls = []

    def dies_on_the_second_module(mean):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return eigen(mean)

    eigen = statistics._eigen
    monkeypatch.setattr(statistics, "_eigen", dies_on_the_second_module)
    writer = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(writer, range(N))
    with pytest.raises(KeyboardInterrupt):
        writer.close()
    index = open_index(tmp_path / "ix")
    assert "eigvecs" in index.group["statistics"].array_keys()  # half written ...
    assert statistics.finished_statistics(index.group) is None and index.whitened_damping is None
    check_sums(index.statistics())  # ... so the reader sums its own from the rows
    monkeypatch.setattr(statistics, "_eigen", eigen)
    rerun = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    assert rerun.kept_rows == N and rerun.close()
    check(open_index(tmp_path / "ix"))


# Below s = k² counted rows, F = RᵀR / rows has rank <= rows and the statistics keep only the first r =
# rows eigenvectors of each module (the thin form): 9 of the 11 rows counted, in modules of 36 values
# (k = 6: 9 <= s/2, an SVD of the rows themselves) or of 16 (k = 4: 9 > s/2, the top 9 of the gram's eigh).
@pytest.fixture(params=[36, 16], ids=["svd-of-rows", "eigh-of-gram"])
def size(request):
    return request.param


def thin_modules(size):
    return [{"name": "a", "offset": 0, "size": size}, {"name": "b", "offset": size, "size": size}]


def thin_rows(size):
    """float32 [N, 2·size]: correlated coordinates of very different scales (whitening changes the
    ranking), row 4 non-finite and row 6 unsupervised as in `rows`; and the supervised counts."""
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(2 * size, 2 * size, generator=g) * torch.logspace(-2, 1, 2 * size)
    grads = torch.randn(N, 2 * size, generator=g) @ mix
    grads[4] = float("nan")
    supervised = torch.full((N,), 3)
    supervised[6] = 0
    return grads, supervised


def thin_writer(path, size):
    return IndexWriter(path, N, 2 * size, "float32", {**META, "modules": thin_modules(size)})


def thin_index(path, size, order=range(N)):
    grads, supervised = thin_rows(size)
    writer = thin_writer(path, size)
    for i in order:
        writer.write([i], grads[i : i + 1], torch.ones(1), supervised[i : i + 1], torch.zeros(1), [f"r{i}"])
    assert writer.close()
    return open_index(path)


def thin_dense(size):
    """float64 [2, size, size]: each module's F = RᵀR / 9 over the counted rows, dense."""
    grads, _ = thin_rows(size)
    counted = grads[[i for i in range(N) if i not in (4, 6)]].double().numpy()
    return np.stack(
        [counted[:, m * size : (m + 1) * size].T @ counted[:, m * size : (m + 1) * size] / 9 for m in range(2)]
    )


def inverse_root(f, damping):
    """(F + λI)^-½, λ = damping × F's mean eigenvalue, from a dense float64 eigh."""
    w, v = np.linalg.eigh(f + damping * np.trace(f) / len(f) * np.eye(len(f)))
    return (v / np.sqrt(w)) @ v.T


def test_below_k2_rows_the_statistics_keep_as_many_eigenvectors_as_rows(tmp_path, size):
    """eigvecs [M, s, r], r = 9 counted rows, not [M, s, s]: eigvals are all s of F's, 0 past the
    first r, and V diag(w) Vᵀ is the dense F; the bytes are what statistics_bytes predicts."""
    index = thin_index(tmp_path / "ix", size)
    group = index.group["statistics"]
    assert group["eigvecs"].shape == (2, size, 9) and group["eigvals"].shape == (2, size)
    w, v = group["eigvals"][:], group["eigvecs"][:].astype(np.float64)
    assert (w[:, 9:] == 0).all()
    np.testing.assert_allclose(np.einsum("msr,msq->mrq", v, v), np.broadcast_to(np.eye(9), (2, 9, 9)), atol=1e-6)
    f = thin_dense(size)
    np.testing.assert_allclose(np.einsum("mij,mj,mkj->mik", v, w[:, :9], v), f, rtol=0, atol=1e-6 * np.abs(f).max())
    stored = sum(group[name].nbytes for name in ("sumsq", "eigvals", "eigvecs", "whitened_norms"))
    blocks = [ModuleBlock.from_entry(b) for b in thin_modules(size)]
    assert stored == statistics.statistics_bytes(blocks, 2 * size, 9) + 2 * 4 * (N - 9)  # norms of every row


@pytest.mark.parametrize("precondition", ["fisher", "ekfac", "diag"])
@pytest.mark.parametrize("damping", [1.0, 0.1])
def test_the_thin_form_scores_as_the_full_one(tmp_path, size, precondition, damping):
    """Scores from the stored thin eigenvectors equal those of the full s×s eigendecomposition a
    reader makes from the rows (statistics deleted), to float32 rounding: inner products, whole-row
    and per-module cosine (at damping 1.0 fisher's cosine divides by the stored whitened norms)."""
    thin = thin_index(tmp_path / "thin", size)
    thin_index(tmp_path / "full", size)
    del zarr.open_group(str(tmp_path / "full"), mode="r+")["statistics"]
    full = open_index(tmp_path / "full")
    g = torch.Generator().manual_seed(2)
    queries = torch.randn(3, 2 * size, generator=g) * torch.logspace(-2, 1, 2 * size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fisher below k² rows warns that F is rank-deficient: known here
        for score, normalize in (("inner", "row"), ("cosine", "row"), ("cosine", "module")):
            kw = dict(precondition=precondition, damping=damping, score=score, normalize=normalize)
            got, want = thin.score_all(queries, **kw).double(), full.score_all(queries, **kw).double()
            assert torch.isnan(got[:, [4, 6]]).all() and not torch.isnan(got[:, [0, 1, 2, 3, 5, 7, 8, 9, 10]]).any()
            torch.testing.assert_close(
                got, want, rtol=2e-5, atol=2e-5 * float(want.nan_to_num().abs().max()), equal_nan=True
            )
        factors = build_preconditioner(thin, precondition, damping)
    if precondition == "fisher":  # and against a dense float64 (F + λI)^-½
        want = np.stack([inverse_root(f, damping) for f in thin_dense(size)])
        np.testing.assert_allclose(factors.factors.double().numpy(), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_the_thin_form_whitened_norms_equal_dense_float64(tmp_path, size):
    """|(F + λI)^-½ r| of every row, counted or not, with F of rank 9 < s: the directions no
    counted row visited weigh λ^-½."""
    index = thin_index(tmp_path / "ix", size)
    grads, _ = thin_rows(size)
    values = torch.nan_to_num(grads, nan=0.0).double().numpy()
    values[4] = 0.0  # a non-finite row is stored as zeros
    want = np.stack(
        [
            np.linalg.norm(values[:, size * m : size * (m + 1)] @ inverse_root(f, index.whitened_damping), axis=1)
            for m, f in enumerate(thin_dense(size))
        ],
        axis=1,
    )
    np.testing.assert_allclose(index.whitened_norms(0, N).numpy(), want, rtol=1e-5)


def test_the_thin_form_one_module_a_pass_equals_all_at_once(tmp_path, monkeypatch, size):
    whole = thin_index(tmp_path / "whole", size, order=[5, 0, 9, 3, 1, 10, 2, 8, 4, 7, 6])
    # one module's 9 counted rows (or its gram) in float64
    monkeypatch.setattr(statistics, "GRAM_SLAB_BYTES", (9 if 9 <= size / 2 else size) * size * 8)
    monkeypatch.setattr(statistics, "READ_BYTES", 1)  # one chunk of rows per read
    monkeypatch.setattr(statistics, "NORM_ROWS", 8)
    slabs = thin_index(tmp_path / "slabs", size)
    assert slabs.group["statistics"]["whitened_norms"].chunks[1] == 1
    torch.testing.assert_close(slabs.whitened_norms(0, N), whole.whitened_norms(0, N), rtol=1e-6, atol=0)
    for name in ("eigvals", "eigvecs", "sumsq"):  # equal but for BLAS's threaded summation order
        np.testing.assert_allclose(slabs.group["statistics"][name][:], whole.group["statistics"][name][:], rtol=1e-12)


def test_a_thin_close_killed_half_way_is_ignored_by_readers_and_redone_by_a_rerun(tmp_path, monkeypatch, size):
    monkeypatch.setattr(statistics, "GRAM_SLAB_BYTES", 8)  # one module a slab: the first is written
    route = "_thin_eigen" if 9 <= size / 2 else "_top_eigen"  # what makes each module's vectors
    calls = []

    def dies_on_the_second_module(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return eigen(*args)

    eigen = getattr(statistics, route)
    monkeypatch.setattr(statistics, route, dies_on_the_second_module)
    grads, supervised = thin_rows(size)
    writer = thin_writer(tmp_path / "ix", size)
    writer.write(range(N), grads, torch.ones(N), supervised, torch.zeros(N), [f"r{i}" for i in range(N)])
    with pytest.raises(KeyboardInterrupt):
        writer.close()
    index = open_index(tmp_path / "ix")
    assert "eigvecs" in index.group["statistics"].array_keys()  # half written ...
    assert statistics.finished_statistics(index.group) is None and index.whitened_damping is None
    assert index.statistics().gram is not None  # ... so a reader sums its own from the rows
    monkeypatch.setattr(statistics, route, eigen)
    rerun = thin_writer(tmp_path / "ix", size)
    assert rerun.kept_rows == N and rerun.close()
    index, once = open_index(tmp_path / "ix"), thin_index(tmp_path / "once", size)
    assert index.group["statistics"]["eigvecs"].shape == (2, size, 9)
    torch.testing.assert_close(index.whitened_norms(0, N), once.whitened_norms(0, N), rtol=0, atol=0)


def test_a_long_close_prints_a_progress_line_and_a_short_one_nothing(tmp_path, monkeypatch, capsys):
    """The close's statistics show a bar of modules done (M eigendecompositions, then M modules'
    whitened norms) once they take CLOSE_PROGRESS_DELAY_S; a close quicker than that stays silent."""
    from gradian_lightning.index import writer as writer_module

    thin_index(tmp_path / "quick", 36)
    assert "row statistics" not in capsys.readouterr().err
    monkeypatch.setattr(writer_module, "CLOSE_PROGRESS_DELAY_S", 0)
    monkeypatch.setattr(statistics, "GRAM_SLAB_BYTES", 8)  # a pass per module: the bar moves
    thin_index(tmp_path / "slow", 36)
    err = capsys.readouterr().err
    assert "closing the index: row statistics" in err and "/4 " in err, err
