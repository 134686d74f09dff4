import numpy as np
import pytest
import torch
import zarr

from gradian_lightning import open_index
from gradian_lightning.errors import ConfigError, IndexFormatError
from gradian_lightning.index import layout
from gradian_lightning.index.writer import IndexWriter

N, D = 10, 8


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(layout, "CHUNK_BYTES", 4 * 4 * D)  # 4 float32 rows per chunk


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.rand(N, generator=g)


def write(writer, order, grads, loss):
    for i in order:
        writer.write([i], grads[i : i + 1], loss[i : i + 1], torch.tensor([3]), torch.tensor([0]), [f"row{i}"])


META = {"fingerprint": "abc", "global_step": 0}


def test_rows_land_at_positions_and_read_back_with_plain_zarr(tmp_path):
    grads, loss = data()
    writer = IndexWriter(tmp_path / "ix", N, D, "float32", META)
    write(writer, [7, 2, 9, 0, 1, 3, 8, 4, 6, 5], grads, loss)
    assert writer.close()
    group = zarr.open_group(str(tmp_path / "ix"))
    np.testing.assert_array_equal(group["grads"][:], grads.numpy())
    assert list(group["id"][:]) == [f"row{i}" for i in range(N)]
    np.testing.assert_allclose(group["loss"][:], loss.numpy())
    assert group.attrs["gradian"]["complete"] is True
    reader = open_index(tmp_path / "ix")
    assert len(reader) == N and torch.equal(reader.rows([3, 1]), grads[[3, 1]])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_storage_halves_bytes_and_round_trips(tmp_path, dtype):
    grads, loss = data()
    sizes = {}
    for kind in ("float32", dtype):
        writer = IndexWriter(tmp_path / kind, N, D, kind, META)
        write(writer, range(N), grads, loss)
        writer.close()
        sizes[kind] = zarr.open_group(str(tmp_path / kind))["grads"].nbytes
        back = open_index(tmp_path / kind).rows(slice(None))
        want = grads.to(getattr(torch, kind)).float()
        assert torch.equal(back, want)
    assert sizes[dtype] * 2 == sizes["float32"]


@pytest.mark.parametrize("sizes", [(3, 5), (4, 4)], ids=["unequal-modules", "equal-modules"])
def test_int8_rounds_each_module_block_to_its_own_scale(tmp_path, sizes):
    grads, loss = data()
    grads[:, : sizes[0]] *= 1e-3  # modules whose gradients differ by orders of magnitude
    grads[6, sizes[0] :] = 0.0  # an all-zero block
    modules = [{"offset": 0, "size": sizes[0]}, {"offset": sizes[0], "size": sizes[1]}]
    writer = IndexWriter(tmp_path / "ix", N, D, "int8", {**META, "modules": modules})
    write(writer, [7, 2, 9, 0, 1, 3, 8, 4, 6, 5], grads, loss)
    assert writer.close()
    # The reference: numpy, block by block: q = round(127 x / max|x|), read back as q max|x| / 127.
    x = grads.double().numpy()
    want, steps = np.zeros_like(x), np.zeros((N, 2))
    for m, (lo, size) in enumerate([(0, sizes[0]), (sizes[0], sizes[1])]):
        block = x[:, lo : lo + size]
        steps[:, m] = np.abs(block).max(axis=1) / 127
        safe = np.where(steps[:, m] > 0, steps[:, m], 1.0)[:, None]
        want[:, lo : lo + size] = np.clip(np.round(block / safe), -127, 127) * safe
    group = zarr.open_group(str(tmp_path / "ix"))
    assert group["grads"].dtype == np.int8 and group["grads"].nbytes == N * D
    np.testing.assert_allclose(group["scales"][:], steps, rtol=1e-6)
    back = open_index(tmp_path / "ix").rows(slice(None)).double().numpy()
    np.testing.assert_allclose(back, want, rtol=1e-6, atol=1e-12)
    assert np.all(np.abs(back - x) <= np.repeat(steps, sizes, axis=1) / 2 * (1 + 1e-6))
    assert not back[6, sizes[0] :].any()
    # The stored norms and statistics are of the rows as read back, like every other dtype's.
    np.testing.assert_allclose(group["norms"][:, 1], np.linalg.norm(want[:, sizes[0] :], axis=1), rtol=1e-5)
    np.testing.assert_allclose(open_index(tmp_path / "ix").statistics().sumsq, (want**2).sum(axis=0), rtol=1e-5)
    assert torch.equal(open_index(tmp_path / "ix").rows([6, 2]), torch.from_numpy(back[[6, 2]]).float())


def test_int8_index_without_its_scales_is_refused_in_one_line(tmp_path):
    grads, loss = data()
    writer = IndexWriter(tmp_path / "ix", N, D, "int8", META)
    write(writer, range(N), grads, loss)
    writer.close()
    del zarr.open_group(str(tmp_path / "ix"))["scales"]
    with pytest.raises(IndexFormatError, match=r"stores int8 rows without their per-module scales .*rebuild the index"):
        open_index(tmp_path / "ix")


def test_killed_run_resumes_and_is_never_marked_complete_early(tmp_path):
    grads, loss = data()
    first = IndexWriter(tmp_path / "ix", N, D, "float32", META)
    write(first, range(6), grads, loss)  # chunk 0 (rows 0-3) is flushed; rows 4-5 are still buffered
    del first  # killed: no close()
    meta = layout.read_meta(tmp_path / "ix")
    assert meta.complete is False
    again = IndexWriter(tmp_path / "ix", N, D, "float32", META)
    assert np.flatnonzero(again.todo).tolist() == [4, 5, 6, 7, 8, 9]
    write(again, range(N), grads, loss)
    assert again.close()
    np.testing.assert_array_equal(open_index(tmp_path / "ix").rows(slice(None)).numpy(), grads.numpy())


def test_nonfinite_rows_are_flagged_not_stored(tmp_path):
    grads, loss = data()
    grads[3, 1] = float("nan")
    loss[5] = float("inf")
    writer = IndexWriter(tmp_path / "ix", N, D, "float16", META)
    write(writer, range(N), grads, loss)
    writer.close()
    reader = open_index(tmp_path / "ix")
    assert np.flatnonzero(~reader.column("finite")).tolist() == [3, 5] and sorted(writer.nonfinite_rows) == [3, 5]
    assert torch.isfinite(reader.rows(slice(None))).all() and reader.rows([3]).abs().sum() == 0


def test_other_index_or_foreign_directory_is_not_replaced_silently(tmp_path):
    grads, loss = data()
    writer = IndexWriter(tmp_path / "ix", N, D, "float32", META)
    write(writer, range(N), grads, loss)
    writer.close()
    with pytest.raises(ConfigError, match="another configuration.*index.overwrite=true"):
        IndexWriter(tmp_path / "ix", N, D, "float32", {"fingerprint": "other", "global_step": 0})
    assert open_index(tmp_path / "ix").meta.complete  # untouched
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a Gradian index"):
        IndexWriter(tmp_path / "mine", N, D, "float32", META)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    IndexWriter(tmp_path / "ix", N, D, "float32", {"fingerprint": "other", "global_step": 0}, overwrite=True)
    assert not open_index(tmp_path / "ix").meta.complete


def test_same_job_at_a_later_step_replaces_the_index(tmp_path):
    grads, loss = data()
    writer = IndexWriter(tmp_path / "ix", N, D, "float32", META)
    write(writer, range(N), grads, loss)
    writer.close()
    later = IndexWriter(tmp_path / "ix", N, D, "float32", {**META, "global_step": 5})
    assert later.todo.all()
    replaced = open_index(tmp_path / "ix")
    assert not replaced.column("complete").any() and not replaced.rows(slice(None)).any()  # the old rows are gone
    write(later, range(N), 2 * grads, loss)
    later.close()
    again = open_index(tmp_path / "ix")
    assert again.meta.global_step == 5 and torch.equal(again.rows(slice(None)), 2 * grads)


def test_not_an_index_or_wrong_version(tmp_path):
    with pytest.raises(IndexFormatError, match="not a Gradian index"):
        open_index(tmp_path)
    grads, loss = data()
    writer = IndexWriter(tmp_path / "ix", N, D, "float32", META)
    writer.close()
    group = zarr.open_group(str(tmp_path / "ix"), mode="r+")
    group.attrs["gradian"] = {**group.attrs["gradian"], "format_version": 99}
    with pytest.raises(IndexFormatError, match="format version 99"):
        open_index(tmp_path / "ix")


@pytest.mark.parametrize("chosen", [None, "3"])
def test_writing_uses_one_zarr_thread_unless_the_user_chose(tmp_path, chosen):
    # zarr's default thread pool fragments glibc's per-thread arenas: the writer's RSS grew with
    # the rows (benchmarks/RESULTS.md §9). A fresh process, since zarr's config is process-wide.
    import os
    import subprocess
    import sys

    code = (
        "import zarr; from gradian_lightning.index.location import Location; "
        f"Location({str(tmp_path / 'idx')!r}).open_group('w'); print(zarr.config.get('threading.max_workers'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZARR_THREADING__MAX_WORKERS"}
    if chosen:
        env["ZARR_THREADING__MAX_WORKERS"] = chosen
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == (chosen or "1")


def test_rows_waiting_for_their_chunk_cost_their_bytes_not_python_objects(tmp_path):
    # A chunk of narrow rows holds 10^5 of them (k = 4, int8: 32 bytes a row in ~4 MiB); every row
    # written waits in memory until its chunk is whole. Kept as per-row Python objects (a dict
    # entry, tuples, a view of the row) they cost ~1 KB a row, and 10^6 rows peaked at 1.5x the RSS
    # of 10^4. Measured with tracemalloc (numpy reports its buffers to it) over 20,000 buffered rows,
    # then the chunk flushed whole and read back.
    import tracemalloc

    rows, width, batch = 20_000, 32, 64
    writer = IndexWriter(tmp_path / "ix", rows + 1, width, "int8", META, rows_per_chunk=rows + 1)
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(rows + 1, width, generator=g)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for lo in range(0, rows, batch):
        hi = min(lo + batch, rows)
        at = list(range(lo, hi))
        writer.write(
            at,
            grads[lo:hi],
            torch.ones(hi - lo),
            torch.full((hi - lo,), 3),
            torch.zeros(hi - lo),
            [f"row-{i}" for i in at],
        )
    per_row = (tracemalloc.get_traced_memory()[0] - before) / rows
    tracemalloc.stop()
    assert per_row < 200, f"{per_row:.0f} bytes a buffered row"  # stored 32 + scale 4 + id ~60 + columns
    assert not writer.done.any()  # nothing flushed yet: the chunk is one row short
    writer.write(
        [rows, rows - 1],
        grads[[rows, rows - 1]],
        torch.ones(2),
        torch.full((2,), 3),
        torch.zeros(2),
        [f"row-{rows}", f"row-{rows - 1}"],
    )
    assert writer.done.all() and writer.close()
    index = open_index(tmp_path / "ix")
    assert list(index.column("id")) == [f"row-{i}" for i in range(rows + 1)]
    back = index.rows(slice(None))
    scale = grads.abs().amax(dim=1, keepdim=True) / 127
    assert torch.allclose(back, torch.round(grads / scale) * scale, atol=1e-6)


def test_narrow_rows_are_chunked_by_a_row_cap_not_only_by_bytes(tmp_path, monkeypatch):
    # 4 MiB of 32-byte int8 rows would be 131,072 rows waiting in memory per chunk (RESULTS §9).
    monkeypatch.setattr(layout, "CHUNK_BYTES", 4 * 2**20)
    assert layout.chunk_rows(32, "int8") == layout.CHUNK_MAX_ROWS == 16_384
    assert layout.chunk_rows(92_160, "int8") == 45  # a default-width SmolLM2 row: bytes decide
    writer = IndexWriter(tmp_path / "ix", 40_000, 32, "int8", META)
    assert writer.group["grads"].chunks[0] == 16_384
    writer.close()
