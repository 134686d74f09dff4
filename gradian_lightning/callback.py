"""`GradientIndexer`: Lightning's validation loop and ranks mapped onto an `IndexSession` (index/session.py).

on_before_optimizer_step   every rank: the learning rate this optimizer step trains at, summed (read only)
on_validation_epoch_start  rank 0: session.begin(rows, step, the segment's mean rate) -> rows to do, broadcast
on_validation_batch_end    every rank: session.compute(batch); gathered; rank 0: session.write
on_validation_epoch_end    rank 0: session.finish -> summary
on_exception               rank 0: session.abort (rows computed so far are kept)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.hub import find_causal_lm
from gradian_lightning.index.checkpoints import SegmentRate
from gradian_lightning.index.layout import read_meta
from gradian_lightning.index.session import BatchRows, IndexSession
from gradian_lightning.specs import ROW_SETTINGS, IndexSpec, is_int, spec_from_arguments


def check_strategy(strategy: Any) -> None:
    """Refuse FSDPStrategy (FSDP1): its root unit keeps parameters sharded outside the LightningModule's
    forward, where the indexer runs the model ("'weight' must be 2-D"). FSDP2 (`fully_shard` under
    ModelParallelStrategy) unshards in each module's own forward, so it works, as does DDP."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        raise ConfigError(
            "GradientIndexer cannot run under Lightning's FSDPStrategy (FSDP1): its root unit keeps parameters sharded outside the LightningModule's forward, where the indexer runs the model; "
            "use ModelParallelStrategy with fully_shard (FSDP2) in configure_model, or DDP (docs/multi-gpu-and-clusters.md)"
        )


def _check_arguments(
    dataloader_idx: Any, model_attribute: Any, verbose: Any, every_n_val_runs: Any, spec: Any, settings: Any
) -> None:
    """The callback's own arguments, each refused in one `ConfigError` line (the session checks its own)."""
    for name, value, ok, allowed in (
        ("spec", spec, spec is None or (isinstance(spec, IndexSpec) and not settings), "None or an IndexSpec alone"),
        ("dataloader_idx", dataloader_idx, is_int(dataloader_idx) and dataloader_idx >= 0, "an integer >= 0"),
        (
            "model_attribute",
            model_attribute,
            model_attribute is None or (isinstance(model_attribute, str) and bool(model_attribute.strip())),
            "None or a dotted attribute name such as 'model'",
        ),
        ("verbose", verbose, isinstance(verbose, bool), "True or False"),
        ("every_n_val_runs", every_n_val_runs, is_int(every_n_val_runs) and every_n_val_runs >= 1, "an integer >= 1"),
    ):
        if not ok:
            raise ConfigError(f"GradientIndexer({name}={value!r}) is not allowed; use {allowed}")


class GradientIndexer(L.Callback):
    """Index every example of one validation dataloader: one projected loss-gradient row each.

    Add it to `Trainer(callbacks=[...])`: `trainer.validate(module, dataloaders=train_loader)`
    writes the index, and during `trainer.fit` it re-indexes at every validation run. Batches hold
    `input_ids`, `attention_mask`, `labels` (-100 where not supervised) and `index` (dataset
    positions), as `gradian_lightning.data.collate` makes them.

    Args:
        path, overwrite, meta, rows_per_chunk, checkpoints, append: the `IndexSession`'s (index/session.py);
            `{step}` in `path` keeps one index per validation run, keyed by global step; with
            `checkpoints` every run is one checkpoint of one index, with the mean learning rate
            (the first optimizer's first parameter group's) of the optimizer steps since the run
            indexed before it (`SegmentRate`; before any step, the rate the first will take), so
            `query.checkpoints=all` sums them weighted as TracIn-CP and LESS do.
        spec_values, spec_settings: the `IndexSpec`'s settings (specs.py, `grads.*`), positional
            in its field order after `path` (`GradientIndexer("ix", "down_proj", 16)`) or by name;
            an unknown name is refused in one line that lists the valid ones. Or `spec`: the
            `IndexSpec` itself, made already (`GradientIndexer("ix", spec=IndexSpec(...))`).
        dataloader_idx: which validation dataloader to index.
        model_attribute: dotted attribute of the Hugging Face model (default: the top-most PreTrainedModel).
        verbose: after each run, say on rank 0 what was written.
        every_n_val_runs: index only every n-th validation run.

    Arguments are checked here, in one `ConfigError` line each. `state_dict` (in Lightning
    checkpoints) holds the finished runs, so a resumed fit counts on; an index the interruption
    left unfinished is completed, not restarted, when the fit reaches its step again.
    """

    def __init__(
        self,
        path: str | Path,
        *spec_values: Any,
        dataloader_idx: int = 0,
        model_attribute: Optional[str] = None,
        overwrite: bool = False,
        meta: Optional[Dict[str, Any]] = None,
        verbose: bool = True,
        rows_per_chunk: Optional[int] = None,
        checkpoints: bool = False,
        every_n_val_runs: int = 1,
        append: bool = False,
        spec: Optional[IndexSpec] = None,
        **spec_settings: Any,
    ) -> None:
        own = ("path", "dataloader_idx", "model_attribute", "overwrite", "meta", "verbose")
        own += ("rows_per_chunk", "checkpoints", "every_n_val_runs", "append", "spec")
        _check_arguments(dataloader_idx, model_attribute, verbose, every_n_val_runs, spec, spec_values or spec_settings)
        if spec is None:
            spec = spec_from_arguments(IndexSpec, "GradientIndexer", spec_values, spec_settings, own)
        options = {"rows_per_chunk": rows_per_chunk, "checkpoints": checkpoints, "meta": meta, "append": append}
        self.session = IndexSession(spec, path, overwrite=overwrite, **options, caller="GradientIndexer")
        self.dataloader_idx, self.model_attribute = dataloader_idx, model_attribute
        self.verbose, self.every_n_val_runs = verbose, every_n_val_runs
        self.runs: List[Dict[str, Any]] = []  # finished runs, oldest first: {"step", "path", "rows", "complete"}
        self._val_runs, self._todo = 0, None
        self.rate = SegmentRate()  # the learning rates of the optimizer steps since the last indexed run

    @property
    def summary(self) -> Optional[Dict[str, Any]]:
        """What the latest indexing run wrote (rank 0; None before the first): `IndexSession.finish`'s summary."""
        return self.session.summaries[-1] if self.session.summaries else None

    # -- Lightning checkpoint state --------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # Two indexers in one Trainer (say, two module filters) need separate checkpoint entries.
        spec = self.session.spec
        return self._generate_state_key(
            path=self.session.path_template, module_filter=list(spec.module_filter), dataloader_idx=self.dataloader_idx
        )

    def _settings(self) -> Dict[str, Any]:
        return {k: v for k, v in self.session.spec.to_meta().items() if k in ROW_SETTINGS}

    def state_dict(self) -> Dict[str, Any]:
        return {
            "runs": [dict(r) for r in self.runs],
            "settings": self._settings(),
            "val_runs": self._val_runs,
            **self.rate.state(),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.runs = [dict(r) for r in state_dict.get("runs", [])]
        self._val_runs = int(state_dict.get("val_runs", 0))  # every_n_val_runs counts on across the resume
        self.rate.load(state_dict)  # the segment's steps before the resume count on
        saved, now = state_dict.get("settings"), self._settings()
        if saved is not None and saved != now:
            changed = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v)
            rank_zero_warn(
                f"GradientIndexer: resumed from a checkpoint indexed with other settings ({changed}); indexes written after the resume are not comparable with earlier ones"
            )

    # -- hooks -----------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_strategy(trainer.strategy)
        self.session.bind(find_causal_lm(pl_module, self.model_attribute))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A checkpoint saved at step S before S's validation run resumes after that run: Lightning
        # never repeats it, so an index it left unfinished stays so.
        if trainer.ckpt_path is None or not trainer.is_global_zero:
            return
        path = self.session.path_at(trainer.global_step)
        try:
            meta = read_meta(path)
        except GradianError:
            return
        if meta.global_step == trainer.global_step and not meta.complete:
            rank_zero_warn(
                f"GradientIndexer: the index {path} of step {trainer.global_step}, where this fit resumes, was left incomplete and Lightning will not repeat "
                "that validation run; resume from an earlier checkpoint to repeat it, or checkpoint after validation runs (ModelCheckpoint's default)"
            )

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # After the backward, before optimizer.step and the scheduler's step that follows it: the
        # rate this step trains at (what the HF callback and Trainer record). Read at the validation
        # run instead, a step-interval scheduler has already set the next step's, 0 after the last
        # step of a decay to 0: a fine-tuned model that a checkpoint sum weighs out.
        first = trainer.optimizers[0] if trainer.optimizers else None
        if first is None or (len(trainer.optimizers) > 1 and getattr(optimizer, "_optimizer", optimizer) is not first):
            return  # another optimizer's step (manual optimization): the first's rate is the one recorded
        self.rate.step(first.param_groups[0]["lr"])

    def _active(self, trainer: L.Trainer, dataloader_idx: int = 0) -> bool:
        return not trainer.sanity_checking and dataloader_idx == self.dataloader_idx

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active(trainer):
            return
        self._val_runs += 1
        if self._val_runs % self.every_n_val_runs:
            return
        num_rows = _num_rows(trainer.val_dataloaders, self.dataloader_idx)
        todo = None
        lr = self.rate.close(_learning_rate(trainer.optimizers))  # every rank: the next segment opens
        if trainer.is_global_zero:
            todo = self.session.begin(num_rows, int(trainer.global_step), lr)
        self._todo = trainer.strategy.broadcast(todo, src=0)
        self.session.expect(self._todo)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self._active(trainer, dataloader_idx) or self._todo is None:
            return
        computed = self.session.compute(batch, trainer.precision_plugin.forward_context())
        if trainer.world_size > 1:
            computed = gathered(trainer.strategy, computed)
        if trainer.is_global_zero:
            self.session.write(computed)
            for name, value in self.session.progress().items():
                pl_module.log(
                    name,
                    value,
                    prog_bar=True,
                    logger=False,
                    on_step=True,
                    on_epoch=False,
                    batch_size=len(computed.ids),
                    rank_zero_only=True,
                )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active(trainer) or self._todo is None:
            return
        run = {
            "step": int(trainer.global_step),
            "path": self.session.path_at(trainer.global_step),
            "rows": None,
            "complete": None,
        }
        if trainer.is_global_zero:
            summary = self.session.finish()
            run.update(step=summary["step"], rows=summary["rows"], complete=summary["complete"])
            if self.verbose:
                rank_zero_info(
                    f"GradientIndexer: step {run['step']}: {run['rows']}/{summary['num_rows']} rows in {run['path']} ({'complete' if run['complete'] else 'INCOMPLETE'})"
                )
        self.runs = [r for r in self.runs if r["step"] != run["step"]] + [run]  # a re-run of a step replaces its entry
        self._todo = None
        trainer.strategy.barrier()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._todo = None
        self.session.abort()  # rank 0's writer keeps the rows it has; other ranks hold none


def _learning_rate(optimizers: List[Any]) -> Optional[float]:
    """The first optimizer's first parameter group's learning rate now, or None without one (`trainer.validate`)."""
    groups = getattr(optimizers[0], "param_groups", None) if optimizers else None
    return float(groups[0]["lr"]) if groups else None


def gathered(strategy: Any, computed: BatchRows) -> BatchRows:
    """Every rank's rows of one batch (B each: the sampler pads ranks to equal batches), rank after
    rank, through `strategy.all_gather`. Lightning's strategies gather tensors, not Python objects
    (XLA's has no object collective), so the ids travel as their byte lengths [B], then their UTF-8
    bytes, uint8 [B, the longest id of any rank], zero-padded."""
    encoded = [i.encode("utf-8") for i in computed.ids]
    lengths = torch.tensor([len(e) for e in encoded], dtype=torch.long, device=computed.rows.device)
    tensors = {k: strategy.all_gather(v).flatten(0, 1) for k, v in {**computed.tensors(), "lengths": lengths}.items()}
    lengths = tensors.pop("lengths").tolist()  # every rank's: the same width on each
    width = max(lengths + [1])
    padded = np.frombuffer(b"".join(e.ljust(width, b"\0") for e in encoded), dtype=np.uint8).reshape(-1, width)
    raw = strategy.all_gather(torch.from_numpy(padded.copy()).to(computed.rows.device)).flatten(0, 1).cpu().numpy()
    return BatchRows(**tensors, ids=[row[:n].tobytes().decode("utf-8") for row, n in zip(raw, lengths)])


def _num_rows(loaders: Any, dataloader_idx: int) -> int:
    """The length of the dataset of validation dataloader `dataloader_idx`: the index's rows."""
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    if dataloader_idx >= len(loaders):
        raise ConfigError(
            f"GradientIndexer(dataloader_idx={dataloader_idx}) but there are {len(loaders)} validation dataloaders"
        )
    try:
        return len(getattr(loaders[dataloader_idx], "dataset", None))
    except TypeError:
        raise ConfigError(
            "GradientIndexer needs a dataloader over a map-style dataset with a length (rows land at dataset positions)"
        ) from None
