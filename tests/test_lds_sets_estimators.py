"""benchmarks/studies/lds_sets/estimators.py over other modules than the MLP (`--modules`): the
output head's and the attention's estimators against per-example weight gradients taken by
autograd one row at a time, K-FAC influence over the head against factors built from the softmax
by hand, and the factored inner product (the path for SmolLM2's vocab × vocab head) against the
rotated one."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.studies.lds_sets import estimators as est
from gradian_lightning import JsonlDataset
from tests.conftest import ROWS, make_model, make_tokenizer

SPEC = {"max_seq_length": 64}
# estimators.py takes the loss of a float64 model in float32 (`.float()` on the logits), so its
# gradients agree with float64 autograd to float32's precision; the rotations themselves to 1e-9.
LOSS = 1e-5
TRAIN = [r for r in ROWS if "prompt" in r] * 3  # 15 rows: two batches of estimators.batches
QUERIES = [{"prompt": "what is the capital ?", "completion": " rome is the city ."}, ROWS[1]]


@pytest.fixture(scope="module")
def setup():
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer), hidden=16, layers=2, seed=3).double()
    return model, tokenizer


def dense_grads(model, tokenizer, rows, names):
    """[rows, Σ weights]: each row's summed supervised-token loss gradient, by autograd, one row at a time."""
    params = [dict(model.named_modules())[n].weight for n in names]
    out = []
    for item in JsonlDataset(rows, tokenizer, SPEC["max_seq_length"]):
        ids, labels = torch.as_tensor(item.input_ids)[None], torch.as_tensor(item.labels)[None]
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        out.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(out)


def test_modules_select_the_mlp_by_default_and_put_the_head_last_and_alone(setup):
    model, _ = setup
    mlp = est.selected_modules(model)
    assert list(mlp) == [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in est.MLP
    ]
    everything = est.selected_modules(model, "all")
    assert set(everything) == {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    groups = est.module_groups(everything, group_layers=1)
    assert [list(g) for g in groups[-1:]] == [["lm_head"]] and len(groups) == 3
    assert all(".layers.0." in n for n in groups[0]) and all(".layers.1." in n for n in groups[1])


@pytest.mark.parametrize("choice", ["head", "attn", "mlp+head"])
def test_inner_product_and_norms_are_those_of_per_example_weight_gradients(setup, choice):
    model, tokenizer = setup
    names = list(est.selected_modules(model, choice))
    scores, norms, _ = est.scores_at(model, tokenizer, TRAIN, QUERIES, SPEC, 64, torch.float64, choice)
    train, queries = dense_grads(model, tokenizer, TRAIN, names), dense_grads(model, tokenizer, QUERIES, names)
    np.testing.assert_allclose(scores["inner"], (queries @ train.T).numpy(), rtol=LOSS, atol=LOSS)
    np.testing.assert_allclose(norms["inner"][0], queries.square().sum(1).numpy(), rtol=LOSS)
    np.testing.assert_allclose(norms["inner"][1], train.square().sum(1).numpy(), rtol=LOSS)


def test_head_kfac_influence_uses_factors_of_the_final_hidden_state_and_softmax_residual(setup):
    model, tokenizer = setup
    scores, _, _ = est.scores_at(model, tokenizer, TRAIN, QUERIES, SPEC, 64, torch.float64, "head")
    # By hand: h_t the final (normed) hidden state, δ_t = softmax − one-hot at supervised t.
    a, g, positions, examples, rows = 0, 0, 0, 0, {}
    for label, data in (("train", TRAIN), ("query", QUERIES)):
        rows[label] = []
        for item in JsonlDataset(data, tokenizer, SPEC["max_seq_length"]):
            ids, labels = torch.as_tensor(item.input_ids)[None], torch.as_tensor(item.labels)
            h = model.model(input_ids=ids).last_hidden_state[0].detach()
            supervised = torch.nonzero(labels[1:] != -100).flatten()
            delta = torch.softmax(h[supervised] @ model.lm_head.weight.detach().T, -1)
            delta[torch.arange(len(supervised)), labels[1:][supervised]] -= 1
            rows[label].append(delta.T @ h[supervised])  # [vocab, hidden]
            if label == "train":
                carried = h[: int(supervised.max()) + 1]  # positions at or before the last supervised one
                a, positions = a + carried.T @ carried, positions + len(carried)
                g, examples = g + delta.T @ delta, examples + 1
    lam_a, q_a = torch.linalg.eigh(a / positions)
    lam_g, q_g = torch.linalg.eigh(g / examples)
    e = torch.outer(lam_g.clamp_min(0), lam_a.clamp_min(0))
    w = 1 / (e + 0.1 * e.mean())
    rotate = lambda m: q_g.T @ m @ q_a  # noqa: E731
    expected = torch.tensor([[(rotate(q) * w * rotate(n)).sum() for n in rows["train"]] for q in rows["query"]])
    np.testing.assert_allclose(scores["kfac d=0.1"], expected.numpy(), rtol=LOSS)


def test_factored_inner_product_equals_the_rotated_one(setup, monkeypatch):
    model, tokenizer = setup
    rotated, rotated_norms, _ = est.scores_at(model, tokenizer, TRAIN, QUERIES, SPEC, 1, torch.float64, "mlp+head")
    monkeypatch.setattr(est, "KFAC_MAX_SIDE", 8)  # every module too large for factors: inner only
    factored, norms, _ = est.scores_at(model, tokenizer, TRAIN, QUERIES, SPEC, 1, torch.float64, "mlp+head")
    assert list(factored) == ["inner"]
    np.testing.assert_allclose(factored["inner"], rotated["inner"], rtol=1e-9, atol=1e-12)
    for side in (0, 1):
        np.testing.assert_allclose(norms["inner"][side], rotated_norms["inner"][side], rtol=1e-9)


def test_per_family_sums_each_parts_cosine_in_its_own_metric():
    rng = np.random.default_rng(0)
    g = {part: (rng.normal(size=(3, 40)), rng.normal(size=(7, 40))) for part in ("mlp", "head")}
    g["head"] = (100 * g["head"][0], 100 * g["head"][1])  # a part with larger gradients weighs the same
    parts = [({"inner": q @ n.T}, {"inner": ((q * q).sum(1), (n * n).sum(1))}, {"kfac": 1.0}) for q, n in g.values()]
    scores, norms, _ = est.per_family(parts)
    unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    expected = sum(unit(q) @ unit(n).T for q, n in g.values())
    np.testing.assert_allclose(scores["inner"], expected, rtol=1e-12)
    assert [a.tolist() for a in norms["inner"]] == [[1.0] * 3, [1.0] * 7]


def test_per_family_adds_a_part_without_factors_as_its_plain_cosine():
    rng = np.random.default_rng(1)
    q, n = rng.normal(size=(2, 5)), rng.normal(size=(4, 5))
    plain = ({"inner": q @ n.T}, {"inner": ((q * q).sum(1), (n * n).sum(1))}, {})
    both = (
        {"inner": q @ n.T, "kfac d=0.1": 2 * q @ n.T},
        plain[1] | {"kfac d=0.1": (4 * (q * q).sum(1), (n * n).sum(1))},
        {},
    )
    scores, _, _ = est.per_family([both, plain])
    cos = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (n / np.linalg.norm(n, axis=1, keepdims=True)).T
    np.testing.assert_allclose(scores["inner"], 2 * cos, rtol=1e-12)
    np.testing.assert_allclose(scores["kfac d=0.1"], 2 * cos, rtol=1e-12)  # 2qn / √(4q²n²) + the plain cosine


def test_results_of_several_modules_merge_by_set_with_bm25_once_and_the_mlps_reference():
    def entry(name, lds, case="base+ft"):
        return {"estimator": name, "case": case, "lds": lds}

    head_only = {"set": "b", "modules": "head", "entries": [entry("inner", 0.5), entry("BM25", 0.4, "words")]}
    results = [
        {"set": "a", "modules": "head", "entries": [entry("inner", 0.9), entry("BM25", 0.3, "words")]},
        {"set": "a", "entries": [entry("inner", 0.2), entry("BM25", 0.3, "words")]},  # before --modules: the MLP's
        head_only,
    ]
    merged = {r["set"]: r for r in est.merged_by_set(results)}
    names = [e["estimator"] for e in merged["a"]["entries"]]
    assert names == ["inner", "BM25", "head: inner"]
    assert est.best_reference(merged["a"])["lds"] == 0.2  # the head's 0.9 is no reference
    assert [e["estimator"] for e in merged["b"]["entries"]] == ["head: inner", "BM25"]
    assert not est.has_reference(merged["b"])


def test_a_smaller_kfac_max_side_scores_the_head_by_inner_product_alone(setup):
    model, tokenizer = setup  # the head's side (vocab 74) over 20: no factors
    factored, _, _ = est.scores_at(model, tokenizer, TRAIN, QUERIES, SPEC, 64, torch.float64, "head", max_side=20)
    rotated, _, _ = est.scores_at(model, tokenizer, TRAIN, QUERIES, SPEC, 64, torch.float64, "head")
    assert list(factored) == ["inner"] and "kfac d=0.1" in rotated
    np.testing.assert_allclose(factored["inner"], rotated["inner"], rtol=1e-9)


def test_a_diagonal_g_keeps_the_heads_output_side_in_the_vocabulary_basis(setup):
    model, tokenizer = setup
    scores, _, _ = est.scores_at(model, tokenizer, TRAIN, QUERIES, SPEC, 64, torch.float64, "head", diagonal_g_above=20)
    g_train = dense_grads(model, tokenizer, TRAIN, ["lm_head"]).view(len(TRAIN), *model.lm_head.weight.shape)
    g_query = dense_grads(model, tokenizer, QUERIES, ["lm_head"]).view(len(QUERIES), *model.lm_head.weight.shape)
    # G's diagonal is the mean over rows of Σ_t δ_t²; A as in the K-FAC test (final hidden states)
    a, positions, g_diag = 0, 0, 0
    for item in JsonlDataset(TRAIN, tokenizer, SPEC["max_seq_length"]):
        labels = torch.as_tensor(item.labels)
        h = model.model(input_ids=torch.as_tensor(item.input_ids)[None]).last_hidden_state[0].detach()
        supervised = torch.nonzero(labels[1:] != -100).flatten()
        delta = torch.softmax(h[supervised] @ model.lm_head.weight.detach().T, -1)
        delta[torch.arange(len(supervised)), labels[1:][supervised]] -= 1
        g_diag = g_diag + delta.square().sum(0)
        carried = h[: int(supervised.max()) + 1]
        a, positions = a + carried.T @ carried, positions + len(carried)
    lam_a, q_a = torch.linalg.eigh(a / positions)
    e = torch.outer(g_diag / len(TRAIN), lam_a.clamp_min(0))
    w = 1 / (e + 0.1 * e.mean())
    expected = torch.einsum("qoi,oi,noi->qn", g_query @ q_a, w, g_train @ q_a)
    np.testing.assert_allclose(scores["kfac d=0.1"], expected.numpy(), rtol=LOSS)


def test_a_head_too_wide_to_hold_is_scored_in_blocks_as_the_rotated_diagonal_g_head(setup):
    model, tokenizer = setup
    rotated, rotated_norms, _ = est.scores_at(
        model, tokenizer, TRAIN, QUERIES, SPEC, 64, torch.float64, "head", diagonal_g_above=20
    )
    blocks, norms, _ = est.scores_at(
        model, tokenizer, TRAIN, QUERIES, SPEC, 64, torch.float64, "head", max_side=20, diagonal_g_above=20
    )
    assert list(blocks) == list(rotated) == est.estimators()
    for name in rotated:
        np.testing.assert_allclose(blocks[name], rotated[name], rtol=1e-8, atol=1e-12, err_msg=name)
        for side in (0, 1):
            np.testing.assert_allclose(norms[name][side], rotated_norms[name][side], rtol=1e-8, err_msg=name)
