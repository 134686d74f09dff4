"""Full-space K-FAC / EK-FAC factors (gradients/factors.py) against their definitions, computed here
independently: plain forward hooks and autograd on a float64 tiny Llama, per-example weight
gradients from `torch.autograd.grad` on the parameters themselves."""

import torch
from conftest import ROWS, make_model

from gradian_lightning import IndexSpec, JsonlDataset, collate
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.factors import (
    Eigenbases,
    FactorFit,
    Factors,
    TokenPass,
    carrying_positions,
    fit_factors,
)
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss

SPEC = IndexSpec(module_filter=["*.layers.*"], projection_dim=None, storage_dtype="float32")
KEYS = ("input_ids", "attention_mask", "labels")


def tiny(tokenizer):
    """A float64 tiny Llama (hidden 16, MLP 32): dense Kronecker products stay small."""
    return make_model(len(tokenizer), hidden=16).double()


def batches(tokenizer, size=3):
    examples = JsonlDataset(ROWS, tokenizer, 64).examples
    return [{k: v for k, v in collate(examples[i : i + size]).items() if k in KEYS} for i in range(0, len(ROWS), size)]


def carrying(batch):
    """Attended positions at or before each row's last supervised one, by a loop over rows."""
    mask = torch.zeros_like(batch["labels"], dtype=torch.bool)
    for b, labels in enumerate(batch["labels"].tolist()):
        predicted = [t - 1 for t in range(1, len(labels)) if labels[t] != -100]
        if predicted:
            mask[b, : max(predicted) + 1] = batch["attention_mask"][b, : max(predicted) + 1].bool()
    return mask


def inputs_and_output_grads(model, batch, modules):
    """Each module's input [B, T, in] and d (sum of losses) / d output [B, T, out], by hooks."""
    inputs, outputs = {}, {}

    def keep(name):
        def hook(module, args, output):
            inputs[name], outputs[name] = args[0].detach(), output

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in modules.items()]
    try:
        losses = supervised_token_loss(model, batch)
        grads = torch.autograd.grad(losses.sum(), [outputs[n] for n in modules])
    finally:
        for h in handles:
            h.remove()
    return inputs, dict(zip(modules, grads))


def per_example_gradients(model, batch, modules):
    """name -> [B, out, in]: autograd of each example's loss, one forward each, on the module weights."""
    weights = [m.weight for m in modules.values()]
    rows = []
    for b in range(batch["input_ids"].shape[0]):
        loss = supervised_token_loss(model, {k: v[b : b + 1] for k, v in batch.items()})[0]
        rows.append(torch.autograd.grad(loss, weights, allow_unused=True, materialize_grads=True))
    return {n: torch.stack([r[i] for r in rows]) for i, n in enumerate(modules)}


def test_carrying_positions_are_those_with_gradient(tokenizer):
    model = tiny(tokenizer)
    modules = select_modules(model, SPEC.module_filter)
    for batch in batches(tokenizer):
        mask = carrying_positions(batch)
        assert torch.equal(mask, carrying(batch))
        _, grads = inputs_and_output_grads(model, batch, modules)
        # Outside the mask the output-gradient is exactly zero: A leaves out nothing G sees.
        assert all(torch.count_nonzero(g[~mask]) == 0 for g in grads.values())


def test_covariances_equal_their_definitions(tokenizer):
    model = tiny(tokenizer)
    modules = select_modules(model, SPEC.module_filter)
    parts = batches(tokenizer)
    fit = FactorFit(model, SPEC, dtype=torch.float64)
    total = sum((fit.covariances(b) for b in parts[1:]), fit.covariances(parts[0]))
    for name in modules:
        a = g = 0
        positions = examples = 0
        for batch in parts:
            inputs, grads = inputs_and_output_grads(model, batch, modules)
            mask = carrying(batch)
            x, d = inputs[name][mask], grads[name][mask]
            a, g = a + x.T @ x, g + d.T @ d
            positions += int(mask.sum())
            examples += int((batch["labels"] != -100).any(1).sum())
        torch.testing.assert_close(total.tensors[f"{name}/A"], a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(total.tensors[f"{name}/G"], g, rtol=1e-10, atol=1e-12)
        assert int(total.tensors[f"{name}/positions"]) == positions
    assert int(total.tensors["examples"]) == examples == len(ROWS)


def test_a_diagonal_g_is_the_diagonal_of_g_with_the_identity_as_its_basis(tokenizer):
    """The output head fitted with a diagonal G: Σ δ² per output, its eigenvalues that diagonal over
    the examples, EK-FAC's Λ the per-example gradients' squares in (I, Q_A); A as without it."""
    model = tiny(tokenizer)
    modules = {**select_modules(model, SPEC.module_filter), "lm_head": model.lm_head}
    parts = batches(tokenizer)
    fit = FactorFit(model, SPEC, modules=modules, dtype=torch.float64, diagonal_g={"lm_head"})
    total = sum((fit.covariances(b) for b in parts[1:]), fit.covariances(parts[0]))
    assert "lm_head/G" not in total.tensors
    assert [k for k in total.tensors if k.endswith("/G_diagonal")] == ["lm_head/G_diagonal"]
    g = 0
    for batch in parts:
        _, grads = inputs_and_output_grads(model, batch, {"lm_head": model.lm_head})
        d = grads["lm_head"].reshape(-1, model.lm_head.out_features)
        g = g + d.square().sum(0)  # positions the head never ran at add nothing either way
    torch.testing.assert_close(total.tensors["lm_head/G_diagonal"], g, rtol=1e-10, atol=1e-14)
    factors = fit_factors(model, SPEC, parts, ekfac=True, modules=modules, dtype=torch.float64, diagonal_g={"lm_head"})
    full = fit_factors(model, SPEC, parts, ekfac=False, modules=modules, dtype=torch.float64)
    q_a, lam_a, q_g, lam_g = factors.bases["lm_head"]
    assert q_g.numel() == 0
    torch.testing.assert_close(lam_g, g / len(ROWS), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(q_a.abs(), full.bases["lm_head"][0].abs(), rtol=1e-6, atol=1e-8)  # A's basis unchanged
    rotated = torch.cat([per_example_gradients(model, b, {"lm_head": model.lm_head})["lm_head"] @ q_a for b in parts])
    torch.testing.assert_close(factors.eigenvalues["lm_head"], rotated.square().mean(0), rtol=1e-9, atol=1e-14)
    # The other modules' factors are those of a fit without the diagonal head.
    for name in select_modules(model, SPEC.module_filter):
        torch.testing.assert_close(factors.bases[name][3], full.bases[name][3], rtol=1e-9, atol=1e-14)


def test_the_heads_positions_are_packed_to_the_most_supervised_of_a_row(tokenizer):
    """A head run on the gathered supervised positions is handed on as [B, most supervised, f], each
    row's positions first and zero after, not scattered to [B, T, vocab]; its per-example gradients
    Σ_t δ_t x_tᵀ are the autograd ones."""
    model = tiny(tokenizer)
    batch = batches(tokenizer)[0]
    seen = {}
    TokenPass(model, SPEC, {"lm_head": model.lm_head}, torch.float64).run(
        batch, lambda name, x, g: seen.update(x=x, g=g)
    )
    counts = supervised_targets(batch["labels"]).sum(1)
    assert seen["g"].shape == (len(counts), int(counts.max()), model.lm_head.out_features)
    assert int(counts.max()) < batch["labels"].shape[1]
    for b, n in enumerate(counts.tolist()):
        assert seen["g"][b, n:].abs().sum() == 0 and seen["x"][b, n:].abs().sum() == 0
    expected = per_example_gradients(model, batch, {"lm_head": model.lm_head})["lm_head"]
    torch.testing.assert_close(torch.bmm(seen["g"].transpose(1, 2), seen["x"]), expected, rtol=1e-9, atol=1e-12)


def test_ekfac_eigenvalues_equal_the_per_example_computation(tokenizer):
    model = tiny(tokenizer)
    modules = select_modules(model, SPEC.module_filter)
    parts = batches(tokenizer)
    factors = fit_factors(model, SPEC, parts, ekfac=True, dtype=torch.float64)
    kfac = fit_factors(model, SPEC, parts, ekfac=False, dtype=torch.float64)
    for name in modules:
        q_a, lam_a, q_g, lam_g = factors.bases[name]
        rotated = torch.cat([q_g.T @ per_example_gradients(model, b, modules)[name] @ q_a for b in parts])
        torch.testing.assert_close(factors.eigenvalues[name], rotated.square().mean(0), rtol=1e-9, atol=1e-14)
        torch.testing.assert_close(kfac.eigenvalues[name], torch.outer(lam_g, lam_a))
        # The bases diagonalise A and G as defined (per position, per example).
        assert torch.all(lam_a >= 0) and torch.all(lam_g >= 0)


def test_halves_merged_equal_the_whole(tokenizer):
    model = tiny(tokenizer)
    examples = JsonlDataset(ROWS, tokenizer, 64).examples
    whole, first, second = ({k: collate(e)[k] for k in KEYS} for e in (examples, examples[:3], examples[3:]))
    fit = FactorFit(model, SPEC, dtype=torch.float64)
    merged = fit.covariances(first) + fit.covariances(second)
    expected = fit.covariances(whole)
    assert set(merged.tensors) == set(expected.tensors)
    for key, value in expected.tensors.items():
        torch.testing.assert_close(merged.tensors[key], value, rtol=1e-9, atol=1e-12)
    bases = Eigenbases.from_sums(merged, torch.float64)
    lambdas = fit.lambdas(first, bases) + fit.lambdas(second, bases)
    for key, value in fit.lambdas(whole, bases).tensors.items():
        torch.testing.assert_close(lambdas.tensors[key], value, rtol=1e-9, atol=1e-14)
    assert Factors(bases, lambdas).kind == "ekfac" and Factors(bases).kind == "kfac"
    # What an index would store, read back: the same preconditioning.
    factors = Factors(bases, lambdas)
    again = Factors.from_state({k: v.clone() for k, v in factors.state().items()}, factors.kind)
    g = torch.randn(2, *factors.eigenvalues["model.layers.0.mlp.down_proj"].shape, dtype=torch.float64)
    for damping in (0.1, 0.0):
        torch.testing.assert_close(
            again.precondition("model.layers.0.mlp.down_proj", g, damping),
            factors.precondition("model.layers.0.mlp.down_proj", g, damping),
        )
    assert again.kind == "ekfac" and again.nbytes() == factors.nbytes()


def test_sums_added_in_place_equal_sums_added_and_consume_frees_them(tokenizer):
    # fit_factors adds each batch into one running FactorSums (`into=`) and consumes it: the same
    # numbers as a new sum per batch, with one set of sums held instead of three.
    model = tiny(tokenizer)
    parts = batches(tokenizer, size=2)
    fit = FactorFit(model, SPEC, dtype=torch.float64, diagonal_g=["model.layers.1.mlp.down_proj"])
    added = sum((fit.covariances(b) for b in parts[1:]), fit.covariances(parts[0]))
    running = None
    for b in parts:
        running = fit.covariances(b, into=running)
    assert set(running.tensors) == set(added.tensors)
    for key, value in added.tensors.items():
        assert torch.equal(running.tensors[key], value), key
    expected = Eigenbases.from_sums(added, torch.float64)
    consumed = Eigenbases.from_sums(running, torch.float64, consume=True)
    assert set(running.tensors) == {"examples"}  # every module's sums freed as its bases were made
    for name, base in expected.bases.items():
        for got, want in zip(consumed.bases[name], base):
            assert torch.equal(got, want), name
    lambdas = None
    for b in parts:
        lambdas = fit.lambdas(b, expected, into=lambdas)
    summed = sum((fit.lambdas(b, expected) for b in parts[1:]), fit.lambdas(parts[0], expected))
    for key, value in summed.tensors.items():
        torch.testing.assert_close(lambdas.tensors[key], value, rtol=1e-12, atol=0)
    # fit_factors, which runs the in-place path, gives the factors of the summed one.
    fitted = fit_factors(model, SPEC, parts, dtype=torch.float64, diagonal_g=["model.layers.1.mlp.down_proj"])
    for name, eigenvalues in Factors(expected, summed).eigenvalues.items():
        torch.testing.assert_close(fitted.eigenvalues[name], eigenvalues, rtol=1e-12, atol=0)


def test_fit_leaves_grad_modes_and_rng_alone(tokenizer):
    model = tiny(tokenizer).train()
    model.model.layers[1].eval()
    modes = [m.training for m in model.modules()]
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    factors = fit_factors(model, SPEC, batches(tokenizer), dtype=torch.float64)
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert factors.nbytes() > 0


def test_a_fit_inside_lightnings_inference_mode_gives_the_same_sums(tokenizer):
    """The callback fits inside Lightning's validation loop, under `torch.inference_mode`."""
    model = tiny(tokenizer)
    fit = FactorFit(model, SPEC, dtype=torch.float64)
    first, second = batches(tokenizer)[:2]
    with torch.inference_mode():
        inside = fit.covariances(first) + fit.covariances(second)
        bases = Eigenbases.from_sums(inside, torch.float64)
        lambdas = fit.lambdas(first, bases)
    outside = fit.covariances(first) + fit.covariances(second)
    assert all(torch.equal(inside.tensors[k], v) for k, v in outside.tensors.items())
    merged = lambdas + fit.lambdas(second, bases)  # an inference-mode sum adds to an ordinary one
    assert torch.equal(merged.tensors["examples"], inside.tensors["examples"])
