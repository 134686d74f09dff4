"""HFGradientIndexer inside real Hugging Face Trainer runs: the rows are IndexSession's, bit for bit, and training is unperturbed."""

import copy
import types

import numpy as np
import pytest
import torch
from conftest import make_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from gradian_lightning import HFGradientIndexer, IndexSession, IndexSpec, open_index
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.hf_callback import batch_starts, check_sharding, trainer_collate
from gradian_lightning.saved_models import saved_models

SETTINGS = {"module_filter": ["down_proj", "q_proj"], "projection_dim": 4, "storage_dtype": "float32", "seed": 3}


@pytest.fixture
def dataset(tokenizer, rows):
    return JsonlDataset(rows, tokenizer, 64)


class Snapshots(TrainerCallback):
    """At each evaluation and save: the weights, and what training must find untouched (`.grad`,
    train/eval mode, the global RNG), keyed by global step."""

    def __init__(self):
        self.seen = {}

    def _note(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.seen[state.global_step] = {
            "weights": copy.deepcopy(model.state_dict()),
            "grads": {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
            "training": [m.training for m in model.modules()],
            "rng": torch.get_rng_state(),
        }

    on_evaluate = on_save = _note


def train(tmp_path, tokenizer, dataset, callbacks, dropout=0.0, resume=None, **arguments):
    """A 4-step CPU fine-tune of the tiny Llama (batch 2, AdamW, linear decay), evaluated every 2 steps."""
    model = make_model(len(tokenizer)).train()
    model.config.attention_dropout = dropout  # training consumes RNG: a perturbed stream would show
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = dropout
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_steps=4,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=7,
    )
    args = TrainingArguments(**{**defaults, **arguments})
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset,
        data_collator=trainer_collate,
        callbacks=list(callbacks),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged_rates(trainer):
    """The rate each step trained at, as the Trainer logged it (logging_steps=1): the independent record."""
    return {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}


def segment_means(rates, steps):
    """The mean rate of the steps after the checkpoint before each of `steps` (from step 1 for the first), up to it."""
    return [np.mean([rates[k] for k in range(after + 1, step + 1)]) for after, step in zip([0, *steps[:-1]], steps)]


def session_rows(tmp_path, tokenizer, dataset, weights, batch_size, step=0, lr=None, autocast=None, **settings):
    """The index IndexSession writes from the same batches (the dataset in order) at `weights`."""
    model = make_model(len(tokenizer))
    model.load_state_dict(weights)
    path = tmp_path / f"session-{step}-{autocast}"
    session = IndexSession(IndexSpec(**{**SETTINGS, **settings}), path)
    session.bind(model)
    session.begin(len(dataset), step, lr)
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        session.add(batch, torch.autocast("cpu", dtype=autocast) if autocast else None)
    session.finish()
    return open_index(path)


def assert_same_rows(index, reference):
    assert torch.equal(index.rows(slice(None)), reference.rows(slice(None)))
    for column in ("loss", "supervised_tokens", "id"):
        np.testing.assert_array_equal(index.column(column), reference.column(column))


def test_each_evaluation_writes_the_rows_index_session_writes(tmp_path, tokenizer, dataset):
    indexer = HFGradientIndexer(tmp_path / "ix-step{step}", dataset, batch_size=3, **SETTINGS)
    snapshots = Snapshots()
    trainer = train(tmp_path, tokenizer, dataset, [indexer, snapshots])
    trainer.eval_dataset = {"a": dataset, "b": dataset}  # two evaluations at one step: indexed once
    trainer.evaluate()
    assert [r["step"] for r in indexer.runs] == [2, 4] and all(r["complete"] for r in indexer.runs)
    assert sorted(snapshots.seen) == [2, 4]
    for step in (2, 4):
        index = open_index(tmp_path / f"ix-step{step}")
        assert index.meta.global_step == step and len(index) == len(dataset)
        assert_same_rows(index, session_rows(tmp_path, tokenizer, dataset, snapshots.seen[step]["weights"], 3, step))
    # The weights moved between the two evaluations, so the rows did too.
    assert not torch.equal(
        open_index(tmp_path / "ix-step2").rows(slice(None)), open_index(tmp_path / "ix-step4").rows(slice(None))
    )


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_each_save_is_one_checkpoint_with_its_learning_rate(tmp_path, tokenizer, dataset, gradient_checkpointing):
    indexer = HFGradientIndexer(tmp_path / "ix", dataset, at="save", batch_size=4, checkpoints=True, **SETTINGS)
    snapshots = Snapshots()
    saves = {"save_steps": 2, "save_strategy": "steps", "save_only_model": True}
    # The Trainer's activation checkpointing (a training-mode path of the decoder layers) changes no row.
    trainer = train(
        tmp_path, tokenizer, dataset, [indexer, snapshots], gradient_checkpointing=gradient_checkpointing, **saves
    )
    index = open_index(tmp_path / "ix")
    # Saves at steps 2 and 4; the evaluations at the same steps index nothing (at="save").
    # Linear decay to 0 after step 4 (steps at 0.01, 0.0075, 0.005, 0.0025): each checkpoint weighs
    # by the mean rate of the steps since the one before, not the next step's (0 for the last, which
    # would drop it from the sum), nor its last step's alone.
    rates = logged_rates(trainer)
    assert [rates[s] for s in (1, 2, 3, 4)] == [0.01, 0.0075, 0.005, 0.0025]
    assert [e["step"] for e in index.checkpoints] == [2, 4]
    assert [e["lr"] for e in index.checkpoints] == pytest.approx(segment_means(rates, [2, 4]), rel=1e-12)
    assert index.meta.complete and len(indexer.runs) == 2
    for step in (2, 4):
        reference = session_rows(tmp_path, tokenizer, dataset, snapshots.seen[step]["weights"], 4, step)
        assert_same_rows(index.at(step), reference)


def test_model_checkpoints_key_trainer_checkpoint_dirs_as_the_callback_does(tmp_path, tokenizer, dataset):
    """`model.checkpoints` listing the Trainer's own checkpoint-<step> directories keys each by the
    global step in its trainer_state.json, with the mean of the learning rates the Trainer logged
    since the entry before it: what HFGradientIndexer(checkpoints=True) records at the same saves."""
    indexer = HFGradientIndexer(tmp_path / "ix", dataset, at="save", batch_size=4, checkpoints=True, **SETTINGS)
    every_other = HFGradientIndexer(
        tmp_path / "ix2", dataset, at="save", batch_size=4, checkpoints=True, every_n=2, verbose=False, **SETTINGS
    )
    saves = {"save_steps": 2, "save_strategy": "steps", "save_only_model": True}
    trainer = train(tmp_path, tokenizer, dataset, [indexer, every_other], **saves)
    folders = [str(tmp_path / "out" / f"checkpoint-{s}") for s in (2, 4)]
    listed = saved_models([str(tmp_path / "base"), *folders])
    recorded = [(e["step"], e["lr"]) for e in open_index(tmp_path / "ix").checkpoints]
    assert recorded == [
        (s, pytest.approx(m, rel=1e-12)) for s, m in zip((2, 4), segment_means(logged_rates(trainer), [2, 4]))
    ]
    assert [(s.step, s.lr) for s in listed] == [(0, None), *recorded]  # a plain directory first: step 0, no rate
    # Listed alone, the last is its segment since the start: what every_n=2 records.
    assert [(e["step"], e["lr"]) for e in open_index(tmp_path / "ix2").checkpoints] == [
        (4, pytest.approx(np.mean([0.01, 0.0075, 0.005, 0.0025]), rel=1e-12))
    ]
    assert saved_models(folders[1:])[0].lr == pytest.approx(np.mean([0.01, 0.0075, 0.005, 0.0025]), rel=1e-12)
    with pytest.raises(ConfigError, match="oldest first") as e:
        saved_models(folders[::-1])
    assert "model.checkpoints" in str(e.value) and "\n" not in str(e.value)
    state = tmp_path / "out" / "checkpoint-4" / "trainer_state.json"
    state.write_text("{not json")
    with pytest.raises(ConfigError, match="trainer_state.json cannot be read") as e:
        saved_models(folders)
    assert "\n" not in str(e.value)
    state.write_text(
        '{"global_step": 4, "log_history": [{"step": 2, "learning_rate": 0.5}, {"step": "?", "learning_rate": 9}]}'
    )
    assert saved_models(folders)[1].lr == 0.5  # a log entry without a numeric step is not the step's rate
    state.write_text('{"log_history": []}')
    with pytest.raises(ConfigError, match="holds no global_step"):
        saved_models(folders)


class Killed(Exception):
    pass


class KilledOnce(HFGradientIndexer):
    """Dies after its first batch at `step`: a machine lost while the index of that save was written."""

    def __init__(self, *args, step, **kwargs):
        super().__init__(*args, **kwargs)
        self.step = step

    def _compute(self, model, args, rank, world):
        for i, computed in enumerate(super()._compute(model, args, rank, world)):
            if i == 1 and self._last_step == self.step:
                raise Killed
            yield computed


def test_a_save_killed_while_indexing_is_finished_when_training_resumes_past_it(tmp_path, tokenizer, dataset):
    saving = {"at": "save", "batch_size": 3, "checkpoints": True, **SETTINGS}
    snapshots = Snapshots()  # first: it sees the save the indexer dies in
    with pytest.raises(Killed):
        train(
            tmp_path,
            tokenizer,
            dataset,
            [snapshots, KilledOnce(tmp_path / "ix", dataset, step=2, **saving)],
            save_strategy="steps",
            save_steps=2,
            eval_strategy="no",
        )
    assert [(e["step"], e["complete"]) for e in open_index(tmp_path / "ix").checkpoints] == [(2, False)]
    assert (tmp_path / "out" / "checkpoint-2").is_dir()  # saved before its index: the resume starts after it

    indexer = HFGradientIndexer(tmp_path / "ix", dataset, **saving)
    resumed = train(
        tmp_path,
        tokenizer,
        dataset,
        [indexer],
        resume=str(tmp_path / "out" / "checkpoint-2"),
        save_strategy="steps",
        save_steps=2,
        eval_strategy="no",
    )
    assert resumed.state.global_step == 4 and [r["step"] for r in indexer.runs] == [2, 4]
    assert indexer.session.summaries[0]["computed_rows"] == 4  # the first batch's 3 rows were kept
    index = open_index(tmp_path / "ix")
    # Each checkpoint's segment: steps 1-2 before the kill, 3-4 after the resume.
    assert [(e["step"], e["lr"], e["complete"]) for e in index.checkpoints] == [
        (2, pytest.approx((0.01 + 0.0075) / 2, rel=1e-12), True),
        (4, pytest.approx((0.005 + 0.0025) / 2, rel=1e-12), True),
    ]
    reference = session_rows(tmp_path, tokenizer, dataset, snapshots.seen[2]["weights"], 3, 2)
    assert_same_rows(index.at(2), reference)


@pytest.mark.parametrize("at", ["evaluate", "save"])
def test_training_is_bit_identical_with_and_without_the_indexer(tmp_path, tokenizer, dataset, at):
    # Saves without evaluations find the model in train mode, evaluations in eval mode: both must stay so.
    events = {"evaluate": {}, "save": {"eval_strategy": "no", "save_strategy": "steps", "save_steps": 2}}[at]
    runs = {}
    for name, with_indexer in (("plain", False), ("indexed", True)):
        watch = Snapshots()  # after the indexer: what training finds when the indexer is done
        indexer = HFGradientIndexer(tmp_path / name / "ix-{step}", dataset, "down_proj", 4, at=at, batch_size=3)
        callbacks = [indexer, watch] if with_indexer else [watch]
        trainer = train(tmp_path / name, tokenizer, dataset, callbacks, dropout=0.1, save_only_model=True, **events)
        runs[name] = {
            "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            "eval_losses": [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log],
            "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
            "rng": torch.get_rng_state(),
            "seen": watch.seen,
        }
    plain, indexed = runs["plain"], runs["indexed"]
    assert len(plain["losses"]) == 4 and plain["losses"] == indexed["losses"]
    assert plain["eval_losses"] == indexed["eval_losses"] and len(plain["eval_losses"]) == (
        2 if at == "evaluate" else 0
    )
    assert all(torch.equal(plain["weights"][k], indexed["weights"][k]) for k in plain["weights"])
    for key, state in plain["optimizer"]["state"].items():
        assert all(torch.equal(state[n], indexed["optimizer"]["state"][key][n]) for n in state), key
    assert torch.equal(plain["rng"], indexed["rng"])
    assert sorted(plain["seen"]) == sorted(indexed["seen"]) == [2, 4]
    for step, before in plain["seen"].items():
        after = indexed["seen"][step]
        assert before["training"] == after["training"] and all(before["training"]) == (at == "save")
        assert torch.equal(before["rng"], after["rng"])
        for key, grad in before["grads"].items():
            assert (grad is None and after["grads"][key] is None) or torch.equal(grad, after["grads"][key]), key
    assert open_index(tmp_path / "indexed" / "ix-4").meta.complete


def test_evaluate_alone_indexes_the_current_weights_and_every_n_skips(tmp_path, tokenizer, dataset):
    model = make_model(len(tokenizer))
    indexer = HFGradientIndexer(tmp_path / "ix", dataset, verbose=False, **SETTINGS)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], disable_tqdm=True)
    Trainer(model=model, args=args, eval_dataset=dataset, data_collator=trainer_collate, callbacks=[indexer]).evaluate()
    (run,) = indexer.runs
    assert run == {"step": 0, "path": str(tmp_path / "ix"), "rows": 7, "complete": True, "seconds": run["seconds"]}
    assert run["seconds"] > 0
    reference = session_rows(tmp_path, tokenizer, dataset, model.state_dict(), 4)
    assert_same_rows(open_index(tmp_path / "ix"), reference)

    every_other = HFGradientIndexer(tmp_path / "ix-{step}", dataset, every_n=2, verbose=False, **SETTINGS)
    train(tmp_path / "t", tokenizer, dataset, [every_other], eval_steps=1)
    assert [r["step"] for r in every_other.runs] == [2, 4]
    assert sorted(p.name for p in tmp_path.glob("ix-*")) == ["ix-2", "ix-4"]


def test_rows_are_made_under_the_trainers_mixed_precision(tmp_path, tokenizer, dataset):
    # accelerate wraps the model's forward in its autocast, but a chunked loss runs the decoder
    # without that forward: only the callback's own autocast puts it in bf16 there.
    chunked = {"loss_chunk_tokens": 4}
    model = make_model(len(tokenizer))
    indexer = HFGradientIndexer(tmp_path / "ix", dataset, verbose=False, **SETTINGS, **chunked)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, report_to=[], disable_tqdm=True)
    Trainer(model=model, args=args, eval_dataset=dataset, data_collator=trainer_collate, callbacks=[indexer]).evaluate()
    rows = open_index(tmp_path / "ix").rows(slice(None))
    bf16 = session_rows(tmp_path, tokenizer, dataset, model.state_dict(), 4, autocast=torch.bfloat16, **chunked)
    assert torch.equal(rows, bf16.rows(slice(None)))
    fp32 = session_rows(tmp_path, tokenizer, dataset, model.state_dict(), 4, **chunked).rows(slice(None))
    assert not torch.equal(rows, fp32) and torch.allclose(rows, fp32, rtol=0.1, atol=0.1 * fp32.abs().max())


def test_one_callback_in_two_trainings_indexes_both(tmp_path, tokenizer, dataset):
    indexer = HFGradientIndexer(tmp_path / "ix-{step}", dataset, verbose=False, **SETTINGS)
    train(tmp_path / "first", tokenizer, dataset, [indexer])
    # The second counts its steps from 0 again: its one evaluation, at step 4, is the first's last step.
    train(tmp_path / "second", tokenizer, dataset, [indexer], eval_steps=4)
    assert [s["step"] for s in indexer.session.summaries] == [2, 4, 4]
    assert [r["step"] for r in indexer.runs] == [2, 4]  # a step's newest run replaces its entry


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"at": "predict"}, "HFGradientIndexer(at='predict') is not allowed; use 'evaluate'"),
        ({"batch_size": 0}, "HFGradientIndexer(batch_size=0) is not allowed; use an integer >= 1"),
        ({"every_n": 0}, "HFGradientIndexer(every_n=0) is not allowed; use an integer >= 1"),
        ({"collate_fn": "collate"}, "HFGradientIndexer(collate_fn='collate') is not allowed"),
        ({"verbose": "yes"}, "HFGradientIndexer(verbose='yes') is not allowed; use True or False"),
        ({"dataset": iter([1, 2])}, "HFGradientIndexer(dataset=...) needs a map-style dataset with a length"),
        ({"dataloader_idx": 1}, "HFGradientIndexer(dataloader_idx=...) is not allowed"),
        ({"spec": IndexSpec(), "seed": 1}, "HFGradientIndexer(spec=IndexSpec("),
        ({"rows_per_chunk": 0}, "HFGradientIndexer(rows_per_chunk=0) is not allowed; use None or an integer >= 1"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, dataset, kwargs, message):
    kwargs = {"dataset": dataset, **kwargs}
    with pytest.raises(ConfigError) as err:
        HFGradientIndexer(tmp_path / "ix", kwargs.pop("dataset"), **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert not (tmp_path / "ix").exists()


def test_a_made_spec_is_the_spec(tmp_path, dataset):
    spec = IndexSpec(**SETTINGS)
    assert HFGradientIndexer(tmp_path / "ix", dataset, spec=spec).session.spec is spec


def test_sharded_trainers_are_refused():
    with pytest.raises(ConfigError, match="cannot run under the Trainer's FSDP or DeepSpeed ZeRO-3"):
        check_sharding(types.SimpleNamespace(fsdp=["full_shard"]))
    check_sharding(types.SimpleNamespace(fsdp=None))  # DDP or one process: fine


@pytest.mark.parametrize("num_rows, batch_size, world", [(7, 2, 2), (7, 3, 2), (8, 2, 4), (5, 4, 3), (1, 4, 2)])
def test_every_batch_goes_to_exactly_one_rank_in_as_many_rounds_on_each(num_rows, batch_size, world):
    shares = [batch_starts(num_rows, batch_size, rank, world) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1  # every rank joins every gather
    starts = sorted(s for share in shares for s in share if s is not None)
    assert starts == list(range(0, num_rows, batch_size))
    assert shares[0] == [s for s in range(0, num_rows, batch_size * world)]  # batch b on rank b % world


class RecordingIndexer(HFGradientIndexer):
    """Also notes which dataset positions each rank computed, to prove the work was shared."""

    def __init__(self, *args, notes, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes = notes

    def _compute(self, model, args, rank, world):
        for computed in super()._compute(model, args, rank, world):
            if computed is not None:
                with open(self.notes / f"rank{rank}.txt", "a") as f:
                    f.write("".join(f"{int(i)}\n" for i in computed.index))
            yield computed


class SaveWeights(TrainerCallback):
    """World rank 0 saves the weights at each evaluation, for the one-process reference."""

    def __init__(self, folder):
        self.folder = folder

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            torch.save(model.state_dict(), self.folder / f"weights-{state.global_step}.pt")


def _ddp_rank(rank, world, port, tmp_path, tokenizer, dataset, errors):
    """One rank of a `torchrun`-like CPU launch: the Trainer reads the environment (gloo)."""
    import faulthandler
    import os

    from accelerate.state import AcceleratorState, PartialState

    # A rank still here after 4 minutes writes where it waits and exits: the parent reports it.
    faulthandler.dump_traceback_later(240, exit=True, file=open(errors / f"rank{rank}-stack.txt", "w"))
    try:
        # As under torchrun, the rendezvous store is the launcher's (the parent's), not rank 0's:
        # a rank that finishes first takes no store down with it.
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        # The forked child inherits the parent's one-process accelerate state (set by earlier tests): start afresh.
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
        indexer = RecordingIndexer(
            tmp_path / "ix-{step}", dataset, batch_size=2, notes=tmp_path, verbose=False, **SETTINGS
        )
        trainer = train(tmp_path, tokenizer, dataset, [indexer, SaveWeights(tmp_path)], ddp_backend="gloo")
        assert trainer.args.world_size == world and trainer.args.process_index == rank
        torch.distributed.barrier()
        # A rank that leaves with its gloo group alive can abort at exit ("terminate called without an
        # active exception", exit -6) while the group's threads are torn down: close it as torchrun users do.
        torch.distributed.destroy_process_group()
    except BaseException as err:  # the parent reports it
        (errors / f"rank{rank}.txt").write_text(repr(err))
        raise


@pytest.mark.slow  # two CPU ranks in child processes
def test_two_ranks_share_the_batches_and_write_the_one_process_rows(tmp_path, tokenizer, dataset):
    import multiprocessing
    from datetime import timedelta

    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=120), wait_for_workers=False
    )
    errors = tmp_path / "errors"
    errors.mkdir()
    # spawn, not fork: a fork of a process that ran other tests inherits their threads (zarr's event
    # loop, BLAS pools) mid-lock and hung in the whole suite
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_ddp_rank, args=(r, 2, store.port, tmp_path, tokenizer, dataset, errors)) for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    reports = {f.name: f.read_text() for f in errors.iterdir() if f.read_text()}
    assert [p.exitcode for p in ranks] == [0, 0], reports
    # 7 rows in batches of 2: batches 0 and 2 on rank 0, 1 and 3 on rank 1, at each of the two evaluations.
    shares = [sorted(int(i) for i in (tmp_path / f"rank{r}.txt").read_text().split()) for r in (0, 1)]
    assert shares == [sorted([0, 1, 4, 5] * 2), sorted([2, 3, 6] * 2)]
    # Each rank trained on half of each step's batch (DDP), so the weights are the two-rank run's own.
    for step in (2, 4):
        weights = torch.load(tmp_path / f"weights-{step}.pt", weights_only=True)
        index = open_index(tmp_path / f"ix-{step}")
        assert index.meta.complete and index.meta.global_step == step
        assert_same_rows(index, session_rows(tmp_path, tokenizer, dataset, weights, 2, step))
