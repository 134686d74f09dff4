"""The exact pass (query/exact.py) against a dense per-example computation on a float64 tiny Llama:
per-example weight gradients from autograd, flattened per module, the K-FAC curvature built as
the Kronecker product G ⊗ A and EK-FAC's as (Q_G ⊗ Q_A) diag(Λ) (Q_G ⊗ Q_A)ᵀ, scores
g_qᵀ (H + λ I)⁻¹ g_n by a dense solve, summed over modules."""

import pytest
import torch
from conftest import ROWS
from test_factors import KEYS, SPEC, batches, per_example_gradients, tiny

from gradian_lightning import GradianError, IndexSpec, JsonlDataset, collate
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.factors import FactorFit, fit_factors
from gradian_lightning.query.exact import ExactPass

QUERIES = [
    {"prompt": "what city is blue ?", "completion": " rome is blue"},
    {"prompt": "tell me the color .", "completion": " red"},
]


def query_batch(tokenizer):
    return {k: v for k, v in collate(JsonlDataset(QUERIES, tokenizer, 64).examples).items() if k in KEYS}


def dense_curvature(factors, name, ekfac):
    """H [out·in, out·in] of one module, row-major vec of the [out, in] gradient, and its damping λ."""
    q_a, lam_a, q_g, lam_g = factors.bases[name]
    if ekfac:
        q = torch.kron(q_g, q_a)
        h = q @ torch.diag(factors.eigenvalues[name].flatten()) @ q.T
    else:
        a = q_a @ torch.diag(lam_a) @ q_a.T
        g = q_g @ torch.diag(lam_g) @ q_g.T
        h = torch.kron(g, a)
    return h, torch.linalg.eigvalsh(h).mean()


def dense_scores(model, tokenizer, factors, damping, ekfac):
    modules = select_modules(model, SPEC.module_filter)
    queries = per_example_gradients(model, query_batch(tokenizer), modules)
    train = [per_example_gradients(model, b, modules) for b in batches(tokenizer)]
    total = 0
    for name in modules:
        gq = queries[name].flatten(1)  # [Q, out·in]
        gn = torch.cat([t[name] for t in train]).flatten(1)  # [N, out·in]
        if factors is None:
            total = total + gq @ gn.T
            continue
        h, mean = dense_curvature(factors, name, ekfac)
        solved = torch.linalg.solve(h + damping * mean * torch.eye(h.shape[0], dtype=h.dtype), gq.T)
        total = total + solved.T @ gn.T
    return total


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("order", ["tokens", "examples"])
def test_factored_influence_equals_the_dense_solve(tokenizer, ekfac, order):
    model = tiny(tokenizer)
    factors = fit_factors(model, SPEC, batches(tokenizer), ekfac=ekfac, dtype=torch.float64)
    expected = dense_scores(model, tokenizer, factors, 0.1, ekfac)
    exact = ExactPass(model, SPEC, query_batch(tokenizer), factors, damping=0.1, order=order, dtype=torch.float64)
    scores = exact.score_all(batches(tokenizer), len(ROWS))
    assert scores.shape == (len(QUERIES), len(ROWS))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # The damping matters at this size: without it the scores would differ (the check can fail).
    loose = dense_scores(model, tokenizer, factors, 1.0, ekfac)
    assert not torch.allclose(loose, expected, rtol=1e-3)


def test_inner_product_and_whole_row_cosine_equal_the_dense_ones(tokenizer):
    model = tiny(tokenizer)
    modules = select_modules(model, SPEC.module_filter)
    inner = dense_scores(model, tokenizer, None, 0, False)
    queries = per_example_gradients(model, query_batch(tokenizer), modules)
    train = [per_example_gradients(model, b, modules) for b in batches(tokenizer)]
    qn = torch.cat([queries[n].flatten(1) for n in modules], 1).norm(dim=1)
    tn = torch.cat([torch.cat([t[n] for t in train]).flatten(1) for n in modules], 1).norm(dim=1)
    for order in ("tokens", "examples"):
        plain = ExactPass(model, SPEC, query_batch(tokenizer), order=order, dtype=torch.float64)
        torch.testing.assert_close(plain.score_all(batches(tokenizer), len(ROWS)), inner, rtol=1e-7, atol=1e-10)
        cosine = ExactPass(model, SPEC, query_batch(tokenizer), cosine=True, order=order, dtype=torch.float64)
        expected = inner / (qn[:, None] * tn[None, :])
        torch.testing.assert_close(cosine.score_all(batches(tokenizer), len(ROWS)), expected, rtol=1e-7, atol=1e-10)
    assert plain.nbytes_per_query() == 8 * sum(m.weight.numel() for m in modules.values())


def test_exact_pass_leaves_grad_modes_and_rng_alone(tokenizer):
    model = tiny(tokenizer).train()
    modes = [m.training for m in model.modules()]
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    ExactPass(model, SPEC, query_batch(tokenizer), cosine=True, dtype=torch.float64).score(batches(tokenizer)[0])
    assert [m.training for m in model.modules()] == modes and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())


def test_arguments_without_a_meaning_are_refused(tokenizer):
    model = tiny(tokenizer)
    factors = fit_factors(model, SPEC, batches(tokenizer)[:1], ekfac=False, dtype=torch.float64)
    with pytest.raises(GradianError, match=r"ExactPass\(order='rows'\) is not a contraction order"):
        ExactPass(model, SPEC, query_batch(tokenizer), order="rows")
    for factors_given, horizon in ((None, 1.0), (factors, -1.0)):
        with pytest.raises(GradianError, match="unrolls over a training time >= 0"):
            ExactPass(model, SPEC, query_batch(tokenizer), factors_given, horizon=horizon)
    fit = FactorFit(model, SPEC, dtype=torch.float64)
    other = FactorFit(model, IndexSpec(module_filter=["down_proj"], projection_dim=None), dtype=torch.float64)
    with pytest.raises(GradianError, match="cannot be added"):
        fit.covariances(batches(tokenizer)[0]) + other.covariances(batches(tokenizer)[0])
    with pytest.raises(GradianError, match="no batch to fit factors on"):
        fit_factors(model, SPEC, [])


def test_a_head_run_on_the_supervised_positions_only_is_scored_exactly(tokenizer):
    """Under `logits_to_keep` the output head sees [n, in] gathered positions, not [B, T, in]."""
    model = tiny(tokenizer)
    spec = IndexSpec(module_filter=["lm_head", "layers.1.mlp.down_proj"], projection_dim=None)
    modules = select_modules(model, spec.module_filter)
    factors = fit_factors(model, spec, batches(tokenizer), ekfac=True, dtype=torch.float64)
    queries = per_example_gradients(model, query_batch(tokenizer), modules)
    train = [per_example_gradients(model, b, modules) for b in batches(tokenizer)]
    expected = 0
    for name in modules:
        h, mean = dense_curvature(factors, name, ekfac=True)
        solved = torch.linalg.solve(h + 0.1 * mean * torch.eye(h.shape[0], dtype=h.dtype), queries[name].flatten(1).T)
        expected = expected + solved.T @ torch.cat([t[name] for t in train]).flatten(1).T
    exact = ExactPass(model, spec, query_batch(tokenizer), factors, damping=0.1, dtype=torch.float64)
    scores = exact.score_all(batches(tokenizer), len(ROWS))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def dense_unrolled(model, tokenizer, factors, horizon, ekfac):
    """Σ_modules g_qᵀ f(H) g_n with f(w) = Ē (1 − e^(−h w / Ē)) / w by a dense eigendecomposition of
    each module's H, Ē the mean eigenvalue over every module's H together."""
    modules = select_modules(model, SPEC.module_filter)
    queries = per_example_gradients(model, query_batch(tokenizer), modules)
    train = [per_example_gradients(model, b, modules) for b in batches(tokenizer)]
    decomposed = {name: torch.linalg.eigh(dense_curvature(factors, name, ekfac)[0]) for name in modules}
    mean = torch.cat([w for w, _ in decomposed.values()]).mean()
    total = 0
    for name in modules:
        w, v = decomposed[name]
        w = w.clamp_min(0)
        f = torch.where(w > 0, mean * -torch.expm1(-horizon * w / mean) / w.clamp_min(1e-300), horizon)
        gq, gn = queries[name].flatten(1), torch.cat([t[name] for t in train]).flatten(1)
        total = total + (gq @ v * f) @ (gn @ v).T
    return total


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
def test_unrolled_scores_equal_the_dense_matrix_function(tokenizer, ekfac):
    model = tiny(tokenizer)
    factors = fit_factors(model, SPEC, batches(tokenizer), ekfac=ekfac, dtype=torch.float64)
    for horizon in (0.3, 30.0):
        expected = dense_unrolled(model, tokenizer, factors, horizon, ekfac)
        exact = ExactPass(model, SPEC, query_batch(tokenizer), factors, horizon=horizon, dtype=torch.float64)
        scores = exact.score_all(batches(tokenizer), len(ROWS))
        torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_unrolling_spans_the_inner_product_and_the_influence_function(tokenizer):
    """A short horizon h gives h × the inner product (TracIn); a long one Ē × the undamped influence."""
    model = tiny(tokenizer)
    factors = fit_factors(model, SPEC, batches(tokenizer), ekfac=True, dtype=torch.float64)

    def scores(**kwargs):
        exact = ExactPass(model, SPEC, query_batch(tokenizer), dtype=torch.float64, **kwargs)
        return exact.score_all(batches(tokenizer), len(ROWS))

    inner = scores()
    torch.testing.assert_close(
        scores(factors=factors, horizon=1e-9) / 1e-9, inner, rtol=1e-6, atol=1e-6 * inner.abs().max().item()
    )
    influence = scores(factors=factors, damping=0.0) * factors.mean_eigenvalue()
    long = scores(factors=factors, horizon=1e4)
    assert torch.corrcoef(torch.stack([long.flatten(), influence.flatten()]))[0, 1] > 0.99


@pytest.mark.parametrize("horizon", [None, 3.0], ids=["influence", "unrolled"])
def test_cosine_with_factors_is_the_cosine_in_the_preconditioners_metric(tokenizer, horizon):
    """⟨g_q, f(H) g_n⟩ / sqrt(⟨g_q, f(H) g_q⟩ ⟨g_n, f(H) g_n⟩), f(H) a dense matrix function of H."""
    model = tiny(tokenizer)
    factors = fit_factors(model, SPEC, batches(tokenizer), ekfac=True, dtype=torch.float64)
    modules = select_modules(model, SPEC.module_filter)
    queries = per_example_gradients(model, query_batch(tokenizer), modules)
    train = [per_example_gradients(model, b, modules) for b in batches(tokenizer)]
    decomposed = {name: torch.linalg.eigh(dense_curvature(factors, name, True)[0]) for name in modules}
    mean = torch.cat([w for w, _ in decomposed.values()]).mean()
    inner, q_norm, n_norm = 0, 0, 0
    for name in modules:
        w, v = decomposed[name]
        if horizon is None:
            f = 1 / (w + 0.1 * w.mean())
        else:
            w = w.clamp_min(0)
            f = torch.where(w > 0, mean * -torch.expm1(-horizon * w / mean) / w.clamp_min(1e-300), horizon)
        gq = queries[name].flatten(1) @ v
        gn = torch.cat([t[name] for t in train]).flatten(1) @ v
        inner = inner + (gq * f) @ gn.T
        q_norm, n_norm = q_norm + (gq.square() * f).sum(1), n_norm + (gn.square() * f).sum(1)
    expected = inner / (q_norm[:, None] * n_norm[None, :]).sqrt()
    exact = ExactPass(
        model, SPEC, query_batch(tokenizer), factors, 0.1, cosine=True, horizon=horizon, dtype=torch.float64
    )
    scores = exact.score_all(batches(tokenizer), len(ROWS))
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-9)
    assert scores.abs().max() <= 1 + 1e-9


def dense_part_cosines(model, tokenizer, factors, parts, horizon):
    """mean over parts of ⟨g_q, f_p(H) g_n⟩ / (‖g_q‖_f ‖g_n‖_f) over each part's modules, f_p the unrolling of
    horizon h with Ē_p the mean eigenvalue of that part's dense H alone: a K-FAC H = G ⊗ A with G
    the diagonal factor's diag(λ_G) for the head (its basis the identity)."""
    modules = {n: m for n, m in model.named_modules() if any(n in p for p in parts)}
    queries = per_example_gradients(model, query_batch(tokenizer), modules)
    train = [per_example_gradients(model, b, modules) for b in batches(tokenizer)]
    total = 0
    for part in parts:
        decomposed = {}
        for name in part:
            q_a, lam_a, q_g, lam_g = factors.bases[name]
            g = torch.diag(lam_g) if q_g.numel() == 0 else q_g @ torch.diag(lam_g) @ q_g.T
            decomposed[name] = torch.linalg.eigh(torch.kron(g, q_a @ torch.diag(lam_a) @ q_a.T))
        mean = torch.cat([w.clamp_min(0) for w, _ in decomposed.values()]).mean()
        score, q_norm, n_norm = 0, 0, 0
        for name in part:
            w, v = decomposed[name]
            w = w.clamp_min(0)
            f = torch.where(w > 0, mean * -torch.expm1(-horizon * w / mean) / w.clamp_min(1e-300), horizon)
            gq, gn = queries[name].flatten(1) @ v, torch.cat([t[name] for t in train]).flatten(1) @ v
            score = score + (gq * f) @ gn.T
            q_norm, n_norm = q_norm + (gq.square() * f).sum(1), n_norm + (gn.square() * f).sum(1)
        total = total + score / torch.outer(q_norm.sqrt(), n_norm.sqrt())
    return total / len(parts)


@pytest.mark.parametrize("order", ["tokens", "examples"])
def test_the_head_as_a_second_part_equals_the_dense_per_part_cosines(tokenizer, order):
    """query.precondition=auto's estimator: the layers and the output head (G diagonal) each a
    cosine in its own unrolled K-FAC metric, averaged; against dense Kronecker products."""
    model = tiny(tokenizer)
    layers = list(select_modules(model, SPEC.module_filter))
    modules = {**select_modules(model, SPEC.module_filter), "lm_head": model.lm_head}
    parts = [layers, ["lm_head"]]
    factors = fit_factors(
        model, SPEC, batches(tokenizer), ekfac=False, modules=modules, dtype=torch.float64, diagonal_g={"lm_head"}
    )

    def scores(parts):
        exact = ExactPass(
            model, SPEC, query_batch(tokenizer), factors, horizon=30.0, cosine=True, order=order,
            modules=modules, parts=parts, dtype=torch.float64,
        )  # fmt: skip
        return exact.score_all(batches(tokenizer), len(ROWS))

    got = scores(parts)
    torch.testing.assert_close(got, dense_part_cosines(model, tokenizer, factors, parts, 30.0), rtol=1e-6, atol=1e-6)
    assert got.abs().max() <= 1 + 1e-9  # the mean of two cosines
    # One part of every module is the whole-row cosine, with Ē over every module.
    whole = dense_part_cosines(model, tokenizer, factors, [layers + ["lm_head"]], 30.0)
    torch.testing.assert_close(scores(None), whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(GradianError, match="into parts"):
        ExactPass(model, SPEC, query_batch(tokenizer), factors, horizon=30.0, modules=modules, parts=[layers])
