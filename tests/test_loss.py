import pytest
import torch
from torch import nn

from gradian_lightning.data import collate, tokenize_row
from gradian_lightning.gradients.loss import supervised_token_loss


class NoLogitsToKeep(nn.Module):
    """A causal LM whose forward has no logits_to_keep: the full-logits gather path."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


@pytest.mark.parametrize("wrap", [False, True])
def test_loss_equals_hf_loss(model, tokenizer, rows, wrap):
    batch = collate([tokenize_row(tokenizer, r, i, 64) for i, r in enumerate(rows)])
    losses = supervised_token_loss(NoLogitsToKeep(model) if wrap else model, batch)
    assert losses.dtype == torch.float32 and losses.shape == (len(rows),)
    n = (batch["labels"][:, 1:] != -100).sum()
    hf = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    torch.testing.assert_close(losses.sum() / n, hf)
    for i in range(len(rows)):  # and per example, each alone
        one = {k: v[i : i + 1] for k, v in batch.items() if torch.is_tensor(v)}
        n_i = (one["labels"][:, 1:] != -100).sum()
        torch.testing.assert_close(
            losses[i], model(input_ids=one["input_ids"], labels=one["labels"]).loss * n_i, rtol=1e-5, atol=1e-5
        )


def test_row_without_supervised_tokens_has_zero_loss(model, tokenizer):
    ex = tokenize_row(tokenizer, {"prompt": "what is the capital ?", "completion": " paris"}, 0, 64)
    empty = tokenize_row(tokenizer, {"prompt": "what is the capital ? paris", "completion": ""}, 1, 64)
    empty.labels = [-100] * len(empty.labels)
    losses = supervised_token_loss(model, collate([ex, empty]))
    assert losses[0] > 0 and losses[1] == 0


def test_bf16_loss_upcasts_only_gathered_logits(model, tokenizer, rows):
    batch = collate([tokenize_row(tokenizer, r, i, 64) for i, r in enumerate(rows)])
    want = supervised_token_loss(model, batch)
    got = supervised_token_loss(model.to(torch.bfloat16), batch)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_loss_equals_unchunked(model, tokenizer, rows, chunk):
    batch = collate([tokenize_row(tokenizer, r, i, 64) for i, r in enumerate(rows)])
    want = supervised_token_loss(model, batch)
    got = supervised_token_loss(model, batch, chunk_tokens=chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # and its gradient, through the recomputed chunks, to the hidden states and weights alike
    params = [p for p in model.parameters()]
    g_want = torch.autograd.grad(want.sum(), params)
    g_got = torch.autograd.grad(supervised_token_loss(model, batch, chunk_tokens=chunk).sum(), params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_loss_refuses_logit_transforms_and_bad_sizes(model, tokenizer, rows):
    from gradian_lightning.errors import ConfigError

    batch = collate([tokenize_row(tokenizer, r, i, 64) for i, r in enumerate(rows[:2])])
    with pytest.raises(ConfigError, match="loss_chunk_tokens'=0"):
        supervised_token_loss(model, batch, chunk_tokens=0)
    model.config.logit_scale = 0.5  # as Cohere's: logits scaled after the head
    with pytest.raises(ConfigError, match="logit_scale after the head"):
        supervised_token_loss(model, batch, chunk_tokens=4)


def test_token_cross_entropy_equals_f_cross_entropy_and_keeps_only_the_logits():
    """Values and gradients against F.cross_entropy in float64; for the backward it saves the logits
    (no log-softmax beside them) and writes their gradient into them, unless they are a view."""
    import torch.nn.functional as F

    from gradian_lightning.gradients.loss import token_cross_entropy

    g = torch.Generator().manual_seed(0)
    base = torch.randn(70, 50, generator=g) * 4  # more rows than one log-sum-exp block (LSE_ROWS)
    targets = torch.randint(0, 50, (70,), generator=g)
    weights = torch.rand(70, generator=g)
    ref = base.double().requires_grad_(True)
    want = F.cross_entropy(ref, targets, reduction="none")
    (want * weights.double()).sum().backward()
    saved = []
    logits = base.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        fresh = logits * 1.0  # a fresh fp32 tensor, as the loss's upcast is
        got = token_cross_entropy(fresh, targets)
    assert sum(saved) == base.nbytes + targets.nbytes + 70 * 4  # logits, targets, log-sum-exp
    (got * weights).sum().backward()
    torch.testing.assert_close(
        fresh.detach(), logits.grad
    )  # the gradient was written into the logits: no second [n, vocab] tensor
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    view = base.clone().requires_grad_(True)
    shown = view.view_as(view) * 1.0
    seen = shown.view(70, 50)  # a view: its values must survive the backward
    before = seen.detach().clone()
    token_cross_entropy(seen, targets).sum().backward()
    assert torch.equal(seen.detach(), before)
