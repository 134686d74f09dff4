"""Recomputing decoder layers in the indexing backward (gradients/recompute.py): the same rows as
keeping every layer's activations, and the model exactly as it was afterwards."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, open_index
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.batch import projected_gradients
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.gradients.recompute import decoder_layers, recomputed_layers

from conftest import ROWS, ValidateOnly, make_model
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


def test_indexer_with_recomputed_layers_writes_the_same_index(tmp_path, model, tokenizer, rows):

    with pytest.raises(ConfigError, match=r"GradientIndexer\(recompute_layers='yes'\) is not allowed"):
        GradientIndexer(tmp_path / "bad", recompute_layers="yes")
    dataset = JsonlDataset(rows, tokenizer, 64)
    for name, recompute in (("kept", False), ("recomputed", True)):
        indexer = GradientIndexer(tmp_path / name, ["down_proj", "q_proj"], projection_dim=4, storage_dtype="float32", recompute_layers=recompute)
        trainer = L.Trainer(callbacks=[indexer], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, default_root_dir=tmp_path)
        trainer.validate(ValidateOnly(model), dataloaders=DataLoader(dataset, batch_size=3, collate_fn=collate))
    kept, recomputed = open_index(tmp_path / "kept"), open_index(tmp_path / "recomputed")
    assert recomputed.meta["complete"]
    torch.testing.assert_close(recomputed.rows(slice(None)), kept.rows(slice(None)), rtol=1e-6, atol=1e-7)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_grads_recompute_layers_reaches_the_indexer_from_the_config(tmp_path, saved_model, monkeypatch):
    """`gradian index ... grads.recompute_layers=true` recomputes the layers and writes the rows of the default path, and plan models it."""
    import gradian_lightning.gradients.batch as batch_module
    from conftest import write_jsonl
    from gradian_lightning.recipes.index import run_index
    from gradian_lightning.recipes.plan import make_plan
    from test_remote_store import index_config

    calls = []

    def counted(model, capture):
        calls.append(len(decoder_layers(model)))
        return recomputed_layers(model, capture)

    monkeypatch.setattr(batch_module, "recomputed_layers", counted)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    kept = run_index(index_config(saved_model, data, tmp_path / "kept"))
    assert calls == []
    recomputed = run_index(index_config(saved_model, data, tmp_path / "recomputed", "grads.recompute_layers=true"))
    assert calls and all(n > 0 for n in calls)  # every batch ran with its decoder layers recomputed
    assert kept["rows"] == recomputed["rows"] == len(ROWS)
    torch.testing.assert_close(open_index(tmp_path / "recomputed").rows(slice(None)), open_index(tmp_path / "kept").rows(slice(None)), rtol=1e-5, atol=1e-7)
    plans = [make_plan(index_config(saved_model, data, tmp_path / "p", f"grads.recompute_layers={flag}")) for flag in ("false", "true")]
    assert plans[1]["activation_bytes_per_token"] < plans[0]["activation_bytes_per_token"]
