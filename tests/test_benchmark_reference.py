"""benchmarks/studies/reference.py, what every quality study is measured against, checked against
plain per-example autograd and the product's own LDS; and the generated tables are current."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.studies import reference
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer
from gradian_lightning.validation.lds import linear_datamodeling_score

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    train, queries, sources = reference.lds_set("fact")
    queries, train = queries[:3], train[:7]
    import json

    tokenizer = word_tokenizer(json.dumps(r) for r in train + queries)
    return tiny_llama(len(tokenizer), hidden=32, seed=0).eval(), tokenizer, train, queries


def dense_gradients(model, tokenizer, rows, names):
    """Each row's weight gradients of `names`, one backward per row, float64."""
    modules = dict(model.named_modules())
    out = []
    for row in rows:
        batch = collate([JsonlDataset([row], tokenizer, 512)[0]], pad_token_id=tokenizer.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[0, :-1].float(), batch["labels"][0, 1:], ignore_index=-100, reduction="sum")
        out.append([g.double().flatten() for g in torch.autograd.grad(loss, [modules[n].weight for n in names])])
    return out


def test_exact_scores_equal_per_example_autograd(tiny):
    model, tokenizer, train, queries = tiny
    suffixes = ("gate_proj", "up_proj", "down_proj")
    names = list(reference.linear_modules(model, suffixes))
    got = reference.exact_scores(model, tokenizer, train, queries, suffixes)
    dq, dt = dense_gradients(model, tokenizer, queries, names), dense_gradients(model, tokenizer, train, names)
    inner = torch.tensor(
        [[[float(a[m] @ b[m]) for m in range(len(names))] for b in dt] for a in dq], dtype=torch.float64
    )
    module_cos = torch.tensor(
        [[np.mean([float(F.cosine_similarity(a[m], b[m], 0)) for m in range(len(names))]) for b in dt] for a in dq],
        dtype=torch.float64,
    )
    row_cos = torch.tensor(
        [[float(F.cosine_similarity(torch.cat(a), torch.cat(b), 0)) for b in dt] for a in dq], dtype=torch.float64
    )
    torch.testing.assert_close(torch.from_numpy(got["exact inner"]), inner.sum(2), rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(torch.from_numpy(got["exact module cosine"]), module_cos, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(got["exact row cosine"]), row_cos, rtol=1e-4, atol=1e-6)


def test_lds_and_mrr_match_the_product_and_a_plain_count():
    g = np.random.default_rng(0)
    scores, subsets, outputs = g.normal(size=(4, 10)), g.random((12, 10)) < 0.5, g.normal(size=(12, 4))
    np.testing.assert_allclose(
        reference.lds(scores, subsets, outputs), linear_datamodeling_score(scores, subsets, outputs), atol=1e-12
    )
    sources = [[3], [0, 5], [9], [1]]
    ranks = [
        1 + min(sorted(range(10), key=lambda j: -scores[q, j]).index(s) for s in src) for q, src in enumerate(sources)
    ]
    assert reference.mrr(scores, sources) == pytest.approx(np.mean([1 / r for r in ranks]))


def test_generated_tables_are_current():
    """RESULTS.md and RANKING.md hold what `python -m benchmarks.tables` renders from the result files."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.tables", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr + done.stdout
