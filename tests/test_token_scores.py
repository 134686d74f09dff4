"""Token-level attribution: each position's part of a row's gradient against an independent dense
per-position computation and against the row `GradientRows` makes, and the terms' sum against the
row's score as `gradian query` ranks it."""

import copy

import pytest
import torch
from conftest import ROWS, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from gradian_lightning.cli import main
from gradian_lightning.data import IGNORE_INDEX, JsonlDataset, collate
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss
from gradian_lightning.query.rows import index_gradient_rows, query_gradients
from gradian_lightning.query.scorer import Scorer
from gradian_lightning.query.token_scores import each_token_rows, query_token_scores, token_rows
from gradian_lightning.query.topk import open_index
from gradian_lightning.specs import IndexSpec, QuerySpec


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


def _dense_position_parts(model, modules, projector, example):
    """Independent reference: each captured module's real input x_t and output-gradient δ_t of the
    row's whole loss (plain hooks and autograd on a copy, no projection until the end), and per
    position t the projected dense weight gradient P_out (δ_t x_tᵀ) P_inᵀ, flattened: [T, D]."""
    reference = copy.deepcopy(model)
    named = dict(reference.named_modules())
    inputs, outputs = {}, {}

    def keep(name):
        def hook(module, args, output):
            inputs[name], outputs[name] = args[0].detach()[0], output
            output.retain_grad()

        return hook

    handles = [named[name].register_forward_hook(keep(name)) for name in modules]
    batch = collate([example])
    loss = supervised_token_loss(reference, {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).sum()
    loss.backward()
    for handle in handles:
        handle.remove()
    parts = []
    for name in modules:
        p_out, p_in = projector.matrices(name)
        delta, x = outputs[name].grad[0], inputs[name]  # [T, out], [T, in]
        dense = delta[:, :, None] * x[:, None, :]  # [T, out, in]: position t's share of the weight gradient
        torch.testing.assert_close(dense.sum(0), named[name].weight.grad, rtol=1e-4, atol=1e-6)
        parts.append((p_out @ dense @ p_in.T).reshape(len(x), -1))
    return torch.cat(parts, dim=1)


def test_each_position_part_is_that_positions_dense_weight_gradient(indexed):
    index, model, tokenizer = indexed
    row = ROWS[2]
    parts = token_rows(index, model, tokenizer, row)
    made = index_gradient_rows(index, model)
    example = JsonlDataset([row], tokenizer, 64).examples[0]
    assert len(parts["rows"]) == len(parts["tokens"]) == len(example.input_ids)
    assert parts["supervised"] == [t > 0 and label != IGNORE_INDEX for t, label in enumerate(example.labels)]
    want = _dense_position_parts(model, made.modules, made.projector, example)
    torch.testing.assert_close(parts["rows"], want, rtol=1e-4, atol=1e-6)
    assert parts["rows"][-1].abs().max() == 0  # the last token predicts nothing and no loss depends on it
    assert parts["rows"][: sum(1 for s in parts["supervised"] if not s) - 1].abs().max() > 0  # the prompt carries some
    assert all(p.grad is None for p in model.parameters())


def test_position_parts_sum_to_the_rows_of_gradient_rows(indexed):
    """In a padded batch of rows of different lengths, one with no supervised token among them."""
    index, model, tokenizer = indexed
    rows = [ROWS[1], {"prompt": "what city ?", "completion": ""}, ROWS[6], ROWS[0]]
    made = index_gradient_rows(index, model)
    examples = JsonlDataset(rows, tokenizer, 64).examples
    batch = collate(examples)
    whole = made({k: batch[k] for k in ("input_ids", "attention_mask", "labels")})[0]
    assert len({len(e.input_ids) for e in examples}) > 1 and whole[1].abs().max() == 0
    explained = list(each_token_rows(index, model, tokenizer, rows, made))
    for parts, want, example in zip(explained, whole, examples):
        assert parts["rows"].shape == (len(example.input_ids), made.projector.width)
        torch.testing.assert_close(parts["rows"].sum(0), want, rtol=1e-5, atol=1e-6)


def test_per_position_rows_of_a_gathered_head_sum_to_its_rows(model, tokenizer):
    """The output head runs only at supervised positions (logits_to_keep): its parts land there."""
    spec = IndexSpec(module_filter=("lm_head", "down_proj"), projection_dim=4)
    made = GradientRows(model, spec)
    examples = JsonlDataset(ROWS[:3], tokenizer, 64).examples
    batch = {k: v for k, v in collate(examples).items() if k in ("input_ids", "attention_mask", "labels")}
    rows = made(batch)[0]
    parts = made(batch, per_position=True)[0]
    assert parts.shape == (*batch["input_ids"].shape, made.projector.width)
    torch.testing.assert_close(parts.sum(1), rows, rtol=1e-5, atol=1e-6)
    head = next(b for b in made.projector.blocks if b.name == "lm_head")
    on_head = parts[:, :, head.offset : head.offset + head.size].abs().amax(-1) > 0
    assert (on_head <= supervised_targets(batch["labels"])).all() and on_head.any()


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
        terms = entry["terms"]
        assert len(terms) == len(entry["tokens"]) and None not in terms  # every token, prompt ones too
        assert sum(terms) == pytest.approx(entry["score"], abs=1e-9) and terms[-1] == 0
        assert entry["score"] == pytest.approx(ranked[position], rel=1e-3, abs=1e-5)
