"""`HFGradientIndexer`: the Hugging Face `Trainer`'s evaluations or saves mapped onto an `IndexSession` (index/session.py).

on_evaluate or on_save (the user's choice; at most once per global step)
    world rank 0: session.begin(len(dataset), step, lr) -> rows to do, broadcast to every rank
    every rank:   session.compute on its share of the dataset's batches (batch b on rank b % world)
                  gathered a round at a time; rank 0: session.write
    rank 0:       session.finish -> summary (on an exception: session.abort, rows kept, re-raised)
on_train_begin, resumed (at="save"): an index its save's event left unfinished is finished
    with the restored weights, which are the ones saved at that step

The callback iterates the dataset itself, in order, without a DataLoader (whose iterator draws a
seed from the global RNG), so training sees no change: parameters, their `.grad`, optimizer
state, train/eval mode and RNG are as they were (tests/test_hf_callback.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch import nn
from transformers import TrainerCallback

from gradian_lightning.data import collate
from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.index.checkpoints import SegmentRate, checkpoint_entries
from gradian_lightning.index.layout import read_meta
from gradian_lightning.index.session import BatchRows, IndexSession
from gradian_lightning.specs import IndexSpec, is_int, spec_from_arguments

EVENTS = ("evaluate", "save")


def _check_arguments(
    dataset: Any,
    at: Any,
    batch_size: Any,
    collate_fn: Any,
    verbose: Any,
    every_n: Any,
    spec: Any,
    settings: Any,
    name: str,
) -> None:
    """The callback's own arguments, each refused in one `ConfigError` line (the session checks its own)."""
    for argument, value, ok, allowed in (
        ("spec", spec, spec is None or (isinstance(spec, IndexSpec) and not settings), "None or an IndexSpec alone"),
        ("at", at, at in EVENTS, "'evaluate' (each evaluation) or 'save' (each checkpoint save)"),
        ("batch_size", batch_size, is_int(batch_size) and batch_size >= 1, "an integer >= 1"),
        (
            "collate_fn",
            collate_fn,
            collate_fn is None or callable(collate_fn),
            "None or a function of a list of examples",
        ),
        ("verbose", verbose, isinstance(verbose, bool), "True or False"),
        ("every_n", every_n, is_int(every_n) and every_n >= 1, "an integer >= 1"),
    ):
        if not ok:
            raise ConfigError(f"{name}({argument}={value!r}) is not allowed; use {allowed}")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"{name}(dataset=...) needs a map-style dataset with a length (rows land at dataset positions), not a {type(dataset).__name__}; pass e.g. a gradian_lightning.JsonlDataset"
        )


def check_sharding(args: Any) -> None:
    """Refuse trainers whose parameters are sharded outside the model's own forward (FSDP,
    DeepSpeed ZeRO-3): the indexer runs the unwrapped model, which there holds flat shards."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if getattr(args, "fsdp", None) or is_deepspeed_zero3_enabled():
        raise ConfigError(
            "HFGradientIndexer cannot run under the Trainer's FSDP or DeepSpeed ZeRO-3, which shard the parameters it needs whole; "
            "train with DDP or ZeRO-1/2, or index the saved checkpoints afterwards with `gradian index` and model.checkpoints"
        )


def forward_context(args: Any, device: torch.device) -> ContextManager:
    """The autocast the Trainer trains under (`args.bf16`, `args.fp16`), so rows are made at the
    precision the model is trained at; none in full precision."""
    if getattr(args, "bf16", False):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if getattr(args, "fp16", False):
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def batch_starts(num_rows: int, batch_size: int, rank: int, world: int) -> List[Optional[int]]:
    """The first dataset position of each batch this rank computes, one per gathering round
    (None in a round where this rank has no batch): batch b of ceil(N / batch_size) goes to rank
    b % world, so every rank runs the same number of rounds and rank 0 receives every batch."""
    batches = math.ceil(num_rows / batch_size)
    rounds = math.ceil(batches / world)
    out: List[Optional[int]] = []
    for r in range(rounds):
        b = r * world + rank
        out.append(b * batch_size if b < batches else None)
    return out


def trainer_collate(examples: Sequence[Any], pad_token_id: int = 0) -> Dict[str, Any]:
    """`collate` less what a Hugging Face model's forward does not take (`index`, `id`,
    `truncated_tokens`): the Trainer's `data_collator` for a `JsonlDataset`."""
    batch = collate(examples, pad_token_id)
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


def _to_device(batch: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _on_cpu(computed: BatchRows) -> BatchRows:
    tensors = {k: v.cpu() for k, v in computed.tensors().items()}
    return BatchRows(**tensors, ids=list(computed.ids))


class HFGradientIndexer(TrainerCallback):
    """Index every example of `dataset` at each evaluation or save of a Hugging Face `Trainer`.

    Add it to `Trainer(callbacks=[...])`: during `trainer.train()` it indexes at each evaluation
    (`at="evaluate"`, `eval_strategy`) or each checkpoint save (`at="save"`, `save_strategy`),
    and `trainer.evaluate()` alone indexes the current weights. Examples are what `collate_fn`
    batches (default: `gradian_lightning.data.collate` over `JsonlDataset` examples); a batch
    holds `input_ids`, `attention_mask`, `labels` (-100 where not supervised) and `index`
    (dataset positions).

    Args:
        path, overwrite, meta, rows_per_chunk, checkpoints, append: the `IndexSession`'s (index/session.py);
            `{step}` in `path` keeps one index per event, keyed by global step; with `checkpoints`
            every event is one checkpoint of one index, with the mean learning rate (the first
            parameter group's, as the Trainer logs it) of the optimizer steps since the event
            indexed before it (`SegmentRate`), so `query.checkpoints=all` sums them weighted as
            TracIn-CP and LESS do.
        dataset: the rows to index, map-style with a length (usually the training set, in order).
        spec_values, spec_settings: the `IndexSpec`'s settings (specs.py, `grads.*`), positional
            in its field order after `dataset` or by name. Or `spec`: the `IndexSpec` itself.
        at: "evaluate" or "save": which Trainer event indexes.
        batch_size: examples per indexing batch (`grads.batch_size`); each rank computes whole batches.
        collate_fn: list of examples -> batch (default `gradian_lightning.data.collate`).
        verbose: after each run, print on world rank 0 what was written.
        every_n: index only every n-th event.

    Under several processes (DDP, `torchrun`) batch b goes to rank `b % world_size`, rank 0
    (`state.is_world_process_zero`) opens and writes the index. FSDP and DeepSpeed ZeRO-3 are
    refused. A second event at a step already indexed (one per eval dataset) does nothing. A
    training resumed past a save whose index was left unfinished finishes it first (`on_train_begin`).
    """

    def __init__(
        self,
        path: str | Path,
        dataset: Any,
        *spec_values: Any,
        at: str = "evaluate",
        batch_size: int = 4,
        collate_fn: Optional[Callable[[Sequence[Any]], Dict[str, Any]]] = None,
        overwrite: bool = False,
        meta: Optional[Dict[str, Any]] = None,
        verbose: bool = True,
        rows_per_chunk: Optional[int] = None,
        checkpoints: bool = False,
        every_n: int = 1,
        append: bool = False,
        spec: Optional[IndexSpec] = None,
        **spec_settings: Any,
    ) -> None:
        name = type(self).__name__
        own = ("path", "dataset", "at", "batch_size", "collate_fn", "overwrite", "meta", "verbose")
        own += ("rows_per_chunk", "checkpoints", "every_n", "append", "spec")
        settings = spec_values or spec_settings
        _check_arguments(dataset, at, batch_size, collate_fn, verbose, every_n, spec, settings, name)
        if spec is None:
            spec = spec_from_arguments(IndexSpec, name, spec_values, spec_settings, own)
        options = {"rows_per_chunk": rows_per_chunk, "checkpoints": checkpoints, "meta": meta, "append": append}
        self.session = IndexSession(spec, path, overwrite=overwrite, **options, caller=name)
        self.dataset, self.at, self.batch_size = dataset, at, batch_size
        self.collate_fn = collate_fn or collate
        self.verbose, self.every_n = verbose, every_n
        # Finished runs, oldest first: {"step", "path", "rows", "complete", "seconds"} (None but step and path off rank 0).
        self.runs: List[Dict[str, Any]] = []
        self._events, self._last_step, self._bound = 0, None, None
        self.rate = SegmentRate()  # the learning rates of the optimizer steps since the last indexed event

    @property
    def summary(self) -> Optional[Dict[str, Any]]:
        """What the latest indexing run wrote (world rank 0; None before the first): `IndexSession.finish`'s summary."""
        return self.session.summaries[-1] if self.session.summaries else None

    # -- Trainer events ----------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A save's index is written after its checkpoint, so a run killed while writing it resumes
        # past that save, which the Trainer never repeats. The weights it resumes with are the
        # ones saved there: the index is finished now, from the rows already on disk.
        self._last_step = None  # a second train() counts its steps from 0 again
        # A new run's steps (or, resumed, the steps from the resume on: the Trainer keeps no
        # callback's running sums in its checkpoint) make the next checkpoint's segment.
        self.rate = SegmentRate()
        if self.at != "save" or not state.global_step:
            return
        step = int(state.global_step)
        entry = self._unfinished(step) if state.is_world_process_zero else None
        if int(getattr(args, "world_size", 1)) > 1:
            shared = [entry]
            torch.distributed.broadcast_object_list(shared, src=0)
            entry = shared[0]
        if entry is None:
            return
        check_sharding(args)
        self._last_step = step
        self.index(kwargs["model"], step, entry.get("lr"), args, state)

    def _unfinished(self, step: int) -> Optional[Dict[str, Any]]:
        """The checkpoint entry (step, lr, complete) of an index left unfinished at `step`, or None."""
        try:
            meta = read_meta(self.session.path_at(step))
        except GradianError:  # nothing there yet
            return None
        found = [e for e in checkpoint_entries(meta) if int(e["step"]) == step and not e["complete"]]
        return found[0] if found else None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After optimizer.step, before the scheduler's: the learning rate this step trained at (what
        # the Trainer logs as `learning_rate`). Read later, at the event, a decaying schedule would
        # give the next step's, 0 at the end of a linear decay: a last checkpoint that sums to nothing.
        groups = getattr(kwargs.get("optimizer"), "param_groups", None)
        if groups:
            self.rate.step(groups[0]["lr"])

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.at == "evaluate":
            self._event(args, state, kwargs)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.at == "save":
            self._event(args, state, kwargs)

    def _event(self, args: Any, state: Any, kwargs: Dict[str, Any]) -> None:
        step = int(state.global_step)
        if step == self._last_step:  # one evaluation per eval dataset, all at the same weights
            return
        self._last_step = step
        self._events += 1
        if self._events % self.every_n:
            return
        check_sharding(args)
        # The segment's mean rate; before any step (an evaluation at step 0), the rate the first step
        # will take; without an optimizer, None.
        lr = self.rate.close(_learning_rate(kwargs.get("optimizer")))
        self.index(kwargs["model"], step, lr, args, state)

    # -- one indexing run --------------------------------------------------------------------------
    def index(self, model: nn.Module, step: int, lr: Optional[float], args: Any, state: Any) -> Dict[str, Any]:
        """Index `self.dataset` with `model` as the rows of `step` (learning rate `lr`); returns this run's entry in `runs`."""
        if self._bound is not model:
            self.session.bind(model)
            self._bound = model
        started = time.perf_counter()
        world, rank = int(getattr(args, "world_size", 1)), int(getattr(args, "process_index", 0))
        chief = bool(state.is_world_process_zero)
        todo = self.session.begin(len(self.dataset), step, lr) if chief else None
        if world > 1:
            shared = [todo]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.session.expect(shared[0])
        try:
            for computed in self._compute(model, args, rank, world):
                gathered = [computed]
                if world > 1:
                    gathered = [None] * world if chief else None
                    torch.distributed.gather_object(computed, gathered, dst=0)
                if chief:
                    for rows in gathered:
                        if rows is not None:
                            self.session.write(rows)
        except BaseException:
            self.session.abort()  # rank 0 keeps the rows written so far; a rerun resumes from them
            raise
        run = {"step": step, "path": self.session.path_at(step), "rows": None, "complete": None, "seconds": None}
        if chief:
            summary = self.session.finish()
            seconds = round(time.perf_counter() - started, 3)  # what the event added to training's wall time
            run.update(step=summary["step"], rows=summary["rows"], complete=summary["complete"], seconds=seconds)
            if self.verbose:
                print(
                    f"HFGradientIndexer: step {run['step']}: {run['rows']}/{summary['num_rows']} rows in {run['path']} ({'complete' if run['complete'] else 'INCOMPLETE'}) in {seconds:.1f} s",
                    flush=True,
                )
        self.runs = [r for r in self.runs if r["step"] != run["step"]] + [run]  # a re-run of a step replaces its entry
        if world > 1:
            torch.distributed.barrier()
        return run

    def _compute(self, model: nn.Module, args: Any, rank: int, world: int) -> Iterator[Optional[BatchRows]]:
        """This rank's batches' rows, one per gathering round (None where it has no batch), on the CPU."""
        device = next(model.parameters()).device
        todo = self.session.todo
        for start in batch_starts(len(self.dataset), self.batch_size, rank, world):
            if start is None:
                yield None
                continue
            positions = range(start, min(start + self.batch_size, len(self.dataset)))
            if not np.any(todo[positions.start : positions.stop]):
                yield None  # every row of this batch is on disk already (a resumed index)
                continue
            batch = _to_device(self.collate_fn([self.dataset[i] for i in positions]), device)
            yield _on_cpu(self.session.compute(batch, forward_context(args, device)))


def _learning_rate(optimizer: Any) -> Optional[float]:
    """The first parameter group's learning rate now, or None without an optimizer
    (`trainer.evaluate()` before training)."""
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0]["lr"]) if groups else None
