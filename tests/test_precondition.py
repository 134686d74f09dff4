"""query.precondition: diag and fisher against a dense float64 computation; never NaN or inf."""

import pickle
import warnings

import numpy as np
import pytest
import torch
import zarr

from gradian_lightning import open_index
from gradian_lightning.errors import ConfigError
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.query.scorer import Scorer, resolved_spec
from gradian_lightning.specs import DEFAULT_DAMPING, QuerySpec

N, S = 40, 9  # rows; block size k² with k = 3
MODULES = [{"name": f"m{i}", "offset": i * S, "size": S} for i in range(3)]
D = S * len(MODULES)
META = {"fingerprint": "abc", "global_step": 0, "modules": MODULES}


def make_index(path, rows, supervised=None, overwrite=False):
    writer = IndexWriter(path, len(rows), D, "float32", META, overwrite=overwrite)
    supervised = torch.full((len(rows),), 2) if supervised is None else supervised
    writer.write(
        range(len(rows)),
        rows,
        torch.ones(len(rows)),
        supervised,
        torch.zeros(len(rows)),
        [str(i) for i in range(len(rows))],
    )
    writer.close()
    return open_index(path)


def random_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    # correlated coordinates with very different scales, so whitening changes the ranking
    mix = torch.randn(D, D, generator=g) * torch.logspace(-2, 1, D)
    return torch.randn(n, D, generator=g) @ mix


def all_scores(index, queries, **kw):
    top = index.topk(queries, k=len(index), **kw)
    out = torch.empty(len(queries), len(index))
    out.scatter_(1, top.indices, top.scores)
    return out.double().numpy()


def dense_metric(train, queries, how, damping):
    """Per module, in float64 and with no square root: q A⁻¹ rᵀ, and the whitened squared norms q A⁻¹ q, r A⁻¹ r."""
    t, q = train.double().numpy(), queries.double().numpy()
    out = []
    for b in MODULES:
        tb, qb = t[:, b["offset"] : b["offset"] + S], q[:, b["offset"] : b["offset"] + S]
        if how == "fisher":
            f = tb.T @ tb / len(tb)
            a = f + damping * np.trace(f) / S * np.eye(S)  # trace / S: the mean eigenvalue
        else:
            m = (tb**2).mean(0)
            a = np.diag(m + damping * m.mean())
        cross = qb @ np.linalg.solve(a, tb.T)
        qq = np.einsum("qi,iq->q", qb, np.linalg.solve(a, qb.T))
        tt = np.einsum("ni,in->n", tb, np.linalg.solve(a, tb.T))
        out.append((cross, qq, tt))
    return out


@pytest.mark.parametrize("how", ["fisher", "diag"])
def test_precondition_equals_dense_float64(tmp_path, how):
    train, queries = random_rows(N, 0), random_rows(5, 1)
    index = make_index(tmp_path / "ix", train)
    metric = dense_metric(train, queries, how, 0.1)
    inner = sum(cross for cross, _, _ in metric)
    np.testing.assert_allclose(
        all_scores(index, queries, score="inner", precondition=how, damping=0.1),
        inner,
        rtol=2e-4,
        atol=1e-4 * np.abs(inner).max(),
    )
    modcos = sum(cross / np.sqrt(qq[:, None] * tt[None, :]) for cross, qq, tt in metric) / len(MODULES)
    np.testing.assert_allclose(
        all_scores(index, queries, normalize="module", precondition=how, damping=0.1), modcos, atol=2e-5
    )
    # and it is not the identity: preconditioning changes these scores
    assert np.abs(all_scores(index, queries, precondition="none") - modcos).max() > 0.05


def fisher_inner_reference(train, queries, damping):
    """numpy float64: Σ over modules of q_m (F_m + damping·tr(F_m)/S·I)⁻¹ t_mᵀ, F_m the mean second moment."""
    t, q = train.double().numpy(), queries.double().numpy()
    expected = 0
    for b in MODULES:
        tb, qb = t[:, b["offset"] : b["offset"] + S], q[:, b["offset"] : b["offset"] + S]
        f = tb.T @ tb / N
        expected = expected + qb @ np.linalg.solve(f + damping * np.trace(f) / S * np.eye(S), tb.T)
    return expected


def test_fisher_inner_is_the_damped_inverse_second_moment(tmp_path):
    train, queries = random_rows(N, 2), random_rows(3, 3)
    index = make_index(tmp_path / "ix", train)
    expected = fisher_inner_reference(train, queries, 0.5)
    got = all_scores(index, queries, score="inner", precondition="fisher", damping=0.5)
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("how", ["none", "diag", "fisher"])
@pytest.mark.parametrize("score", ["cosine", "inner"])
def test_rows_of_zeros_never_give_nan(tmp_path, how, score):
    zeros = torch.zeros(6, D)
    index = make_index(tmp_path / "ix", zeros)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank-deficiency is warned about; here only the numbers matter
        got = all_scores(index, torch.zeros(2, D), score=score, precondition=how)
    assert np.isfinite(got).all() and (got == 0).all()
    # some zero rows among real ones, a zero query, damping 0 and fewer rows than k² (rank-deficient)
    rows = random_rows(4, 4)
    rows[1] = 0
    index = make_index(tmp_path / "iy", rows)
    queries = torch.cat([torch.zeros(1, D), random_rows(2, 5)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = all_scores(index, queries, score=score, precondition=how, damping=0.0)
    assert np.isfinite(got).all()


def test_damping_zero_and_rank_deficient_warn(tmp_path):
    index = make_index(tmp_path / "ix", random_rows(4, 6))  # 4 rows < k² = 9
    with pytest.warns(UserWarning, match="rank-deficient"):
        index.topk(random_rows(1, 7), k=2, precondition="fisher")
    with pytest.warns(UserWarning, match="damping=0"):
        index.topk(random_rows(1, 7), k=2, precondition="diag", damping=0.0)
    with pytest.raises(ConfigError, match="query.precondition"):
        index.topk(random_rows(1, 7), k=2, precondition="adam")
    with pytest.raises(ConfigError, match="query.damping"):
        index.topk(random_rows(1, 7), k=2, precondition="fisher", damping=-1.0)


def test_auto_is_fisher_where_the_index_keeps_second_moments_and_diag_elsewhere(tmp_path, monkeypatch):
    """The default, query.precondition=auto: fisher for blocks of k² <= GRAM_MAX_SIZE, diag beyond (k = 64, exact rows)."""
    import gradian_lightning.index.statistics as statistics
    from gradian_lightning.config import QueryConfig
    from gradian_lightning.query.precondition import auto_preconditioner

    assert QueryConfig().precondition == "auto"
    train, queries = random_rows(N, 0), random_rows(5, 1)
    kept = make_index(tmp_path / "kept", train)
    assert N >= 4 * S and auto_preconditioner(kept) == "fisher"
    np.testing.assert_array_equal(
        all_scores(kept, queries, precondition="auto", damping=1.0),
        all_scores(kept, queries, precondition="fisher", damping=1.0),
    )
    monkeypatch.setattr(statistics, "GRAM_MAX_SIZE", S - 1)  # as k = 64 is to the real limit: no second moments kept
    wide = make_index(tmp_path / "wide", train)
    assert auto_preconditioner(wide) == "diag"
    np.testing.assert_array_equal(
        all_scores(wide, queries, precondition="auto", damping=1.0),
        all_scores(wide, queries, precondition="diag", damping=1.0),
    )
    with pytest.raises(ConfigError, match="query.precondition=diag"):
        all_scores(wide, queries, precondition="fisher")


def test_auto_leaves_fisher_to_indexes_with_at_least_as_many_rows_as_its_dimensions(tmp_path):
    """Below FISHER_ROWS_PER_DIMENSION × k² counted rows F is mostly damping: auto scores as
    AUTO_FEW_ROWS does, with per-module cosine; from that many, as fisher does, with a whole-row cosine."""
    from gradian_lightning.query.precondition import AUTO_FEW_ROWS, FISHER_ROWS_PER_DIMENSION, auto_preconditioner

    assert FISHER_ROWS_PER_DIMENSION == 1 and AUTO_FEW_ROWS != "fisher"
    queries = random_rows(5, 1)
    for rows, used, normalize in ((S - 1, AUTO_FEW_ROWS, "module"), (S, "fisher", "row")):
        index = make_index(tmp_path / f"rows{rows}", random_rows(rows, 0))
        assert auto_preconditioner(index) == used
        # query.score=auto is cosine on the index path
        assert resolved_spec(index, QuerySpec()) == QuerySpec(precondition=used, normalize=normalize, score="cosine")
        np.testing.assert_array_equal(
            all_scores(index, queries, damping=1.0),
            all_scores(index, queries, precondition=used, normalize=normalize, damping=1.0),
        )
    # An explicit normalize is kept whatever the preconditioner.
    assert resolved_spec(index, QuerySpec(normalize="module")).normalize == "module"
    assert resolved_spec(index, QuerySpec(precondition="diag")).normalize == "module"


@pytest.mark.parametrize("score,normalize", [("cosine", "module"), ("cosine", "row"), ("inner", "module")])
def test_fisher_at_the_stored_damping_needs_no_whitening_of_the_rows(tmp_path, score, normalize):
    """At the default damping the writer stores each row's whitened per-module norms, and fisher
    whitens only the queries (twice): the dense float64 metric's scores, and the same scores as
    whitening every chunk (what an index whose close was killed before the norms were recorded gets)."""
    train, queries = random_rows(N, 0), random_rows(5, 1)
    index = make_index(tmp_path / "ix", train)
    assert (
        index.whitened_damping == DEFAULT_DAMPING
        and Scorer(index, QuerySpec(score=score, precondition="fisher")).shortcut
    )
    metric = dense_metric(train, queries, "fisher", DEFAULT_DAMPING)
    np.testing.assert_allclose(
        index.whitened_norms(0, N).numpy(), np.sqrt(np.stack([tt for _, _, tt in metric], axis=1)), rtol=1e-5
    )
    fast = all_scores(index, queries, score=score, normalize=normalize, precondition="fisher", damping=DEFAULT_DAMPING)
    # A scorer sent to a Dask worker has no reader, so no stored norms: it whitens rows for their norms.
    spec = QuerySpec(score=score, normalize=normalize, precondition="fisher")
    scorer = Scorer(index, spec).prepare(torch.as_tensor(queries, dtype=torch.float32))
    worker, rows = pickle.loads(pickle.dumps(scorer)), index.rows(slice(None))
    assert worker.index is None and worker.shortcut
    torch.testing.assert_close(worker.score(rows.clone()), scorer.score(rows.clone(), 0, N), rtol=1e-4, atol=1e-6)
    cross = sum(c for c, _, _ in metric)
    if score == "inner":
        want = cross
    elif normalize == "module":
        want = sum(c / np.sqrt(qq[:, None] * tt[None, :]) for c, qq, tt in metric) / len(MODULES)
    else:
        want = cross / np.sqrt(sum(qq for _, qq, _ in metric)[:, None] * sum(tt for _, _, tt in metric)[None, :])
    np.testing.assert_allclose(fast, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    if score == "cosine":
        del zarr.open_group(str(tmp_path / "ix"), mode="r+")["statistics"].attrs["whitened_damping"]
        slow = open_index(tmp_path / "ix")
        assert (
            slow.whitened_damping is None and not Scorer(slow, QuerySpec(score=score, precondition="fisher")).shortcut
        )
        np.testing.assert_allclose(
            all_scores(slow, queries, score=score, normalize=normalize, precondition="fisher", damping=DEFAULT_DAMPING),
            fast,
            atol=2e-6,
        )
    # another damping whitens every chunk: the stored norms are for the default only
    assert not Scorer(index, QuerySpec(precondition="fisher", damping=0.5)).shortcut


def test_whitened_norms_are_stored_once_every_row_is_written_and_survive_a_resume(tmp_path):
    train = random_rows(N, 8)
    writer = IndexWriter(tmp_path / "ix", N, D, "float32", META, rows_per_chunk=8)
    writer.write(
        range(20), train[:20], torch.ones(20), torch.full((20,), 2), torch.zeros(20), [str(i) for i in range(20)]
    )
    assert not writer.close()  # half written: statistics of 20 rows, no whitened norms yet
    assert open_index(tmp_path / "ix").whitened_damping is None
    writer = IndexWriter(tmp_path / "ix", N, D, "float32", META, rows_per_chunk=8)
    assert writer.kept_rows == 20
    writer.write(range(N), train, torch.ones(N), torch.full((N,), 2), torch.zeros(N), [str(i) for i in range(N)])
    assert writer.close()
    resumed, once = open_index(tmp_path / "ix"), make_index(tmp_path / "once", train)
    assert resumed.whitened_damping == DEFAULT_DAMPING
    torch.testing.assert_close(resumed.whitened_norms(0, N), once.whitened_norms(0, N), rtol=1e-6, atol=0)


def test_fisher_without_stored_statistics_still_equals_dense_float64(tmp_path):
    """An index with no stored statistics (its writer never closed) is whitened from second moments
    the reader sums from its rows at query time: the dense float64 metric's scores all the same."""
    train, queries = random_rows(N, 0), random_rows(5, 1)
    make_index(tmp_path / "ix", train)
    del zarr.open_group(str(tmp_path / "ix"), mode="r+")["statistics"]
    index = open_index(tmp_path / "ix")
    metric = dense_metric(train, queries, "fisher", 0.1)
    modcos = sum(cross / np.sqrt(qq[:, None] * tt[None, :]) for cross, qq, tt in metric) / len(MODULES)
    np.testing.assert_allclose(
        all_scores(index, queries, precondition="fisher", normalize="module", damping=0.1), modcos, atol=2e-5
    )
    inner = sum(cross for cross, _, _ in metric)  # not scale-free, unlike cosine: F must be the mean, not the sum
    np.testing.assert_allclose(
        all_scores(index, queries, score="inner", precondition="fisher", damping=0.1),
        inner,
        rtol=2e-4,
        atol=1e-4 * np.abs(inner).max(),
    )


def test_ekfac_is_fisher_on_a_kronecker_second_moment_and_keeps_the_rows_variances_otherwise():
    from gradian_lightning.index.statistics import basis_factor, kronecker_whitening_basis, whitening_basis

    def whitening_factor(w, v, damping):  # (F + λI)^-½ multiplied out
        return basis_factor(*whitening_basis(w, v, damping))

    def kronecker_whitening_factor(w, v, damping):
        return basis_factor(*kronecker_whitening_basis(w, v, damping))

    rng = np.random.default_rng(0)
    k = 4
    a, b = rng.normal(size=(k, k)), rng.normal(size=(k, k))
    kron = np.kron(a @ a.T + 0.1 * np.eye(k), b @ b.T + 0.1 * np.eye(k))  # S_out ⊗ A_in: EK-FAC is exact
    w, v = np.linalg.eigh(kron)
    np.testing.assert_allclose(kronecker_whitening_factor(w, v, 0.5), whitening_factor(w, v, 0.5), rtol=1e-4, atol=1e-5)
    # Any F from rows: the factor is Q diag((λ + damping·mean)^-½) Qᵀ, Q the Kronecker product of the
    # eigenvectors of the row blocks' k×k second moments, λ the rows' mean square along each column of Q.
    rows = rng.normal(size=(7, k, k)) * rng.uniform(0.1, 3, size=(1, k, k))
    flat = rows.reshape(7, -1)
    w, v = np.linalg.eigh(flat.T @ flat / 7)
    _, q_out = np.linalg.eigh(np.einsum("nab,ncb->ac", rows, rows))
    _, q_in = np.linalg.eigh(np.einsum("nab,nac->bc", rows, rows))
    q = np.kron(q_out, q_in)
    variances = ((flat @ q) ** 2).mean(0)
    want = q @ np.diag((variances + 0.5 * variances.mean()) ** -0.5) @ q.T
    np.testing.assert_allclose(kronecker_whitening_factor(w, v, 0.5), want, rtol=1e-4, atol=1e-5)


def test_fisher_factors_are_made_once_per_index_state_and_never_stale(tmp_path, monkeypatch):
    from gradian_lightning.query import precondition

    made = []  # one entry a module whose whitening is made
    real = precondition.whitening_basis
    monkeypatch.setattr(precondition, "whitening_basis", lambda *a, **k: made.append(1) or real(*a, **k))
    monkeypatch.setattr(precondition, "FACTORS", type(precondition.FACTORS)())
    train, queries = random_rows(N, 4), random_rows(3, 5)
    index = make_index(tmp_path / "ix", train)
    first = all_scores(index, queries, score="inner", precondition="fisher", damping=0.5)
    again = all_scores(open_index(tmp_path / "ix"), queries, score="inner", precondition="fisher", damping=0.5)
    assert len(made) == 3 and np.array_equal(first, again)  # the next batch of queries reuses them
    all_scores(index, queries, score="inner", precondition="fisher", damping=0.25)
    assert len(made) == 6  # another damping: other factors
    # The same path rewritten with other rows: new statistics, so new factors, equal to the dense
    # computation for those rows (the first index's factors would not be).
    other = random_rows(N, 6)
    index = make_index(tmp_path / "ix", other, overwrite=True)
    got = all_scores(index, queries, score="inner", precondition="fisher", damping=0.5)
    assert len(made) == 9
    expected = fisher_inner_reference(other, queries, 0.5)
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("how", ["fisher", "ekfac"])
@pytest.mark.parametrize("rows", [N, 5])  # 5 < k² = 9: F rank-deficient, the c·I term carries the rest
def test_queries_are_whitened_through_the_bases_as_rows_through_the_factors(tmp_path, monkeypatch, how, rows):
    from gradian_lightning.query import precondition
    from gradian_lightning.query.precondition import build_preconditioner

    monkeypatch.setattr(precondition, "FACTORS", type(precondition.FACTORS)())  # none kept from other tests
    index = make_index(tmp_path / "ix", random_rows(rows, 7))
    queries = random_rows(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank-deficient F warns: known here
        made = build_preconditioner(index.reader, how, DEFAULT_DAMPING)
        through_bases = made.queries(queries)
        assert made._factors is None  # queries alone never multiply the factors out
        if how == "fisher":  # the scan at the stored damping whitens only queries (the shortcut)
            index.topk(queries, k=3, precondition=how, damping=DEFAULT_DAMPING)
            assert build_preconditioner(index.reader, how, DEFAULT_DAMPING) is made and made._factors is None
        through_factors = made(queries)
    assert made._factors is not None
    sent = build_preconditioner(index.reader, how, 0.3)  # as a Dask worker gets it: factors made, not remade
    assert sent._factors is None and pickle.loads(pickle.dumps(sent))._factors is not None
    scale = float(through_factors.abs().max())
    torch.testing.assert_close(through_bases, through_factors, rtol=1e-5, atol=1e-6 * scale)
