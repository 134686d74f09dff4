"""GradientIndexer inside real Lightning runs: validate writes the right rows; fit is unperturbed."""

import copy

import lightning as L
import numpy as np
import pytest
import torch
from conftest import make_model
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, open_index
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.specs import IndexSpec


class FineTune(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx), batch_size=len(batch["index"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def trainer(tmp_path, callbacks=(), **kwargs):
    args = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    return L.Trainer(callbacks=list(callbacks), **{**args, **kwargs})


@pytest.fixture
def dataset(tokenizer, rows):
    return JsonlDataset(rows, tokenizer, 64)


def loader(dataset, batch_size=3, shuffle=False):
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=collate)


@pytest.mark.parametrize("inference_mode", [True, False])
def test_validate_writes_every_row_at_its_position(tmp_path, model, dataset, inference_mode):
    indexer = GradientIndexer(
        tmp_path / "ix", ["down_proj", "q_proj"], projection_dim=4, storage_dtype="float32", seed=3
    )
    trainer(tmp_path, [indexer], inference_mode=inference_mode).validate(FineTune(model), dataloaders=loader(dataset))
    index = open_index(tmp_path / "ix")
    assert index.meta.complete and len(index) == len(dataset)
    modules = select_modules(model, ["down_proj", "q_proj"])
    with torch.enable_grad():
        want, losses = GradientRows(model, IndexSpec(projection_dim=4, seed=3, recompute="none"), modules)(
            collate(dataset.examples)
        )
    torch.testing.assert_close(index.rows(slice(None)), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(index.column("loss"), losses.numpy(), rtol=1e-5)
    assert list(index.column("id")) == [e.id for e in dataset.examples]
    assert index.column("supervised_tokens").tolist() == [
        sum(t != -100 for t in e.labels[1:]) for e in dataset.examples
    ]
    assert [m.name for m in index.meta.blocks] == list(modules)
    assert indexer.summary["rows"] == len(dataset) and indexer.summary["empty_rows"] == []


def test_progress_bar_shows_rows_rate_and_time_left(tmp_path, model, dataset):
    indexer = GradientIndexer(tmp_path / "ix", "down_proj", projection_dim=4)
    seen = []

    class Watch(L.Callback):  # what the progress bar shows after each batch (the indexer logs first)
        def on_validation_batch_end(self, trainer, *args, **kwargs):
            seen.append(dict(trainer.progress_bar_metrics))

    trainer(tmp_path, [indexer, Watch()]).validate(FineTune(model), dataloaders=loader(dataset, batch_size=3))
    assert [m["gradian_rows"] for m in seen] == [3.0, 6.0, 7.0]
    assert all(m["gradian_rows_per_s"] > 0 for m in seen)
    first = seen[0]  # 4 rows left at the measured rate
    assert (
        first["gradian_eta_s"] == pytest.approx(4 / first["gradian_rows_per_s"], rel=1e-5)
        and seen[-1]["gradian_eta_s"] == 0
    )


def snapshot(module, optimizer):
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "grads": {k: None if p.grad is None else p.grad.clone() for k, p in module.named_parameters()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "training": [m.training for m in module.modules()],
        "rng": torch.get_rng_state(),
    }


def fit_once(tmp_path, tokenizer, dataset, with_indexer):
    L.seed_everything(7, verbose=False)
    model = make_model(len(tokenizer)).train()
    model.config.attention_dropout = 0.1  # training consumes RNG: a perturbed stream would show
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    module = FineTune(model)
    callbacks = [GradientIndexer(tmp_path / "ix-step{step}", "down_proj", 4, overwrite=True)] if with_indexer else []
    t = trainer(tmp_path, callbacks, max_epochs=2, num_sanity_val_steps=2)
    t.fit(module, train_dataloaders=loader(dataset, 2, shuffle=True), val_dataloaders=loader(dataset))
    return snapshot(module, t.optimizers[0]), t


def test_fit_is_bit_identical_with_and_without_the_indexer(tmp_path, tokenizer, dataset):
    plain, _ = fit_once(tmp_path / "a", tokenizer, dataset, False)
    indexed, t = fit_once(tmp_path / "b", tokenizer, dataset, True)
    for key in plain["weights"]:
        assert torch.equal(plain["weights"][key], indexed["weights"][key]), key
    for key, grad in plain["grads"].items():
        assert (grad is None and indexed["grads"][key] is None) or torch.equal(grad, indexed["grads"][key]), key
    assert plain["training"] == indexed["training"]
    assert torch.equal(plain["rng"], indexed["rng"])
    for (ka, va), (_kb, vb) in zip(plain["optimizer"]["state"].items(), indexed["optimizer"]["state"].items()):
        assert all(torch.equal(va[n], vb[n]) for n in va), ka
    # one index per validation run, none for the sanity check (which runs at step 0)
    steps = sorted(p.name for p in (tmp_path / "b").glob("ix-step*"))
    assert steps == ["ix-step4", "ix-step8"] and t.global_step == 8
    assert open_index(tmp_path / "b" / "ix-step8").meta.global_step == 8


def test_rerun_of_a_complete_index_does_no_work(tmp_path, model, dataset):
    trainer(tmp_path, [GradientIndexer(tmp_path / "ix", "down_proj", 4)]).validate(
        FineTune(model), dataloaders=loader(dataset)
    )
    before = open_index(tmp_path / "ix").rows(slice(None))
    calls = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: calls.append(1))
    indexer = GradientIndexer(tmp_path / "ix", "down_proj", 4)
    trainer(tmp_path, [indexer]).validate(FineTune(model), dataloaders=loader(dataset))
    handle.remove()
    assert len(calls) == len(loader(dataset))  # only the module's own validation forwards ran
    assert torch.equal(open_index(tmp_path / "ix").rows(slice(None)), before) and indexer.summary["complete"]
