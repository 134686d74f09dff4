"""Row statistics written when an index closes: equal to a dense float64 pass over the stored rows,
whatever the order, the resumes or the slabs of modules the close sums at a time."""

import numpy as np
import pytest
import torch

from gradian_lightning import open_index
from gradian_lightning.index import layout, statistics
from gradian_lightning.index.writer import IndexWriter

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
    import zarr

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
