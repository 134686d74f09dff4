"""`score_all`: every query's score of every row, streamed by chunk, equal to a dense float64
computation of the stored rows, and the very scores `streaming_topk` ranks."""

import numpy as np
import pytest
import torch
from test_stored_norms import BLOCKS, D, N, reference_scores, rows_with_zeros, small_chunks, write  # noqa: F401

from gradian_lightning import QuerySpec, open_index
from gradian_lightning.query.scorer import checkpoint_scorers
from gradian_lightning.query.topk import score_all, streaming_topk


def dense(queries, stored, blocks, score, normalize):
    """The independent reference: numpy float64 on the decoded rows, whole-row or per-module cosine, or inner."""
    if score == "cosine" and normalize == "module":
        return reference_scores(queries, stored, blocks)
    q, r = queries.double().numpy(), stored.double().numpy()
    if score == "inner":
        return q @ r.T
    qn, rn = np.linalg.norm(q, axis=1, keepdims=True), np.linalg.norm(r, axis=1, keepdims=True)
    return (q / np.where(qn > 0, qn, 1)) @ (r / np.where(rn > 0, rn, 1)).T


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("score, normalize", [("cosine", "module"), ("cosine", "row"), ("inner", "module")])
def test_score_all_is_the_dense_score_of_the_stored_rows(tmp_path, kind, score, normalize):
    blocks = BLOCKS[kind]
    write(tmp_path / "ix", rows_with_zeros(), blocks).close()
    index = open_index(tmp_path / "ix")
    queries = torch.randn(3, D, generator=torch.Generator().manual_seed(2))
    spec = QuerySpec(score=score, normalize=normalize, precondition="none")
    got = score_all(checkpoint_scorers(index, queries, spec))
    assert got.shape == (3, N) and got.dtype == torch.float32
    keep = [i for i in range(N) if i != 11]
    assert torch.isnan(got[:, 11]).all() and torch.isfinite(got[:, keep]).all()  # row 11 is not finite: never ranked
    want = dense(queries, index.rows(slice(None)), blocks, score, normalize)
    np.testing.assert_allclose(got.numpy()[:, keep], want[:, keep], rtol=1e-5, atol=1e-5)
    # The Index's keyword form takes the QuerySpec's fields, as Index.topk does.
    same = index.score_all(queries, score=score, normalize=normalize, precondition="none")
    assert torch.equal(same.isnan(), got.isnan()) and torch.equal(same.nan_to_num(), got.nan_to_num())


def test_score_all_gives_the_scores_the_top_k_ranks_under_a_preconditioner(tmp_path):
    write(tmp_path / "ix", rows_with_zeros(), BLOCKS["equal"]).close()
    index = open_index(tmp_path / "ix")
    queries = torch.randn(4, D, generator=torch.Generator().manual_seed(3))
    for precondition in ("diag", "fisher"):
        spec = QuerySpec(top_k="all", precondition=precondition)
        every = score_all(checkpoint_scorers(index, queries, spec))
        top, _ = streaming_topk(checkpoint_scorers(index, queries, spec))
        torch.testing.assert_close(top.scores, every.gather(1, top.indices), rtol=0, atol=0)
        assert top.indices.shape[1] == int(torch.isfinite(every[0]).sum())
