"""Per-module row norms stored by the writer (layout.py `norms`): equal to the norms of the stored
rows, scored exactly like an index without them, kept consistent across a killed and resumed run."""

import numpy as np
import pytest
import torch
import zarr

from gradian_lightning import open_index
from gradian_lightning.index import layout
from gradian_lightning.index.layout import NORMS
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.query.scorer import Scorer
from gradian_lightning.specs import QuerySpec

N, D = 23, 8
META = {"fingerprint": "t", "global_step": 0}
BLOCKS = {"equal": [(0, 4), (4, 4)], "unequal": [(0, 3), (3, 5)], "none": None}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(layout, "CHUNK_BYTES", 5 * D * 2)  # 5 float16 rows per grads chunk: 23 rows end in a part chunk


def rows_with_zeros(seed=0):
    """[N, D] rows of varied norms; row 6 all zero, row 9 zero in its first module (of either layout), row 11 NaN (stored as zeros)."""
    g = torch.Generator().manual_seed(seed)
    grads = torch.randn(N, D, generator=g) * torch.rand(N, 1, generator=g) * 5
    grads[6] = 0.0
    grads[9, :4] = 0.0
    grads[11, 0] = float("nan")
    return grads


def write(path, grads, blocks, order=None, writer=None):
    meta = {
        **META,
        **(
            {"modules": [{"name": f"m{i}", "offset": o, "size": s} for i, (o, s) in enumerate(blocks)]}
            if blocks
            else {}
        ),
    }
    writer = writer or IndexWriter(path, N, D, "float16", meta)
    for i in range(N) if order is None else order:
        writer.write([i], grads[i : i + 1], torch.zeros(1), torch.tensor([3]), torch.tensor([0]), [str(i)])
    return writer


def reference_scores(queries, stored, blocks):
    """Mean over modules of the per-module cosines, dense float64; a zero block scores 0."""
    q, r = queries.double().numpy(), stored.double().numpy()
    cosines = []
    for lo, size in blocks or [(0, D)]:
        qb, rb = q[:, lo : lo + size], r[:, lo : lo + size]
        qn, rn = np.linalg.norm(qb, axis=1, keepdims=True), np.linalg.norm(rb, axis=1, keepdims=True)
        cosines.append((qb / np.where(qn > 0, qn, 1)) @ (rb / np.where(rn > 0, rn, 1)).T)
    return np.mean(cosines, axis=0)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_stored_norms_score_exactly_like_computed_ones_and_like_float64(tmp_path, kind):
    blocks = BLOCKS[kind]
    grads = rows_with_zeros()
    write(tmp_path / "ix", grads, blocks, order=list(range(N))[::-1]).close()
    index = open_index(tmp_path / "ix")
    stored = index.rows(slice(None))  # the float16-rounded rows every score is of
    want_norms = torch.from_numpy(
        np.stack([np.linalg.norm(stored.double().numpy()[:, o : o + s], axis=1) for o, s in blocks or [(0, D)]], axis=1)
    )
    norms = index.stored_norms(0, N)
    assert norms.shape == (N, len(blocks or [0])) and norms.dtype == torch.float32
    torch.testing.assert_close(norms.double(), want_norms, rtol=1e-6, atol=0)
    assert norms[6].abs().sum() == 0 and norms[11].abs().sum() == 0 and (norms[9, 0] == 0) == (blocks is not None)
    queries = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    queries[1] = 0.0  # a zero query scores 0 everywhere, not NaN
    top = index.topk(queries, N, bottom_k=N, precondition="none")
    bottom = top.opponents
    assert torch.isfinite(top.scores).all() and torch.isfinite(bottom.scores).all()
    assert top.indices.shape == (4, N - 1)  # row 11 (NaN) is never ranked
    want = reference_scores(queries, stored, blocks)
    np.testing.assert_allclose(
        top.scores.numpy(), np.take_along_axis(want, top.indices.numpy(), axis=1), rtol=1e-5, atol=1e-6
    )
    # Norms computed from the decoded chunk give the very bits the stored ones give.
    scorer = Scorer(index, QuerySpec(precondition="none")).prepare(queries)
    assert torch.equal(scorer.score(index.rows(slice(None)), 0, N), scorer.score(index.rows(slice(None))))


def test_preconditioned_scores_do_not_use_the_raw_rows_norms(tmp_path):
    # diag/fisher change each block's norm: the stored norms of the raw rows must not be used there.
    grads = rows_with_zeros()
    write(tmp_path / "ix", grads, BLOCKS["equal"]).close()
    index = open_index(tmp_path / "ix")
    queries = torch.randn(3, D, generator=torch.Generator().manual_seed(2))
    for precondition in ("diag", "fisher", "ekfac"):
        scorer = Scorer(index, QuerySpec(precondition=precondition, damping=0.5)).prepare(queries)
        # with lo, hi the scorer may read norms from the index; without, it computes those of the rows it compares
        assert torch.equal(scorer.score(index.rows(slice(None)), 0, N), scorer.score(index.rows(slice(None))))


def test_killed_run_resumes_with_norms_of_every_complete_row(tmp_path):
    blocks = BLOCKS["unequal"]
    grads = rows_with_zeros()
    first = write(tmp_path / "ix", grads, blocks, order=range(13))  # chunks 0, 1 flushed; rows 10-12 buffered
    del first  # killed: no close()
    group = zarr.open_group(str(tmp_path / "ix"), mode="r")
    assert np.flatnonzero(group["complete"][:]).tolist() == list(range(10))
    again = write(
        tmp_path / "ix",
        grads,
        blocks,
        writer=IndexWriter(
            tmp_path / "ix",
            N,
            D,
            "float16",
            {**META, "modules": [{"name": f"m{i}", "offset": o, "size": s} for i, (o, s) in enumerate(blocks)]},
        ),
    )
    assert again.kept_rows == 10 and again.close()
    index = open_index(tmp_path / "ix")
    assert torch.equal(index.stored_norms(0, N), layout.module_norms(index.rows(slice(None)), index.meta.blocks))


def test_a_crash_between_data_and_flags_leaves_no_complete_row_without_norms(tmp_path, monkeypatch):
    grads = rows_with_zeros()
    writer = write(tmp_path / "ix", grads, BLOCKS["equal"], order=range(5))  # chunk 0 flushed
    written = []
    real_set = IndexWriter._set

    def crash_on_flags(self, name, where, values):
        if name == "complete":
            raise KeyboardInterrupt  # killed after the data of chunk 1, before its flags
        written.append(name)
        real_set(self, name, where, values)

    monkeypatch.setattr(IndexWriter, "_set", crash_on_flags)
    with pytest.raises(KeyboardInterrupt):
        write(None, grads, None, order=range(5, 10), writer=writer)
    assert "grads" in written and NORMS in written
    group = zarr.open_group(str(tmp_path / "ix"), mode="r")
    assert np.flatnonzero(group["complete"][:]).tolist() == list(range(5))


@pytest.mark.parametrize("read_bytes", [1, 4 * 2**20])
def test_norms_and_flags_read_in_blocks_line_up_with_their_rows(tmp_path, monkeypatch, read_bytes):
    # More rows than one per-row chunk (4096): the reader's cached blocks must start where their rows do.
    from gradian_lightning.index import reader

    monkeypatch.setattr(reader, "METADATA_READ_BYTES", read_bytes)  # 1: one chunk per read; 4 MiB: all at once
    n = 9000
    grads = torch.randn(n, D, generator=torch.Generator().manual_seed(4))
    supervised = torch.ones(n, dtype=torch.int64)
    supervised[::7] = 0
    writer = IndexWriter(
        tmp_path / "ix",
        n,
        D,
        "float16",
        {**META, "modules": [{"name": "a", "offset": 0, "size": 4}, {"name": "b", "offset": 4, "size": 4}]},
        rows_per_chunk=1000,
    )
    writer.write(range(n), grads, torch.zeros(n), supervised, torch.zeros(n), [str(i) for i in range(n)])
    assert writer.close()
    index = open_index(tmp_path / "ix")
    want = layout.module_norms(index.rows(slice(None)), index.meta.blocks)
    for lo, hi in [(0, 1000), (4000, 5000), (8000, 9000), (3500, 4600)]:
        assert torch.equal(index.stored_norms(lo, hi), want[lo:hi])
        np.testing.assert_array_equal(index.rankable(lo, hi), supervised[lo:hi].numpy() > 0)
