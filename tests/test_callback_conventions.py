"""GradientIndexer follows Lightning's conventions: arguments checked at construction, state in
checkpoints (a resumed fit carries on indexing), printing on rank 0 only."""

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from conftest import make_model
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, IndexSpec, open_index
from gradian_lightning.callback import gathered
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.index.session import BatchRows


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"path": ""}, "GradientIndexer(path='') is not allowed; use a non-empty directory path (str or Path)"),
        (
            {"path": "runs/{name}"},
            "GradientIndexer(path='runs/{name}'): the only placeholder a path may hold is {step}",
        ),
        ({"seed": 1.5}, "setting 'grads.seed'=1.5 is not allowed; use an integer"),
        ({"recompute": "all"}, "setting 'grads.recompute'='all' is not allowed; use mlp or layers or none"),
        ({"rows_per_chunk": 0}, "GradientIndexer(rows_per_chunk=0) is not allowed; use None or an integer >= 1"),
        ({"every_n_val_runs": 0}, "GradientIndexer(every_n_val_runs=0) is not allowed; use an integer >= 1"),
        ({"dataloader_idx": -1}, "GradientIndexer(dataloader_idx=-1) is not allowed; use an integer >= 0"),
        ({"model_attribute": ""}, "GradientIndexer(model_attribute='') is not allowed"),
        ({"overwrite": "yes"}, "GradientIndexer(overwrite='yes') is not allowed; use True or False"),
        ({"meta": {"when": float("nan")}}, "GradientIndexer(meta=...) cannot be stored in the index attributes"),
        ({"meta": {"path": Path("x")}}, "GradientIndexer(meta=...) cannot be stored in the index attributes"),
        ({"projection_dim": 2.5}, "setting 'grads.projection_dim'=2.5 is not allowed"),
        ({"module_filter": []}, "setting 'grads.module_filter'=[]: must be a module name pattern"),
    ],
)
def test_bad_arguments_fail_at_construction_with_one_line(kwargs, message):
    with pytest.raises(ConfigError) as err:
        GradientIndexer(**{"path": "ix", **kwargs})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_spec_settings_are_the_index_specs_fields_and_an_unknown_one_is_named():
    """The callback takes IndexSpec's fields as they are declared there: by position after the
    path in field order, or by name; anything else is one line listing every valid name."""
    spec = GradientIndexer("ix", "down_proj", 8, "float32", 3, recompute="none").session.spec
    assert spec == IndexSpec(
        module_filter="down_proj", projection_dim=8, storage_dtype="float32", seed=3, recompute="none"
    )
    for bad in ({"projection_dims": 8}, {"top_k": 3}):
        with pytest.raises(ConfigError) as err:
            GradientIndexer("ix", **bad)
        line = str(err.value)
        assert line.startswith(f"GradientIndexer({next(iter(bad))}=...) is not allowed") and "\n" not in line
        assert all(f.name in line for f in dataclasses.fields(IndexSpec)) and "dataloader_idx" in line
    with pytest.raises(ConfigError, match=r"GradientIndexer\(module_filter=\.\.\.\) is not allowed"):
        GradientIndexer("ix", "down_proj", module_filter="q_proj")  # given twice
    with pytest.raises(ConfigError, match="7 settings after the first argument"):
        GradientIndexer("ix", "down_proj", 8, "float32", 3, "none", None, 1)


def test_a_made_index_spec_is_taken_as_it_is_and_alone():
    """`spec=IndexSpec(...)` (what gradian index passes) is the session's spec; beside its own
    settings, or not an IndexSpec, it is one line."""
    spec = IndexSpec(module_filter="down_proj", projection_dim=8)
    assert GradientIndexer("ix", spec=spec).session.spec is spec
    for args, kwargs in (
        ((), {"spec": {"projection_dim": 8}}),
        (("down_proj",), {"spec": spec}),
        ((), {"spec": spec, "seed": 1}),
    ):
        with pytest.raises(ConfigError) as err:
            GradientIndexer("ix", *args, **kwargs)
        assert str(err.value).startswith("GradientIndexer(spec=") and "use None or an IndexSpec alone" in str(err.value)


class TwoRanks:
    """Two ranks as two threads: `all_gather` swaps their tensors, and, as a real collective
    needs, refuses tensors of other shapes on each rank."""

    def __init__(self):
        self.barrier, self.slots = threading.Barrier(2, timeout=10), [None, None]

    def strategy(self, rank):
        def all_gather(tensor):
            self.slots[rank] = tensor
            self.barrier.wait()
            both = list(self.slots)
            self.barrier.wait()
            assert both[0].shape == both[1].shape, f"rank {rank}: {both[0].shape} against {both[1].shape}"
            return torch.stack(both)

        return SimpleNamespace(all_gather=all_gather)


def batch_rows(ids, first):
    n = len(ids)
    return BatchRows(
        index=torch.arange(first, first + n),
        rows=torch.randn(n, 3),
        loss=torch.randn(n),
        supervised=torch.arange(n),
        truncated=torch.zeros(n, dtype=torch.long),
        wanted=torch.rand(n) > 0.5,
        ids=ids,
    )


def test_ids_cross_ranks_as_utf8_bytes_through_the_strategys_tensor_gather():
    """No torch.distributed object collective: ids of other byte lengths on each rank (several
    bytes a character, none, an inner zero byte) come back whole through a tensors-only all_gather."""
    ranks = TwoRanks()
    batches = [batch_rows(["café ☕", "", "7"], 0), batch_rows(["a\x00b", "x", "sky"], 3)]
    with ThreadPoolExecutor(2) as pool:
        both = [f.result() for f in [pool.submit(gathered, ranks.strategy(r), batches[r]) for r in (0, 1)]]
    for got in both:
        assert got.ids == batches[0].ids + batches[1].ids
        for name, tensor in batches[0].tensors().items():
            assert torch.equal(getattr(got, name), torch.cat([tensor, getattr(batches[1], name)])), name


class FineTune(L.LightningModule):
    def __init__(self, model, crash_at_step=None):
        super().__init__()
        self.model, self.crash_at_step = model, crash_at_step

    def training_step(self, batch, batch_idx):
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def validation_step(self, batch, batch_idx):
        # A crash in the middle of the indexing run of one step (after its first batch).
        if self.global_step == self.crash_at_step and batch_idx == 1:
            raise RuntimeError("killed")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(tmp_path, tokenizer, dataset, crash_at_step=None, ckpt_path=None, epochs=2, every_n_val_runs=1):
    L.seed_everything(0, verbose=False)
    indexer = GradientIndexer(
        str(tmp_path / "ix-{step}"),
        "down_proj",
        projection_dim=4,
        storage_dtype="float32",
        verbose=False,
        every_n_val_runs=every_n_val_runs,
    )
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{step}"
    )  # saved after each validation run
    trainer = L.Trainer(
        callbacks=[indexer, checkpoints],
        max_epochs=epochs,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(dataset, batch_size=2, collate_fn=collate)  # 4 training steps per epoch
    trainer.fit(
        FineTune(make_model(len(tokenizer)), crash_at_step),
        loader,
        DataLoader(dataset, batch_size=3, collate_fn=collate),
        ckpt_path=ckpt_path,
    )
    return indexer


def test_a_fit_resumed_from_a_checkpoint_continues_indexing_where_it_stopped(tmp_path, tokenizer, rows):
    dataset = JsonlDataset(rows, tokenizer, 64)
    whole = fit(tmp_path / "whole", tokenizer, dataset)
    assert [(r["step"], r["rows"], r["complete"]) for r in whole.runs] == [(4, 7, True), (8, 7, True)]

    with pytest.raises(RuntimeError, match="killed"):
        fit(tmp_path / "cut", tokenizer, dataset, crash_at_step=8)  # dies indexing step 8, after the step-4 checkpoint
    assert not open_index(tmp_path / "cut" / "ix-8").meta.complete
    resumed = fit(tmp_path / "cut", tokenizer, dataset, ckpt_path=tmp_path / "cut" / "ckpt" / "step=4.ckpt")
    # The step-4 run comes back from the checkpoint; step 8 is indexed again, from the same weights.
    assert [(r["step"], r["rows"], r["complete"]) for r in resumed.runs] == [(4, 7, True), (8, 7, True)]
    assert resumed.runs[0]["path"] == str(tmp_path / "cut" / "ix-4")
    for step in (4, 8):
        got, want = open_index(tmp_path / "cut" / f"ix-{step}"), open_index(tmp_path / "whole" / f"ix-{step}")
        assert got.meta.complete and got.meta.global_step == step
        np.testing.assert_allclose(got.rows(slice(None)).numpy(), want.rows(slice(None)).numpy(), rtol=1e-5, atol=1e-7)


def test_resuming_past_an_interrupted_indexing_run_says_so(tmp_path, tokenizer, rows):
    """A checkpoint saved before its own step's validation run (every_n_train_steps) resumes after it."""
    dataset = JsonlDataset(rows, tokenizer, 64)

    def run(crash_at_step=None, ckpt_path=None):
        indexer = GradientIndexer(str(tmp_path / "ix-{step}"), "down_proj", projection_dim=4, verbose=False)
        checkpoints = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}"
        )
        trainer = L.Trainer(
            callbacks=[indexer, checkpoints],
            max_steps=8,
            val_check_interval=4,
            num_sanity_val_steps=0,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        loader = DataLoader(dataset, batch_size=1, collate_fn=collate)
        trainer.fit(
            FineTune(make_model(len(tokenizer)), crash_at_step),
            loader,
            DataLoader(dataset, batch_size=3, collate_fn=collate),
            ckpt_path=ckpt_path,
        )

    with pytest.raises(RuntimeError, match="killed"):
        run(crash_at_step=4)
    with pytest.warns(UserWarning, match=r"ix-4 of step 4, where this fit resumes, was left incomplete"):
        run(ckpt_path=tmp_path / "ckpt" / "step=4.ckpt")
    assert not open_index(tmp_path / "ix-4").meta.complete


def test_state_dict_round_trip_and_settings_change_warning(tmp_path):
    a = GradientIndexer(tmp_path / "ix", "down_proj", projection_dim=4)
    a.runs = [{"step": 3, "path": str(tmp_path / "ix"), "rows": 7, "complete": True}]
    b = GradientIndexer(tmp_path / "ix", "down_proj", projection_dim=4)
    b.load_state_dict(a.state_dict())
    assert b.runs == a.runs and b.state_key == a.state_key
    assert (
        GradientIndexer(tmp_path / "other", "down_proj").state_key != a.state_key
    )  # two indexers, two checkpoint entries
    c = GradientIndexer(tmp_path / "ix", "down_proj", projection_dim=8)
    with pytest.warns(UserWarning, match="projection_dim 4 -> 8"):
        c.load_state_dict(a.state_dict())


def test_summary_line_goes_through_lightnings_rank_zero_logger_and_verbose_false_silences_it(
    tmp_path, tokenizer, rows, caplog
):
    dataset = JsonlDataset(rows, tokenizer, 64)
    loader = DataLoader(dataset, batch_size=4, collate_fn=collate)
    module = FineTune(make_model(len(tokenizer)))
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with caplog.at_level(logging.INFO):
        L.Trainer(callbacks=[GradientIndexer(tmp_path / "a", "down_proj", 4)], **kwargs).validate(
            module, loader, verbose=False
        )
        L.Trainer(callbacks=[GradientIndexer(tmp_path / "b", "down_proj", 4, verbose=False)], **kwargs).validate(
            module, loader, verbose=False
        )
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("GradientIndexer:") and r.name == "lightning.pytorch.utilities.rank_zero"
    ]
    assert lines == [f"GradientIndexer: step 0: 7/7 rows in {tmp_path / 'a'} (complete)"]


def test_every_n_val_runs_counts_on_across_a_checkpoint(tmp_path, tokenizer, rows):
    """A resumed fit indexes the same validation runs as an uninterrupted one: the count is in the state."""
    dataset = JsonlDataset(rows, tokenizer, 64)
    whole = fit(tmp_path / "whole", tokenizer, dataset, epochs=4, every_n_val_runs=2)
    assert [r["step"] for r in whole.runs] == [8, 16]  # validation runs 2 and 4 (4 steps an epoch)
    fit(tmp_path / "cut", tokenizer, dataset, epochs=1, every_n_val_runs=2)  # run 1: not indexed, checkpoint at step 4
    resumed = fit(
        tmp_path / "cut",
        tokenizer,
        dataset,
        epochs=4,
        every_n_val_runs=2,
        ckpt_path=tmp_path / "cut" / "ckpt" / "step=4.ckpt",
    )
    # Counting from the checkpoint's one run, the resumed runs at steps 8, 12, 16 are runs 2, 3, 4;
    # counting afresh would index step 12 alone.
    assert [r["step"] for r in resumed.runs] == [8, 16]
