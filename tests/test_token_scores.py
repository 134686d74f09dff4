"""Token-level attribution: each supervised token's term against independent per-token gradients,
and the terms' sum against the row's score as `gradian query` ranks it."""

import copy

import pytest
import torch
from conftest import ROWS, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from gradian_lightning.cli import main
from gradian_lightning.data import IGNORE_INDEX, JsonlDataset, collate
from gradian_lightning.gradients.loss import supervised_token_loss
from gradian_lightning.query.rows import index_gradient_rows, query_gradients
from gradian_lightning.query.scorer import Scorer
from gradian_lightning.query.token_scores import query_token_scores, token_rows
from gradian_lightning.query.topk import open_index
from gradian_lightning.specs import QuerySpec


@pytest.fixture
def indexed(tmp_path, saved_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = [
        f"model.name_or_path={saved_model}",
        f"data.train={data}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(["index", *args, "grads.storage_dtype=float32", "grads.projection_dim=4"]) == 0
    capsys.readouterr()
    model = AutoModelForCausalLM.from_pretrained(saved_model).eval()
    return open_index(tmp_path / "ix"), model, AutoTokenizer.from_pretrained(saved_model)


def test_each_token_row_is_that_tokens_projected_loss_gradient(indexed):
    index, model, tokenizer = indexed
    row = ROWS[2]
    parts = token_rows(index, model, tokenizer, row)
    made = index_gradient_rows(index, model)
    modules, projector = made.modules, made.projector
    example = JsonlDataset([row], tokenizer, 64).examples[0]
    targets = [t for t in range(1, len(example.labels)) if example.labels[t] != IGNORE_INDEX]
    assert len(parts["rows"]) == len(targets) == sum(parts["supervised"]) > 1
    reference = copy.deepcopy(model)  # independent: real weight gradients of one token's loss, projected
    named = dict(reference.named_modules())
    for i, t in enumerate(targets):
        labels = [IGNORE_INDEX] * len(example.labels)
        labels[t] = example.labels[t]
        batch = collate([type(example)(0, "x", example.input_ids, labels, 0)])
        loss = supervised_token_loss(reference, {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).sum()
        grads = torch.autograd.grad(loss, [named[name].weight for name in modules])
        want = torch.cat(
            [
                (projector.matrices(name)[0] @ g @ projector.matrices(name)[1].T).reshape(-1)
                for name, g in zip(modules, grads)
            ]
        )
        torch.testing.assert_close(parts["rows"][i], want, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "score, normalize, precondition",
    [
        ("cosine", "module", "none"),
        ("cosine", "row", "diag"),
        ("inner", "module", "fisher"),
        ("cosine", "module", "auto"),
    ],
)
def test_token_terms_sum_to_the_rows_ranked_score(indexed, score, normalize, precondition):
    index, model, tokenizer = indexed
    query = ROWS[0]
    query_row = query_gradients(index, model, tokenizer, [query])
    top = index.topk(query_row, k=len(ROWS), score=score, normalize=normalize, precondition=precondition)
    ranked = dict(zip(top.indices[0].tolist(), top.scores[0].tolist()))
    spec = QuerySpec(score=score, normalize=normalize, precondition=precondition)
    scorer = Scorer(index, spec, shortcut=False).prepare(query_row)
    explained = query_token_scores(scorer, model, tokenizer, ROWS[1:4])
    for position, entry in zip(range(1, 4), explained):
        terms = [t for t in entry["terms"] if t is not None]
        assert len(terms) == sum(entry["supervised"]) and sum(terms) == pytest.approx(entry["score"], abs=1e-9)
        assert entry["score"] == pytest.approx(ranked[position], rel=1e-3, abs=1e-5)
        assert [t is None for t in entry["terms"]] == [not s for s in entry["supervised"]]
