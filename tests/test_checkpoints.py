"""Several checkpoints in one index: built during fit, read with plain zarr, scores summed by LR."""

import copy

import lightning as L
import numpy as np
import pytest
import torch
import zarr
from test_callback import FineTune, loader, trainer

from gradian_lightning import GradientIndexer, open_index, query_gradients
from gradian_lightning.errors import ConfigError, IndexMismatchError
from gradian_lightning.index.checkpoints import checkpoint_weights
from gradian_lightning.saved_models import saved_models


class DecayingFineTune(FineTune):
    """Learning rate halves every step, so each checkpoint has its own weight."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "step"},
        }


class Snapshots(L.Callback):
    """The model's weights at each validation run, by global step (what a query needs per checkpoint)."""

    def __init__(self):
        self.weights = {}

    def on_validation_epoch_end(self, trainer, pl_module):
        self.weights[trainer.global_step] = copy.deepcopy(pl_module.model.state_dict())


@pytest.fixture
def dataset(tokenizer, rows):
    from gradian_lightning.data import JsonlDataset

    return JsonlDataset(rows, tokenizer, 64)


def fit(tmp_path, model, dataset, **indexer_kwargs):
    indexer = GradientIndexer(
        tmp_path / "ix",
        module_filter=["down_proj", "o_proj"],
        projection_dim=4,
        storage_dtype="float32",
        checkpoints=True,
        **indexer_kwargs,
    )
    snapshots = Snapshots()
    t = trainer(tmp_path, [indexer, snapshots], max_epochs=3, num_sanity_val_steps=0)
    t.fit(DecayingFineTune(model), train_dataloaders=loader(dataset, 4), val_dataloaders=loader(dataset))
    return snapshots.weights


def query_rows_at(index, model, tokenizer, rows, weights):
    out = {}
    for step, state in weights.items():
        model.load_state_dict(state)
        out[step] = query_gradients(index.at(step), model, tokenizer, rows)
    return out


def test_checkpoint_sum_equals_lr_weighted_single_checkpoint_scores(tmp_path, model, tokenizer, dataset, rows):
    weights = fit(tmp_path, model, dataset)
    index = open_index(tmp_path / "ix")
    steps = [e["step"] for e in index.checkpoints]
    assert steps == sorted(weights) and len(steps) == 3 and index.step == steps[-1]
    lrs = [e["lr"] for e in index.checkpoints]
    assert len(set(lrs)) == 3 and all(e["complete"] for e in index.checkpoints)
    group = zarr.open_group(str(tmp_path / "ix"), mode="r")  # plain zarr shows where each checkpoint lives
    for e in index.checkpoints:
        assert group[e["group"]]["grads"].shape == (len(dataset), index.meta.width)
    queries = query_rows_at(index, model, tokenizer, rows[:3], weights)
    n = len(index)
    for precondition in ("none", "diag"):
        dense = sum(
            lr / sum(lrs) * _all_scores(index.at(step).topk(queries[step], k=n, precondition=precondition), n)
            for step, lr in zip(steps, lrs)
        )
        together = _all_scores(index.topk(queries, k=n, checkpoints="all", precondition=precondition), n)
        np.testing.assert_allclose(together, dense, rtol=1e-5, atol=1e-6)
        two = _all_scores(index.topk(queries, k=n, checkpoints=steps[:2], precondition=precondition), n)
        np.testing.assert_allclose(
            two,
            sum(
                lr / sum(lrs[:2]) * _all_scores(index.at(s).topk(queries[s], k=n, precondition=precondition), n)
                for s, lr in zip(steps[:2], lrs[:2])
            ),
            rtol=1e-5,
            atol=1e-6,
        )
    last = _all_scores(index.topk(queries, k=n, checkpoints="last"), n)
    np.testing.assert_allclose(last, _all_scores(index.topk(queries[steps[-1]], k=n), n), rtol=1e-6)
    with pytest.raises(ConfigError, match="query.checkpoints"):
        index.topk(queries, k=2, checkpoints=[12345])
    with pytest.raises(IndexMismatchError, match="checkpoints"):
        index.topk({steps[0]: queries[steps[0]]}, k=2, checkpoints="all")


def _all_scores(top, n):
    out = torch.zeros(len(top.indices), n, dtype=torch.float64)
    out.scatter_(1, top.indices, top.scores.double())
    return out.numpy()


def test_every_n_val_runs_and_a_one_checkpoint_index(tmp_path, model, tokenizer, dataset, rows):
    weights = fit(tmp_path, model, dataset, every_n_val_runs=2)
    index = open_index(tmp_path / "ix")
    assert len(index.checkpoints) == 1 and index.step == sorted(weights)[1]  # runs 2 only (of 3)
    # an index written without checkpoints (every index before them) is its own single checkpoint
    plain = GradientIndexer(tmp_path / "plain", module_filter="down_proj", projection_dim=4, storage_dtype="float32")
    with pytest.raises(ConfigError, match="every_n_val_runs"):
        GradientIndexer(tmp_path / "x", every_n_val_runs=0)
    trainer(tmp_path, [plain]).validate(FineTune(model), dataloaders=loader(dataset))
    one = open_index(tmp_path / "plain")
    assert [e["group"] for e in one.checkpoints] == [""] and one.at(one.step).meta == one.meta
    q = query_gradients(one, model, tokenizer, rows[:2])
    np.testing.assert_allclose(
        _all_scores(one.topk({one.step: q}, k=len(one), checkpoints="all"), len(one)),
        _all_scores(one.topk(q, k=len(one)), len(one)),
    )
    with pytest.raises(ConfigError, match="one-checkpoint"):
        t = trainer(
            tmp_path,
            [
                GradientIndexer(
                    tmp_path / "plain",
                    module_filter="down_proj",
                    projection_dim=4,
                    storage_dtype="float32",
                    checkpoints=True,
                )
            ],
        )
        t.validate(FineTune(model), dataloaders=loader(dataset))


def test_index_and_query_a_base_and_its_fine_tune_from_saved_models(tmp_path, tokenizer, rows, saved_model, capsys):
    from conftest import make_model, write_jsonl

    from gradian_lightning.cli import main

    tuned = tmp_path / "tuned"
    make_model(len(tokenizer), seed=1).save_pretrained(tuned)
    tokenizer.save_pretrained(tuned)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    queries = write_jsonl(tmp_path / "queries.jsonl", rows[:2])
    common = [
        "configs/smollm2.yaml",
        f"model.name_or_path={tuned}",
        f"model.checkpoints=[{saved_model},{tuned}]",
        f"index.path={tmp_path / 'ix'}",
        "grads.storage_dtype=float32",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(["index", *common, f"data.train={data}"]) == 0
    index = open_index(tmp_path / "ix")
    assert [e["step"] for e in index.checkpoints] == [0, 1] and [e["lr"] for e in index.checkpoints] == [None, None]
    # One predicted total, of both checkpoints' arrays; then a summary of each checkpoint and of the whole index.
    out = capsys.readouterr().out.splitlines()
    from gradian_lightning.gradients.memory import human_bytes
    from gradian_lightning.index.location import Location

    arrays = 0
    for step in (0, 1):
        group = zarr.open_group(str(tmp_path / "ix" / "checkpoints" / f"step-{step}"), mode="r")
        arrays += group["grads"].nbytes + group["norms"].nbytes
        arrays += sum(a.nbytes for a in group["statistics"].array_values())
    predicted = [line for line in out if "predicted for" in line]
    assert predicted == [
        f"gradian index: {len(rows)} rows × 2 checkpoints × 6 modules, row width 6,144 (float32) -> {human_bytes(arrays)} predicted for {tmp_path / 'ix'}"
    ]
    whole = Location(tmp_path / "ix").bytes_on_disk()
    assert out[1:4] == [
        f"gradian index: 2 checkpoints (steps 0, 1) written to {tmp_path / 'ix'} (complete)",
        f"  bytes on disk: {whole:,} (the whole index)",
        f"  step 0: {len(rows)}/{len(rows)} rows (complete)",
    ]
    assert f"  step 1: {len(rows)}/{len(rows)} rows (complete)" in out
    assert index.at(0).meta.model["name_or_path"] == str(saved_model) and index.meta.model["name_or_path"] == str(tuned)
    assert (
        main(
            [
                "query",
                *common,
                f"query.data={queries}",
                "query.checkpoints=all",
                "query.method=index",
                f"query.output={tmp_path / 'all.jsonl'}",
                f"query.top_k={len(rows)}",
            ]
        )
        == 0
    )
    import json

    got = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    # no learning rates recorded: the two checkpoints' scores are averaged with equal weights
    from transformers import AutoModelForCausalLM

    per = []
    for step, path in ((0, saved_model), (1, tuned)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        q = query_gradients(index.at(step), model, tokenizer, rows[:2])
        per.append(_all_scores(index.at(step).topk(q, k=len(rows)), len(rows)))
    expected = (per[0] + per[1]) / 2
    for qi, result in enumerate(got):
        for r in result["results"]:
            assert abs(r["score"] - expected[qi, r["index"]]) < 1e-4


class LinearDecayToZero(FineTune):
    """SGD whose rate falls linearly to 0 over the fit (LinearLR stepped after every optimizer step),
    the most common fine-tuning schedule. `training_step` notes the rate each optimizer step trains
    at, keyed by the global step that step makes: the record the indexer's is checked against."""

    def __init__(self, model, total_steps, tensor_lr=False):
        super().__init__(model)
        self.total_steps, self.tensor_lr, self.used = total_steps, tensor_lr, {}

    def training_step(self, batch, batch_idx):
        # global_step counts the steps taken: this batch's makes global_step + 1 (validation_step
        # calls training_step too: not a step)
        if self.trainer.training:
            self.used[self.trainer.global_step + 1] = float(self.optimizers().param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        # A tensor rate, as capturable optimizers take, is updated in place by the scheduler.
        optimizer = torch.optim.SGD(self.parameters(), lr=torch.tensor(0.5) if self.tensor_lr else 0.5)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit_decaying(
    tmp_path, model, dataset, epochs=3, every_n_val_runs=1, callbacks=(), tensor_lr=False, **trainer_kwargs
):
    """A fit of `epochs` epochs of 4 steps each under `LinearDecayToZero`, indexed at every
    `every_n_val_runs`-th validation run: (the index, the rate of each step, the indexer)."""
    indexer = GradientIndexer(
        tmp_path / "ix",
        module_filter="down_proj",
        projection_dim=4,
        storage_dtype="float32",
        checkpoints=True,
        every_n_val_runs=every_n_val_runs,
    )
    module = LinearDecayToZero(model, total_steps=4 * epochs, tensor_lr=tensor_lr)
    trainer(tmp_path, [indexer, *callbacks], max_epochs=epochs, num_sanity_val_steps=0, **trainer_kwargs).fit(
        module, train_dataloaders=loader(dataset, 2), val_dataloaders=loader(dataset)
    )
    return open_index(tmp_path / "ix"), module.used, indexer


def segment_means(used, steps):
    """The mean rate of the steps after the checkpoint before each of `steps` (from step 1 for the first), up to it."""
    return [np.mean([used[k] for k in range(after + 1, step + 1)]) for after, step in zip([0, *steps[:-1]], steps)]


@pytest.mark.parametrize("every_n_val_runs, tensor_lr", [(1, False), (2, False), (1, True)])
def test_each_checkpoint_weighs_by_the_rates_of_the_steps_that_made_it(
    tmp_path, model, dataset, every_n_val_runs, tensor_lr
):
    index, used, indexer = fit_decaying(
        tmp_path, model, dataset, epochs=4, every_n_val_runs=every_n_val_runs, tensor_lr=tensor_lr
    )
    assert sorted(used) == list(range(1, 17)) and used[16] > 0  # 16 steps, the last at 0.5 / 16
    steps = [e["step"] for e in index.checkpoints]
    assert steps == [4, 8, 12, 16][every_n_val_runs - 1 :: every_n_val_runs]
    # Each checkpoint's rate is the mean of those its segment's steps trained at, not the rate the
    # scheduler has set for the next step by the validation run (0 after the last step), nor the
    # last step's alone (0.5 / 16 at the end): the fine-tuned model keeps its share of the sum.
    want = segment_means(used, steps)
    assert [e["lr"] for e in index.checkpoints] == [pytest.approx(w, rel=1e-12) for w in want]
    weights = checkpoint_weights(index.checkpoints, "all")
    assert weights[-1][1] == pytest.approx(want[-1] / sum(want))
    if every_n_val_runs == 1:  # the last step's rate alone would give it 3.4% of the sum, the next step's 0
        assert weights[-1][1] == pytest.approx(0.0735, abs=1e-4)
    # A Lightning checkpoint saved now holds the segment so far (here: none since the last run), to sum on after a resume.
    assert indexer.state_dict()["lr_steps"] == 0 and indexer.state_dict()["lr"] == pytest.approx(want[-1])


def test_accumulated_batches_are_one_step_at_one_rate(tmp_path, model, dataset):
    """accumulate_grad_batches=2: two batches make one optimizer step, counted once in its segment."""
    index, used, _ = fit_decaying(tmp_path, model, dataset, epochs=3, accumulate_grad_batches=2)
    assert sorted(used) == [1, 2, 3, 4, 5, 6]  # 4 batches an epoch, 2 steps
    steps = [e["step"] for e in index.checkpoints]
    assert steps == [2, 4, 6]
    assert [e["lr"] for e in index.checkpoints] == [pytest.approx(w, rel=1e-12) for w in segment_means(used, steps)]


def test_ckpt_files_of_the_same_fit_give_their_segments_rates(tmp_path, model, dataset):
    """`model.checkpoints` listing the .ckpt files ModelCheckpoint saved after each validation run:
    a .ckpt holds the rate of the step after it (the scheduler has stepped), so each segment's mean
    is interpolated from the .ckpt before it: exact under LinearLR, as the callback records it; the
    first, with no .ckpt before it, has the rate of the step after it."""
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{step}")
    index, used, _ = fit_decaying(tmp_path, model, dataset, epochs=4, callbacks=[saver], enable_checkpointing=True)
    steps = [e["step"] for e in index.checkpoints]
    ckpts = [str(tmp_path / "ckpt" / f"step={s}.ckpt") for s in steps]
    listed = saved_models(ckpts)
    assert [s.step for s in listed] == steps == [4, 8, 12, 16]
    want = segment_means(used, steps)
    assert [s.lr for s in listed[1:]] == [pytest.approx(w, rel=1e-9) for w in want[1:]]
    assert [e["lr"] for e in index.checkpoints[1:]] == [pytest.approx(s.lr, rel=1e-9) for s in listed[1:]]
    assert listed[0].lr == pytest.approx(used[5])  # all step=4.ckpt knows: 0.375 against the segment's 0.453
    assert listed[-1].lr > 0  # the last file holds 0, the rate after a decay to 0


def test_a_resumed_fit_sums_the_segments_steps_from_before_the_resume(tmp_path, tokenizer, dataset):
    """Stopped at step 6 (a .ckpt saved there, mid-segment) and resumed: the checkpoint at step 8 weighs
    by the mean rate of steps 5-8, the two before the resume summed in the indexer's state in the .ckpt."""
    from conftest import make_model

    def run(ckpt_path=None, **trainer_kwargs):
        indexer = GradientIndexer(
            tmp_path / "ix", module_filter="down_proj", projection_dim=4, storage_dtype="float32", checkpoints=True
        )
        saver = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}"
        )
        module = LinearDecayToZero(make_model(len(tokenizer)), total_steps=16)
        fit = trainer(tmp_path, [indexer, saver], num_sanity_val_steps=0, enable_checkpointing=True, **trainer_kwargs)
        fit.fit(module, loader(dataset, 2), loader(dataset), ckpt_path=ckpt_path)
        return module.used

    used = run(max_steps=6)
    assert sorted(used) == [1, 2, 3, 4, 5, 6] and (tmp_path / "ckpt" / "step=6.ckpt").is_file()
    used.update(run(ckpt_path=str(tmp_path / "ckpt" / "step=6.ckpt"), max_epochs=2))
    assert sorted(used) == list(range(1, 9))
    index = open_index(tmp_path / "ix")
    assert [e["step"] for e in index.checkpoints] == [4, 8]
    assert [e["lr"] for e in index.checkpoints] == [pytest.approx(w, rel=1e-12) for w in segment_means(used, [4, 8])]


def test_an_older_index_with_a_zero_rate_is_read_and_said():
    """An index GradientIndexer wrote before segment rates holds the next step's rate: 0 for the last
    checkpoint of a decay to 0. It is read as it is, and a sum that gives a checkpoint no weight says so."""
    old = [{"step": 4, "lr": 0.3333}, {"step": 8, "lr": 0.1667}, {"step": 12, "lr": 0.0}]
    with pytest.warns(UserWarning, match=r"sums checkpoints \[12\], whose recorded learning rate is 0"):
        weights = checkpoint_weights(old, "all")
    assert [w for _, w in weights] == pytest.approx([0.3333 / 0.5, 0.1667 / 0.5, 0.0])
    assert [w for _, w in checkpoint_weights(old, [4, 8])] == pytest.approx([0.3333 / 0.5, 0.1667 / 0.5])
