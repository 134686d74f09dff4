"""Recomputing MLP blocks or decoder layers in the indexing backward (gradients/recompute.py): the
same rows as keeping every activation, and the model exactly as it was afterwards."""

import lightning as L
import pytest
import torch
from conftest import ROWS, ValidateOnly, make_model
from test_gradients import examples
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, IndexSpec, open_index
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.recompute import decoder_layers, recomputed_modules, recomputed_units


def batch_of(tokenizer):
    return collate(examples(tokenizer, ROWS[:3]))


def rows_of(model, modules, batch, recompute):
    """The rows and losses of `batch` at k = 4, seed 0, recomputing `recompute`."""
    return GradientRows(model, IndexSpec(projection_dim=4, seed=0, recompute=recompute), modules)(batch)


@pytest.mark.parametrize("what", ["layers", "mlp"])
def test_recomputed_rows_equal_kept_ones_and_the_model_is_untouched(tokenizer, what):
    model = make_model(len(tokenizer), hidden=64, layers=3)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)  # a frozen weight stays frozen
    modules = select_modules(model, ["down_proj", "q_proj"])
    calls = []
    unit = recomputed_units(model, what)[2]
    assert unit is (model.model.layers[2] if what == "layers" else model.model.layers[2].mlp)
    own = unit.forward
    unit.forward = lambda *a, **k: (
        calls.append(1) or own(*a, **k)
    )  # an instance-level forward, as accelerate's hooks set
    wrapped = unit.forward
    flags = [p.requires_grad for p in model.parameters()]
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with torch.enable_grad():
        kept, kept_losses = rows_of(model, modules, batch_of(tokenizer), "none")
        assert len(calls) == 1
        got, losses = rows_of(model, modules, batch_of(tokenizer), what)
    assert len(calls) == 3  # the forward and its recomputation both went through the instance's own forward
    torch.testing.assert_close(got, kept, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(losses, kept_losses, rtol=0, atol=0)
    assert unit.forward is wrapped
    assert all("forward" not in u.__dict__ for u in recomputed_units(model, what)[:2])
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    assert not model.training and torch.equal(torch.get_rng_state(), rng)


def test_a_failing_backward_leaves_the_layers_as_they_were(tokenizer):
    model = make_model(len(tokenizer), hidden=32, layers=2)
    modules = select_modules(model, ["down_proj"])
    made = GradientRows(model, IndexSpec(projection_dim=4, recompute="layers"), modules)
    capture = made.capture
    capture.output_grads = lambda loss: (_ for _ in ()).throw(RuntimeError("killed in the backward"))
    with pytest.raises(RuntimeError, match="killed in the backward"), torch.enable_grad():
        made(batch_of(tokenizer))
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
    assert not capture._recomputing and not capture.outputs


def test_indexer_with_recomputed_layers_writes_the_same_index(tmp_path, model, tokenizer, rows):

    with pytest.raises(ConfigError, match=r"setting 'grads.recompute'='yes' is not allowed; use mlp or layers or none"):
        GradientIndexer(tmp_path / "bad", recompute="yes")
    dataset = JsonlDataset(rows, tokenizer, 64)
    assert GradientIndexer(tmp_path / "default").session.spec.recompute == "mlp"
    for name, recompute in (("kept", "none"), ("recomputed", "layers")):
        indexer = GradientIndexer(
            tmp_path / name, ["down_proj", "q_proj"], projection_dim=4, storage_dtype="float32", recompute=recompute
        )
        trainer = L.Trainer(
            callbacks=[indexer],
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            default_root_dir=tmp_path,
        )
        trainer.validate(ValidateOnly(model), dataloaders=DataLoader(dataset, batch_size=3, collate_fn=collate))
    kept, recomputed = open_index(tmp_path / "kept"), open_index(tmp_path / "recomputed")
    assert recomputed.meta.complete
    torch.testing.assert_close(recomputed.rows(slice(None)), kept.rows(slice(None)), rtol=1e-6, atol=1e-7)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_grads_recompute_reaches_the_indexer_from_the_config(tmp_path, saved_model, monkeypatch):
    """`gradian index ... grads.recompute=layers` (and the default, mlp) recompute what they say and write the rows of
    `grads.recompute=none`, and plan models each."""
    from conftest import write_jsonl
    from test_remote_store import index_config

    import gradian_lightning.gradients.batch as batch_module
    from gradian_lightning.recipes.index import run_index
    from gradian_lightning.recipes.plan import make_plan

    calls = []

    def counted(model, capture, what):
        calls.append((what, len(recomputed_units(model, what))))
        return recomputed_modules(model, capture, what)

    monkeypatch.setattr(batch_module, "recomputed_modules", counted)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    kept = run_index(index_config(saved_model, data, tmp_path / "kept", "grads.recompute=none"))
    assert calls and all(c == ("none", 0) for c in calls)
    for what in ("layers", None):  # None: the default, mlp
        calls.clear()
        recomputed = run_index(
            index_config(
                saved_model, data, tmp_path / f"recomputed-{what}", *([f"grads.recompute={what}"] if what else [])
            )
        )
        assert calls and all(
            w == (what or "mlp") and n > 0 for w, n in calls
        )  # every batch ran with its units recomputed
        assert kept["rows"] == recomputed["rows"] == len(ROWS)
        torch.testing.assert_close(
            open_index(tmp_path / f"recomputed-{what}").rows(slice(None)),
            open_index(tmp_path / "kept").rows(slice(None)),
            rtol=1e-5,
            atol=1e-7,
        )
    plans = {
        r: make_plan(index_config(saved_model, data, tmp_path / "p", f"grads.recompute={r}"))[
            "activation_bytes_per_token"
        ]
        for r in ("none", "mlp", "layers")
    }
    assert plans["layers"] < plans["mlp"] < plans["none"]
    with pytest.raises(ConfigError, match="setting 'grads.recompute'='all' is not allowed; use mlp or layers or none"):
        make_plan(index_config(saved_model, data, tmp_path / "p", "grads.recompute=all"))


def test_units_a_wrapper_already_checkpoints_are_left_to_it(tokenizer):
    """An MLP block, or a whole layer, under torch's checkpoint_wrapper (as Lightning's activation
    checkpointing applies it) is not recomputed a second time, and the rows are unchanged."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = make_model(len(tokenizer), hidden=64, layers=3)
    layers = model.model.layers
    layers[0].mlp = checkpoint_wrapper(layers[0].mlp)
    layers[1] = checkpoint_wrapper(layers[1])
    assert recomputed_units(model, "mlp") == [layers[2].mlp]  # layer 0's block is wrapped, layer 1 is
    assert recomputed_units(model, "layers") == [layers[0], layers[2]]
    assert recomputed_units(model, "none") == []
    modules = select_modules(model, ["down_proj"])
    with torch.enable_grad():
        kept, _ = rows_of(model, modules, batch_of(tokenizer), "none")
        for what in ("mlp", "layers"):
            got, _ = rows_of(model, modules, batch_of(tokenizer), what)
            torch.testing.assert_close(got, kept, rtol=1e-6, atol=1e-7)
