"""Recomputing decoder layers in the indexing backward (gradients/recompute.py): the same rows as
keeping every layer's activations, and the model exactly as it was afterwards."""

import torch

from gradian_lightning.data import collate
from gradian_lightning.gradients.batch import projected_gradients
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.gradients.recompute import decoder_layers

from conftest import ROWS, make_model
from test_gradients import examples


def batch_of(tokenizer):
    return collate(examples(tokenizer, ROWS[:3]))


def test_recomputed_rows_equal_kept_ones_and_the_model_is_untouched(tokenizer):
    model = make_model(len(tokenizer), hidden=64, layers=3)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)  # a frozen weight stays frozen
    modules = select_modules(model, ["down_proj", "q_proj"])
    projector = KroneckerProjector(modules, 4, 0)
    calls = []
    own = model.model.layers[2].forward
    model.model.layers[2].forward = lambda *a, **k: calls.append(1) or own(*a, **k)  # an instance-level forward, as accelerate's hooks set
    wrapped = model.model.layers[2].forward
    flags = [p.requires_grad for p in model.parameters()]
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with torch.enable_grad():
        kept, kept_losses = projected_gradients(model, batch_of(tokenizer), LinearCapture(modules), projector, recompute_layers=False)
        assert len(calls) == 1
        got, losses = projected_gradients(model, batch_of(tokenizer), LinearCapture(modules), projector, recompute_layers=True)
    assert len(calls) == 3  # the forward and its recomputation both went through the instance's own forward
    torch.testing.assert_close(got, kept, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(losses, kept_losses, rtol=0, atol=0)
    assert model.model.layers[2].forward is wrapped
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model)[:2])
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    assert not model.training and torch.equal(torch.get_rng_state(), rng)


def test_a_failing_backward_leaves_the_layers_as_they_were(tokenizer):
    model = make_model(len(tokenizer), hidden=32, layers=2)
    modules = select_modules(model, ["down_proj"])
    capture = LinearCapture(modules)
    capture.output_grads = lambda loss: (_ for _ in ()).throw(RuntimeError("killed in the backward"))
    try:
        with torch.enable_grad():
            projected_gradients(model, batch_of(tokenizer), capture, KroneckerProjector(modules, 4, 0), recompute_layers=True)
    except RuntimeError as err:
        assert "killed in the backward" in str(err)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
    assert not capture._recomputing and not capture.outputs
