"""Projected rows against exact per-example gradients computed independently (HF loss, weight .grad)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from gradian_lightning.data import collate, tokenize_row
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.specs import IndexSpec

MODULES = ["down_proj", "layers.0.self_attn.q_proj", "layers.1.self_attn.v_proj", "lm_head"]


def examples(tokenizer, rows, max_len=64):
    return [tokenize_row(tokenizer, r, i, max_len) for i, r in enumerate(rows)]


def exact_gradients(model, example, names):
    """Per-example weight gradients of the summed token loss, from HF's own loss on a batch of one."""
    batch = collate([example])
    n = int((batch["labels"][:, 1:] != -100).sum())
    modules = dict(model.named_modules())
    weights = [modules[name].weight for name in names]
    with torch.enable_grad():
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss * n
        return dict(zip(names, torch.autograd.grad(loss, weights)))


def rows_for(model, batch, modules, dim, seed=0):
    made = GradientRows(model, IndexSpec(projection_dim=dim, seed=seed, recompute="none"), modules)
    with torch.enable_grad():
        rows, losses = made(batch)
    return rows, losses, made.projector


@pytest.mark.parametrize("dim", [4, None])
def test_rows_equal_projected_exact_gradients(model, tokenizer, rows, dim):
    exs = examples(tokenizer, rows)
    modules = select_modules(model, MODULES)
    assert len(modules) == 2 + 1 + 1 + 1  # two down_proj, q_proj, v_proj, lm_head
    got, _, projector = rows_for(model, collate(exs), modules, dim)
    for i, ex in enumerate(exs):
        exact = exact_gradients(model, ex, list(modules))
        for block in projector.blocks:
            g = exact[block.name]
            if dim is not None:
                p_out, p_in = projector.matrices(block.name)
                g = p_out @ g @ p_in.T
            stored = got[i, block.offset : block.offset + block.size].view(block.shape)
            torch.testing.assert_close(stored, g, rtol=1e-4, atol=1e-5)
            assert g.abs().sum() > 0


def test_rows_do_not_depend_on_batch_composition_or_padding(model, tokenizer, rows):
    exs = examples(tokenizer, rows)
    modules = select_modules(model, ["down_proj", "o_proj"])
    together, losses, _ = rows_for(model, collate(exs[:4]), modules, 8)
    alone = torch.cat([rows_for(model, collate([e]), modules, 8)[0] for e in exs[:4]])
    lengths = {len(e.input_ids) for e in exs[:4]}
    assert len(lengths) > 1  # the batch really is padded
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-6)


def test_frozen_weights_work_and_flags_stay(model, tokenizer, rows):
    for p in model.parameters():
        p.requires_grad_(False)
    modules = select_modules(model, ["down_proj"])
    got, _, projector = rows_for(model, collate(examples(tokenizer, rows[:2])), modules, 4)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        p.requires_grad_(True)
    want, _, _ = rows_for(model, collate(examples(tokenizer, rows[:2])), modules, 4)
    torch.testing.assert_close(got, want)


def test_parameter_grads_untouched(model, tokenizer, rows):
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    rows_for(model, collate(examples(tokenizer, rows[:3])), select_modules(model, ["mlp.up_proj"]), 4)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())


def test_bf16_model_projects_in_fp32(model, tokenizer, rows):
    batch = collate(examples(tokenizer, rows[:3]))
    modules = select_modules(model, ["down_proj"])
    want, _, _ = rows_for(model, batch, modules, 8)
    got, losses, _ = rows_for(model.to(torch.bfloat16), batch, select_modules(model, ["down_proj"]), 8)
    assert got.dtype == torch.float32 and losses.dtype == torch.float32
    cos = nn.functional.cosine_similarity(got, want, dim=1)
    assert (cos > 0.95).all(), cos


def test_projection_is_seeded_by_seed_and_module_name(model):
    modules = select_modules(model, ["down_proj"])
    state = torch.get_rng_state()
    a, b = KroneckerProjector(modules, 4, 0), KroneckerProjector(modules, 4, 0)
    names = list(modules)
    assert torch.equal(a.matrices(names[0])[0], b.matrices(names[0])[0])
    assert not torch.equal(a.matrices(names[0])[0], a.matrices(names[1])[0])
    assert not torch.equal(a.matrices(names[0])[0], KroneckerProjector(modules, 4, 1).matrices(names[0])[0])
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is never drawn from


@pytest.mark.parametrize("chunk", [2, 5])
def test_chunked_loss_gives_the_same_rows(model, tokenizer, rows, chunk):
    batch = collate(examples(tokenizer, rows))
    modules = select_modules(model, MODULES[:-1])  # the head runs in chunks of its own: it cannot be captured
    spec = IndexSpec(projection_dim=4, seed=0, recompute="none")
    with pytest.raises(ConfigError, match="head cannot be captured"):
        GradientRows(model, IndexSpec(module_filter="lm_head", loss_chunk_tokens=chunk))(batch)
    with torch.enable_grad():
        want, want_losses = GradientRows(model, spec, modules)(batch)
        got, losses = GradientRows(model, replace(spec, loss_chunk_tokens=chunk), modules)(batch)
    torch.testing.assert_close(losses, want_losses, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_forward_keeps_no_linear_input_for_weight_gradients(model, tokenizer, rows):
    """Weights are detached for the forward: autograd saves no Linear's input (only weight gradients need them)."""
    kept = []  # held, so that no later tensor can take a freed input's address
    hooks = [
        m.register_forward_pre_hook(lambda m, args: kept.append(args[0]))
        for name, m in model.named_modules()
        if name.endswith(("mlp.gate_proj", "mlp.down_proj", "self_attn.q_proj"))
    ]
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    assert all(p.requires_grad for p in model.parameters())
    modules = select_modules(model, ["down_proj"])
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            GradientRows(model, IndexSpec(projection_dim=4, seed=0, recompute="none"), modules)(
                collate(examples(tokenizer, rows[:3]))
            )
    finally:
        for h in hooks:
            h.remove()
    linear_inputs = {t.untyped_storage().data_ptr() for t in kept}
    assert len(linear_inputs) == 3 * 2 and saved  # three Linears in each of two layers ran
    assert not saved & linear_inputs
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
