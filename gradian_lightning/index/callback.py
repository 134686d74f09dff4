"""`GradientIndexer`: the Lightning glue. Life-cycle, ranks, inference mode and progress; no maths.

One validation batch flows: dataloader batch -> `projected_gradients` (gradients/: the loss under
capture hooks, output-grads, the Kronecker projection) -> `IndexWriter` rows at the batch's
dataset positions (index/writer.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from gradian_lightning.config import (
    DEFAULT_MODULE_FILTER,
    DEFAULT_RECOMPUTE,
    RECOMPUTE,
    STORAGE_DTYPES,
    module_patterns,
)
from gradian_lightning.errors import ConfigError, DeviceOutOfMemoryError, GradianError
from gradian_lightning.gradients.batch import projected_gradients
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.loss import supervised_targets
from gradian_lightning.gradients.memory import SUGGESTED_LOSS_CHUNK_TOKENS, fp32_logit_bytes, human_bytes
from gradian_lightning.gradients.peft import unwrap_peft
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.gradients.weights import weights_digest
from gradian_lightning.hub import normalized_name
from gradian_lightning.index.checkpoints import register_checkpoint
from gradian_lightning.index.layout import fingerprint, read_meta
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.versions import package_versions


def find_causal_lm(pl_module: nn.Module, attribute: Optional[str] = None) -> nn.Module:
    """The Hugging Face model inside a LightningModule: `attribute` (dotted) or the top-most PreTrainedModel.

    A `peft.PeftModel` (at `attribute`, or holding the first PreTrainedModel found) gives its base
    model, whose layers carry the LoRA adapters in place (gradients/peft.py).
    """
    if attribute:
        model = pl_module
        for part in attribute.split("."):
            model = getattr(model, part, None)
            if model is None:
                raise ConfigError(
                    f"GradientIndexer(model_attribute={attribute!r}): {type(pl_module).__name__} has no attribute {part!r}"
                )
        return unwrap_peft(model)
    from transformers import PreTrainedModel

    for _, module in pl_module.named_modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise ConfigError(
        f"GradientIndexer found no transformers PreTrainedModel inside {type(pl_module).__name__}; pass model_attribute='name_of_the_model_attribute'"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_arguments(**given: Any) -> None:
    """The `GradientIndexer` arguments that no config schema checked, each as one `ConfigError` line."""
    path = given["path"]
    rules = {
        "path": (
            isinstance(path, (str, os.PathLike)) and bool(str(path).strip()),
            "a non-empty directory path (str or Path)",
        ),
        "seed": (_is_int(given["seed"]), "an integer"),
        "dataloader_idx": (_is_int(given["dataloader_idx"]) and given["dataloader_idx"] >= 0, "an integer >= 0"),
        "model_attribute": (
            given["model_attribute"] is None
            or (isinstance(given["model_attribute"], str) and bool(given["model_attribute"].strip())),
            "None or a dotted attribute name such as 'model'",
        ),
        "overwrite": (isinstance(given["overwrite"], bool), "True or False"),
        "verbose": (isinstance(given["verbose"], bool), "True or False"),
        "meta": (given["meta"] is None or isinstance(given["meta"], dict), "None or a dict of JSON data"),
        "rows_per_chunk": (
            given["rows_per_chunk"] is None or (_is_int(given["rows_per_chunk"]) and given["rows_per_chunk"] >= 1),
            "None or an integer >= 1",
        ),
        "loss_chunk_tokens": (
            given["loss_chunk_tokens"] is None
            or (_is_int(given["loss_chunk_tokens"]) and given["loss_chunk_tokens"] >= 1),
            "None or an integer >= 1",
        ),
        "checkpoints": (isinstance(given["checkpoints"], bool), "True or False"),
        "every_n_val_runs": (_is_int(given["every_n_val_runs"]) and given["every_n_val_runs"] >= 1, "an integer >= 1"),
        "recompute": (given["recompute"] in RECOMPUTE, " or ".join(repr(r) for r in RECOMPUTE)),
    }
    for name, (ok, allowed) in rules.items():
        if not ok:
            raise ConfigError(f"GradientIndexer({name}={given[name]!r}) is not allowed; use {allowed}")
    try:
        str(path).format(step=0)
    except (KeyError, IndexError, ValueError):
        raise ConfigError(
            f"GradientIndexer(path={str(path)!r}): the only placeholder a path may hold is {{step}}; write other braces twice ({{{{ and }}}})"
        ) from None
    try:
        json.dumps(given["meta"] or {}, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"GradientIndexer(meta=...) cannot be stored in the index attributes ({err}); keep it to dicts, lists, strings, numbers, booleans and None"
        ) from None


def check_strategy(strategy: Any) -> None:
    """Refuse Lightning's FSDPStrategy (FSDP1) in one line; every other strategy is fine.

    FSDP1 wraps the LightningModule in a root unit whose parameters (embeddings, head, and all of
    them without an auto-wrap policy) are unsharded only inside the LightningModule's own forward.
    The indexer calls the Hugging Face model from a callback, where they are still flat shards
    (torch: "RuntimeError: 'weight' must be 2-D"). FSDP2 (`fully_shard` under ModelParallelStrategy)
    unshards in each sharded module's own forward, so it works, as does DDP.
    """
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        raise ConfigError(
            "GradientIndexer cannot run under Lightning's FSDPStrategy (FSDP1): its root unit keeps parameters sharded outside the LightningModule's forward, where the indexer runs the model; "
            "use ModelParallelStrategy with fully_shard (FSDP2) in configure_model, or DDP (docs/multi-gpu-and-clusters.md)"
        )


class GradientIndexer(L.Callback):
    """Index every example of one validation dataloader: one projected loss-gradient row each.

    Add it to `Trainer(callbacks=[...])`; `trainer.validate(module, dataloaders=train_loader)` then
    writes the index, and during `trainer.fit` it re-indexes at every validation run. Batches must
    hold `input_ids`, `attention_mask`, `labels` (-100 where not supervised) and `index` (dataset
    positions); `gradian_lightning.data.collate` makes them, `id` (list of str) is optional.

    Args:
        path: index directory. `{step}` in it is replaced by the global step, which keeps one index
            per validation run; without it each run replaces the index of the previous one.
        module_filter: module name pattern(s), see `capture.select_modules`.
        projection_dim: k, rows per projection factor (row width k² per module); None = exact.
        storage_dtype: float32, float16 or bfloat16.
        seed: projection seed.
        dataloader_idx: which validation dataloader to index.
        model_attribute: dotted attribute of the Hugging Face model in the LightningModule;
            default: the top-most `transformers.PreTrainedModel` found.
        overwrite: replace an index of another configuration found at `path`.
        meta: extra plain data stored in the index attributes (the CLI stores its config); JSON types only.
        verbose: after each indexing run, say on rank 0 what was written (Lightning's logger, INFO).
        rows_per_chunk: rows per stored grads chunk (default: about 4 MiB of them); a killed run
            loses at most the chunks it had not finished, and resumes from the rest.
        loss_chunk_tokens: run the output head and fp32 cross-entropy this many supervised tokens
            at a time (`grads.loss_chunk_tokens`): a bounded loss peak, the same rows; None = all at once.
        checkpoints: keep every indexed validation run as one checkpoint of one index at `path`,
            keyed by global step (or `self.step` when set), with the learning rate at that step
            (the first optimizer's first group, or `self.lr` when set) (index/checkpoints.py);
            queries then sum the checkpoints' scores (`query.checkpoints`).
        every_n_val_runs: index only every n-th validation run (1: each).
        recompute: what keeps only its input through the backward and runs again there
            (`grads.recompute`, gradients/recompute.py): "mlp" (default) every decoder layer's MLP
            block, "layers" every decoder layer, "none" nothing. Lower peak memory for more time,
            the same rows (benchmarks/RESULTS.md §1).

    Every argument is checked here, before any Trainer exists: a wrong one is one `ConfigError` line.
    The callback's `state_dict` (saved in Lightning checkpoints) holds how many indexing runs it
    finished and where they went, so a fit resumed with `ckpt_path=` carries on counting; an index
    the interruption left incomplete is finished, not restarted, when the resumed fit reaches the
    same step again (the writer keeps its completed rows).
    """

    def __init__(
        self,
        path: str | Path,
        module_filter: str | Sequence[str] = DEFAULT_MODULE_FILTER,
        projection_dim: Optional[int] = 16,
        storage_dtype: str = "float16",
        seed: int = 0,
        dataloader_idx: int = 0,
        model_attribute: Optional[str] = None,
        overwrite: bool = False,
        meta: Optional[Dict[str, Any]] = None,
        verbose: bool = True,
        rows_per_chunk: Optional[int] = None,
        loss_chunk_tokens: Optional[int] = None,
        checkpoints: bool = False,
        every_n_val_runs: int = 1,
        recompute: str = DEFAULT_RECOMPUTE,
    ) -> None:
        if storage_dtype not in STORAGE_DTYPES:
            raise ConfigError(
                f"setting 'grads.storage_dtype'={storage_dtype!r} is not allowed; use {' or '.join(STORAGE_DTYPES)}"
            )
        if projection_dim is not None and (not _is_int(projection_dim) or projection_dim < 1):
            raise ConfigError(
                f"setting 'grads.projection_dim'={projection_dim!r} is not allowed; use an integer >= 1, or null for exact gradients"
            )
        _check_arguments(
            path=path,
            seed=seed,
            dataloader_idx=dataloader_idx,
            model_attribute=model_attribute,
            overwrite=overwrite,
            meta=meta,
            verbose=verbose,
            rows_per_chunk=rows_per_chunk,
            loss_chunk_tokens=loss_chunk_tokens,
            checkpoints=checkpoints,
            every_n_val_runs=every_n_val_runs,
            recompute=recompute,
        )
        self.path_template = str(path)
        self.patterns = module_patterns(module_filter)
        self.projection_dim, self.storage_dtype, self.seed = projection_dim, storage_dtype, seed
        self.dataloader_idx, self.model_attribute, self.overwrite = dataloader_idx, model_attribute, overwrite
        self.extra_meta = dict(meta or {})
        self.verbose = verbose
        self.rows_per_chunk = rows_per_chunk
        self.loss_chunk_tokens = loss_chunk_tokens
        self.recompute = recompute
        self.summary: Optional[Dict[str, Any]] = None  # set on rank 0 after each indexing run
        # Finished indexing runs, oldest first: {"step", "path", "rows", "complete"}; in the checkpoint.
        self.runs: List[Dict[str, Any]] = []
        self._writer: Optional[IndexWriter] = None
        self._todo: Optional[np.ndarray] = None
        # checkpoints=True: each indexed validation run adds checkpoint `step` (default: the
        # global step) to one index at `path` (index/checkpoints.py) instead of replacing it.
        # `lr` (default: the first optimizer's) is set when validating a saved checkpoint, which has no optimizer.
        self.checkpoints, self.every_n_val_runs, self.step, self.lr = checkpoints, every_n_val_runs, None, None
        self._val_runs, self._checkpoint = 0, None

    # -- Lightning checkpoint state --------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # Two indexers in one Trainer (say, two module filters) need separate checkpoint entries.
        return self._generate_state_key(
            path=self.path_template, module_filter=self.patterns, dataloader_idx=self.dataloader_idx
        )

    def _settings(self) -> Dict[str, Any]:
        return {
            "module_filter": self.patterns,
            "projection_dim": self.projection_dim,
            "storage_dtype": self.storage_dtype,
            "seed": self.seed,
        }

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed fit needs: the finished runs (step, path, rows, complete), the settings and
        how many validation runs it has seen (for `every_n_val_runs`)."""
        return {"runs": [dict(r) for r in self.runs], "settings": self._settings(), "val_runs": self._val_runs}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the finished runs of the checkpointed fit; warn (rank 0) when the settings changed."""
        self.runs = [dict(r) for r in state_dict.get("runs", [])]
        self._val_runs = int(state_dict.get("val_runs", 0))  # every_n_val_runs counts on across the resume
        saved = state_dict.get("settings")
        if saved is not None and saved != self._settings():
            changed = ", ".join(
                f"{k} {saved.get(k)!r} -> {v!r}" for k, v in self._settings().items() if saved.get(k) != v
            )
            rank_zero_warn(
                f"GradientIndexer: resumed from a checkpoint indexed with other settings ({changed}); indexes written after the resume are not comparable with earlier ones"
            )

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        check_strategy(trainer.strategy)
        self.model = find_causal_lm(pl_module, self.model_attribute)
        self.modules = select_modules(self.model, self.patterns)
        self.projector = KroneckerProjector(self.modules, self.projection_dim, self.seed)
        self.capture = LinearCapture(self.modules)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A checkpoint saved at step S before S's validation run (ModelCheckpoint(every_n_train_steps=...))
        # resumes after that run: Lightning never repeats it, so an index it left unfinished stays so.
        if trainer.ckpt_path is None or not trainer.is_global_zero:
            return
        path = self.path_template.format(step=trainer.global_step)
        try:
            meta = read_meta(path)
        except GradianError:
            return
        if meta.get("global_step") == trainer.global_step and not meta.get("complete"):
            rank_zero_warn(
                f"GradientIndexer: the index {path} of step {trainer.global_step}, where this fit resumes, was left incomplete and Lightning will not repeat "
                "that validation run; resume from an earlier checkpoint to repeat it, or checkpoint after validation runs (ModelCheckpoint's default)"
            )

    def _active(self, trainer: L.Trainer, dataloader_idx: int = 0) -> bool:
        return not trainer.sanity_checking and dataloader_idx == self.dataloader_idx

    def _num_rows(self, trainer: L.Trainer) -> int:
        loaders = trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        if self.dataloader_idx >= len(loaders):
            raise ConfigError(
                f"GradientIndexer(dataloader_idx={self.dataloader_idx}) but there are {len(loaders)} validation dataloaders"
            )
        dataset = getattr(loaders[self.dataloader_idx], "dataset", None)
        try:
            return len(dataset)
        except TypeError:
            raise ConfigError(
                "GradientIndexer needs a dataloader over a map-style dataset with a length (rows land at dataset positions)"
            ) from None

    def _meta(self, trainer: L.Trainer, num_rows: int) -> Dict[str, Any]:
        config = getattr(self.model, "config", None)
        model = {
            "class": type(self.model).__name__,
            "name_or_path": normalized_name(
                getattr(config, "_name_or_path", None) or self.extra_meta.get("model", {}).get("name_or_path")
            ),
            # What a query's model must hold (query/rows.py); not in `identity`: re-indexing a fit's
            # later step, with other weights, replaces the index of the same job.
            "weights_sha256": weights_digest(self.model),
            "revision": self.extra_meta.get("model", {}).get("revision"),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "vocab_size": getattr(config, "vocab_size", None),
        }
        projection = {
            "kind": "kronecker_gaussian" if self.projection_dim else "exact",
            "dim": self.projection_dim,
            "seed": self.seed,
        }
        modules = self.projector.describe()
        identity = {
            "model": model["name_or_path"],
            "modules": modules,
            "projection": projection,
            "storage_dtype": self.storage_dtype,
            "data": self.extra_meta.get("data"),
        }
        indexer = {
            "path": self.path_template,
            "module_filter": self.patterns,
            "projection_dim": self.projection_dim,
            "storage_dtype": self.storage_dtype,
            "seed": self.seed,
            "dataloader_idx": self.dataloader_idx,
        }
        return {
            **self.extra_meta,
            "indexer": indexer,
            "model": model,
            "modules": modules,
            "projection": projection,
            "loss": {"kind": "supervised_token_sum", "dtype": "float32"},
            "versions": package_versions(),
            "global_step": int(trainer.global_step),
            "identity": identity,  # what the fingerprint hashes, kept so a refusal can name what differs
            "fingerprint": fingerprint({**identity, "num_rows": num_rows}),
        }

    # -- one indexing run -----------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active(trainer):
            return
        self._val_runs += 1
        if self._val_runs % self.every_n_val_runs:
            return
        num_rows = self._num_rows(trainer)
        path = self.path_template.format(step=trainer.global_step)
        todo = None
        if trainer.is_global_zero:
            meta = self._meta(trainer, num_rows)
            if self.checkpoints:
                step = int(trainer.global_step) if self.step is None else int(self.step)
                lr = (
                    self.lr
                    if self.lr is not None
                    else (trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None)
                )
                meta = {
                    **meta,
                    "global_step": step,
                    "lr": lr,
                    "num_rows": num_rows,
                    "width": self.projector.width,
                    "storage_dtype": self.storage_dtype,
                }
                self._checkpoint = (path, step, lr)
                path = register_checkpoint(path, step, lr, meta, complete=False, overwrite=self.overwrite)
            self._writer = IndexWriter(
                path, num_rows, self.projector.width, self.storage_dtype, meta, self.overwrite, self.rows_per_chunk
            )
            todo = self._writer.todo
        self._todo = trainer.strategy.broadcast(todo, src=0)
        self._rows_done = 0
        self._rows_wanted = (
            int(np.count_nonzero(self._todo)) if self._todo is not None else 0
        )  # rows this run will write
        self._started = time.perf_counter()

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
        if not isinstance(batch, dict) or "index" not in batch:
            raise GradianError(
                "GradientIndexer needs dict batches with an 'index' entry (dataset positions); use gradian_lightning.data.collate or add batch['index']"
            )
        index = batch["index"]
        wanted = torch.as_tensor(self._todo[index.cpu().numpy()], device=index.device)
        rows, losses, supervised = self._compute(trainer, pl_module, batch, wanted)
        truncated = batch.get("truncated_tokens", torch.full_like(index, -1))
        ids = list(batch["id"]) if "id" in batch else [str(int(i)) for i in index]
        if trainer.world_size > 1:
            gathered = pl_module.all_gather(
                {"rows": rows, "loss": losses, "sup": supervised, "trunc": truncated, "index": index, "wanted": wanted}
            )
            rows, losses, supervised, truncated, index, wanted = (
                gathered[k].flatten(0, 1) for k in ("rows", "loss", "sup", "trunc", "index", "wanted")
            )
            all_ids: List[List[str]] = [None] * trainer.world_size  # type: ignore[list-item]
            torch.distributed.all_gather_object(all_ids, ids)
            ids = [i for part in all_ids for i in part]
        if trainer.is_global_zero:
            keep = wanted.cpu().numpy()
            self._writer.write(
                index.cpu().numpy()[keep],
                rows[wanted].cpu(),
                losses[wanted].cpu(),
                supervised[wanted].cpu(),
                truncated[wanted].cpu(),
                [i for i, k in zip(ids, keep) if k],
            )
            self._rows_done += int(keep.sum())
            for name, value in self._progress().items():
                pl_module.log(
                    name,
                    value,
                    prog_bar=True,
                    logger=False,
                    on_step=True,
                    on_epoch=False,
                    batch_size=len(keep),
                    rank_zero_only=True,
                )

    def _progress(self) -> Dict[str, float]:
        """The progress bar's numbers: rows written this run, rows per second, and seconds left at that rate."""
        rate = self._rows_done / max(time.perf_counter() - self._started, 1e-9)
        left = max(self._rows_wanted - self._rows_done, 0)
        return {
            "gradian_rows": float(self._rows_done),
            "gradian_rows_per_s": rate,
            "gradian_eta_s": left / rate if rate > 0 else float("inf"),
        }

    def _compute(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Dict[str, Any], wanted: torch.Tensor):
        """Rows [B, D] float32 (zeros where not wanted), losses [B] float32, supervised counts [B]."""
        size = batch["input_ids"].shape[0]
        rows = torch.zeros(size, self.projector.width, dtype=torch.float32, device=pl_module.device)
        losses = torch.zeros(size, dtype=torch.float32, device=pl_module.device)
        supervised = supervised_targets(batch["labels"]).sum(dim=1)
        if not bool(wanted.any()):
            return rows, losses, supervised
        devices = [pl_module.device] if pl_module.device.type != "cpu" else []
        # Lightning validates under torch.inference_mode by default; autograd needs it lifted, and
        # tensors made under it are only usable as inputs (indexing below makes ordinary copies).
        # fork_rng: a model left in train mode (dropout) must not advance the user's RNG.
        with (
            torch.random.fork_rng(devices=devices, device_type=pl_module.device.type),
            torch.inference_mode(False),
            torch.enable_grad(),
        ):
            sub = {k: batch[k][wanted] for k in ("input_ids", "attention_mask", "labels") if k in batch}
            try:
                sub_rows, sub_losses = projected_gradients(
                    self.model,
                    sub,
                    self.capture,
                    self.projector,
                    trainer.precision_plugin.forward_context(),
                    self.loss_chunk_tokens,
                    self.recompute,
                )
            except torch.OutOfMemoryError:
                raise self._out_of_memory(batch, wanted) from None
            except RuntimeError as err:  # MPS reports running out of memory as a plain RuntimeError
                if "out of memory" not in str(err).lower():
                    raise
                raise self._out_of_memory(batch, wanted) from None
        rows[wanted] = sub_rows
        losses[wanted] = sub_losses
        return rows, losses, supervised

    def _out_of_memory(self, batch: Dict[str, Any], wanted: torch.Tensor) -> DeviceOutOfMemoryError:
        """The one-line error for an accelerator OOM in this batch: what it held and what to lower."""
        n_supervised = int(supervised_targets(batch["labels"][wanted]).sum())
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        vocab = getattr(head, "out_features", None) or getattr(getattr(self.model, "config", None), "vocab_size", None)
        max_len = (self.extra_meta.get("data") or {}).get("max_seq_length")  # known when run from a config
        batch_size = ((self.extra_meta.get("config") or {}).get("grads") or {}).get(
            "batch_size", batch["input_ids"].shape[0]
        )
        chunk = self.loss_chunk_tokens
        peak = f"{human_bytes(fp32_logit_bytes(n_supervised, vocab, chunk))}" if vocab else "unknown (vocab unknown)"
        rows = batch["index"][wanted]
        # The third lever, named only when it is off and would bound this batch's logits.
        lever = SUGGESTED_LOSS_CHUNK_TOKENS
        third = (
            f"or set grads.loss_chunk_tokens={lever} (the same rows; the fp32 logits then need at most {human_bytes(fp32_logit_bytes(lever, vocab))} whatever the batch); "
            if chunk is None and vocab and n_supervised > lever
            else ""
        )
        return DeviceOutOfMemoryError(
            f"device out of memory indexing rows {int(rows.min())}-{int(rows.max())}: a batch of {int(wanted.sum())} rows "
            f"(grads.batch_size={batch_size}, grads.max_seq_length={max_len if max_len is not None else 'unknown'}, padded length {batch['input_ids'].shape[1]}) "
            f"holds {n_supervised} supervised tokens × vocab {vocab}, so its fp32 logits alone need {peak} (the loss writes their gradient into them; a 16-bit head adds half that again, on top of weights and activations; gradian plan predicts the whole peak); "
            "lower grads.batch_size first (the peak is linear in it; it costs only wall time), then grads.max_seq_length (it can cut completions); "
            f"{third}grads.storage_dtype, grads.module_filter and grads.projection_dim shrink the index on disk, not this tensor (docs/faq/out-of-memory.md)"
        )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active(trainer) or self._todo is None:
            return
        if trainer.is_global_zero:
            writer, self._writer = self._writer, None
            complete = writer.close()
            if self._checkpoint is not None:
                root, step, lr = self._checkpoint
                register_checkpoint(root, step, lr, writer.meta, complete=complete)
                self._checkpoint = None
            self.summary = {**summarize(writer, complete), "computed_rows": self._rows_done}
        run = {
            "step": int(trainer.global_step),
            "path": self.path_template.format(step=trainer.global_step),
            "rows": None,
            "complete": None,
        }
        if self.summary is not None and trainer.is_global_zero:
            run.update(rows=self.summary["rows"], complete=self.summary["complete"])
            if self.verbose:
                rank_zero_info(
                    f"GradientIndexer: step {run['step']}: {run['rows']}/{self.summary['num_rows']} rows in {run['path']} ({'complete' if run['complete'] else 'INCOMPLETE'})"
                )
        self.runs = [r for r in self.runs if r["step"] != run["step"]] + [run]  # a re-run of a step replaces its entry
        self._todo = None
        trainer.strategy.barrier()


def summarize(writer: IndexWriter, complete: bool) -> Dict[str, Any]:
    """What one indexing run wrote: counts of rows, truncation, empty and non-finite rows, bytes."""
    group = writer.group
    written = group["complete"][:]
    truncated = group["truncated_tokens"][:]
    empty = np.flatnonzero((group["supervised_tokens"][:] == 0) & written)
    nonfinite = np.flatnonzero(~group["finite"][:] & written)
    named = np.union1d(empty[:20], nonfinite[:20])  # the CLI names the first 20 of each
    return {
        "path": str(writer.path),
        "complete": complete,
        "rows": int(written.sum()),
        "num_rows": writer.num_rows,
        "bytes_on_disk": writer.path.bytes_on_disk(),
        "kept_rows": writer.kept_rows,
        "grads_bytes": int(group["grads"].nbytes),
        "truncated_rows": int(((truncated > 0) & written).sum()),
        "empty_rows": [int(i) for i in empty],
        "nonfinite_rows": [int(i) for i in nonfinite],
        "ids": dict(zip((int(i) for i in named), (str(v) for v in group["id"].oindex[named]))) if len(named) else {},
    }
