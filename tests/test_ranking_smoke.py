"""benchmarks/ranking_quality.py's core path on a tiny model: rows, scores, ranks, metrics."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer
from gradian_lightning.specs import IndexSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ranking_quality as rq  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    train = read_jsonl(rq.DATA / "format.train.jsonl")[:10]
    queries = [q for q in read_jsonl(rq.DATA / "format.queries.jsonl")][:3]
    ids = {r["id"] for r in train}
    train += [
        r
        for r in read_jsonl(rq.DATA / "format.train.jsonl")
        if r["id"] in {s for q in queries for s in q["sources"]} and r["id"] not in ids
    ]
    import json

    tokenizer = word_tokenizer(
        [json.dumps(r) for r in train + queries] + [rq.TINY_CHAT_TEMPLATE], chat_template=rq.TINY_CHAT_TEMPLATE
    )
    model = tiny_llama(len(tokenizer), hidden=32, seed=0).eval()
    return model, tokenizer, train, queries


def test_one_backward_serves_every_filter(setup):
    """A filter's columns of the all-Linear row equal the library's rows for that filter alone."""
    model, tokenizer, train, queries = setup
    modules, projs = rq.projectors(model, [8, None], [0])
    rows = rq.gradient_rows(model, tokenizer, queries, projs, modules, batch_size=2)
    for dim in (8, None):
        chosen = select_modules(model, ["mlp.down_proj", "o_proj"])
        made = GradientRows(model, IndexSpec(projection_dim=dim, seed=0, recompute="none"), chosen)
        dataset = JsonlDataset(queries, tokenizer, max_seq_length=128)
        batch = collate([dataset[i] for i in range(len(dataset))], pad_token_id=tokenizer.pad_token_id)
        with torch.enable_grad():
            expected, _ = made(batch)
        keep = lambda n: n.endswith("down_proj") or n.endswith("o_proj")  # noqa: E731
        blocks = rq.block_columns(projs[(dim, 0)], keep)
        got = torch.cat([rows[(dim, 0)][:, o : o + s] for o, s in blocks], dim=1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_scores_ranks_and_metrics_match_plain_computation(setup):
    model, tokenizer, train, queries = setup
    modules, projs = rq.projectors(model, [8], [0])
    t = rq.gradient_rows(model, tokenizer, train, projs, modules)[(8, 0)]
    q = rq.gradient_rows(model, tokenizer, queries, projs, modules)[(8, 0)]
    blocks = rq.block_columns(projs[(8, 0)], lambda n: ".mlp." in n)
    qs = torch.cat([q[:, o : o + s] for o, s in blocks], 1).double()
    ts = torch.cat([t[:, o : o + s] for o, s in blocks], 1).double()
    names = [b.name for b in projs[(8, 0)].blocks if ".mlp." in b.name]
    grams = rq.module_grams(q, t, projs[(8, 0)])
    cos = rq.filter_scores(grams, names, "cosine")
    torch.testing.assert_close(cos, F.cosine_similarity(qs[:, None, :], ts[None, :, :], dim=-1))
    torch.testing.assert_close(rq.filter_scores(grams, names, "inner"), qs @ ts.T)

    # each module block unit-normalised, then cosine of the concatenation
    def unit(x):
        return torch.cat(
            [x[:, o : o + s].double() / x[:, o : o + s].double().norm(dim=1, keepdim=True) for o, s in blocks], 1
        )

    torch.testing.assert_close(
        rq.filter_scores(grams, names, "cosine-modnorm"),
        F.cosine_similarity(unit(q)[:, None, :], unit(t)[None, :, :], dim=-1),
    )
    # ... which is the mean over modules of per-module cosines
    per_module = torch.stack(
        [F.cosine_similarity(q[:, None, o : o + s].double(), t[None, :, o : o + s].double(), dim=-1) for o, s in blocks]
    ).mean(0)
    torch.testing.assert_close(rq.filter_scores(grams, names, "cosine-modnorm"), per_module)

    position = {r["id"]: i for i, r in enumerate(train)}
    sources = [
        [position[s] for s in query["sources"]] + [0] * (i == 1) for i, query in enumerate(queries)
    ]  # one 2-source query
    ranks = rq.first_source_ranks(cos, sources)
    for i, src in enumerate(sources):
        ordered = sorted(range(len(train)), key=lambda j: -cos[i, j].item())
        assert ranks[i].item() == 1 + min(ordered.index(s) for s in src)
    metrics = rq.ranking_metrics(ranks)
    assert metrics["r@1"] == pytest.approx(sum(r == 1 for r in ranks.tolist()) / len(ranks))
    assert metrics["mrr"] == pytest.approx(sum(1 / r for r in ranks.tolist()) / len(ranks))

    records = rq.evaluate({(8, 0): q}, {(8, 0): t}, projs, list(modules), sources)
    assert {r["filter"] for r in records} == set(rq.module_filters(list(modules)))
    rec = rq._pick(records, filter="mlp", dim=8, storage="float32", score="cosine")
    assert rec["mrr"] == pytest.approx(metrics["mrr"])


def test_grid_exact_ceiling_and_adam_rows_equal_per_example_autograd(setup, monkeypatch):
    """ranking_grid.py: the exact per-module inner products (from token grams, no gradient
    materialised, gathered head positions included) and the adam-scaled rows equal per-example
    autograd gradients of every Linear weight."""
    import ranking_grid as grid

    monkeypatch.setattr(grid, "DIMS", (8,))
    model, tokenizer, train, queries = setup
    modules = select_modules(model, ["*"])
    names = list(modules)

    def dense(rows):
        out = []
        for row in rows:
            batch = next(iter(rq._loader([row], tokenizer, 1)))
            loss = rq.supervised_token_loss(model, batch).sum()
            out.append([g.double() for g in torch.autograd.grad(loss, [modules[n].weight for n in names])])
        return out

    with torch.enable_grad():
        dq, dt = dense(queries), dense(train)
    g = torch.Generator().manual_seed(0)
    scales = {
        n: (torch.rand(m.out_features, generator=g) + 0.5, torch.rand(m.in_features, generator=g) + 0.5)
        for n, m in modules.items()
    }
    scales.pop(names[0])  # a module without optimizer state stays plain
    q = grid.Captured(modules).run(model, tokenizer, queries)
    t = grid.Captured(modules).run(model, tokenizer, train, queries=q, scales=scales)
    inner = torch.tensor(
        [[[float((a[m] * b[m]).sum()) for m in range(len(names))] for b in dt] for a in dq], dtype=torch.float64
    )
    torch.testing.assert_close(t.inner, inner, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(
        t.self_inner,
        torch.tensor([[float((b[m] ** 2).sum()) for m in range(len(names))] for b in dt], dtype=torch.float64),
        rtol=1e-4,
        atol=1e-7,
    )
    modcos = torch.tensor(
        [
            [
                float(
                    torch.stack(
                        [F.cosine_similarity(a[m].flatten(), b[m].flatten(), 0) for m in range(len(names))]
                    ).mean()
                )
                for b in dt
            ]
            for a in dq
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(grid.exact_scores(t, q, range(len(names))), modcos, rtol=1e-5, atol=1e-6)
    # adam rows: G ⊙ (1/√r)(1/√c)ᵀ, projected as the plain rows are
    projector = KroneckerProjector(modules, 8, 0)
    for m, name in enumerate(names):
        r, c = scales.get(name, (torch.ones(modules[name].out_features), torch.ones(modules[name].in_features)))
        block = projector.blocks[m]
        p_out, p_in = projector.matrices(name, torch.device("cpu"))
        want = torch.stack(
            [
                (p_out.double() @ (b[m] * r.double()[:, None] * c.double()[None, :]) @ p_in.double().T).flatten()
                for b in dt
            ]
        )
        got = t.projected[("adam", 8)][:, block.offset : block.offset + block.size].double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
