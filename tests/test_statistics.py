"""Row statistics gathered while indexing: equal to a dense float64 pass over the stored rows,
whatever the order, the resumes or the split across ranks."""

import numpy as np
import pytest
import torch

from gradian_lightning import open_index
from gradian_lightning.index import layout
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


def dense(storage="float16"):
    grads, _ = rows()
    keep = [i for i in range(N) if i not in (4, 6)]
    stored = grads[keep].to(getattr(torch, storage)).double().numpy()
    gram = np.stack(
        [stored[:, b["offset"] : b["offset"] + 4].T @ stored[:, b["offset"] : b["offset"] + 4] for b in MODULES]
    )
    return len(keep), (stored**2).sum(0), gram


def check(stats):
    count, sumsq, gram = dense()
    assert stats.count == count
    np.testing.assert_allclose(stats.sumsq, sumsq, rtol=1e-12)
    np.testing.assert_allclose(stats.gram, gram, rtol=1e-12, atol=1e-12)


def test_one_pass_equals_dense_float64_of_the_stored_rows(tmp_path):
    writer = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(writer, [7, 2, 9, 0, 10, 1, 3, 8, 4, 6, 5])
    assert writer.close()
    check(open_index(tmp_path / "ix").statistics())


@pytest.mark.parametrize("closed", [True, False], ids=["closed-early", "killed"])
def test_two_resumed_halves_equal_one_pass(tmp_path, closed):
    first = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(first, [0, 1, 2, 3, 4, 9])  # one whole chunk flushed, rows 4 and 9 buffered in partial chunks
    if closed:
        assert not first.close()  # partial chunks flushed: a resume must not count them again
    second = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(second, range(N))  # the resumed job sends every row again; the done ones are skipped
    assert second.close()
    check(open_index(tmp_path / "ix").statistics())


def test_statistics_of_two_ranks_merge_to_one_pass(tmp_path):
    halves = []
    for name, part in (("r0", [0, 2, 4, 6, 8, 10]), ("r1", [1, 3, 5, 7, 9])):
        writer = IndexWriter(tmp_path / name, N, D, "float16", META)
        write(writer, part)
        writer.close()
        halves.append(open_index(tmp_path / name).statistics())
    check(halves[0] + halves[1])


def test_an_index_without_statistics_is_read_in_one_pass(tmp_path):
    import zarr

    writer = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(writer, range(N))
    writer.close()
    del zarr.open_group(str(tmp_path / "ix"), mode="r+")["statistics"]  # as written before statistics existed
    check(open_index(tmp_path / "ix").statistics())
