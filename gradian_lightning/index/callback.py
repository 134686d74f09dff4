"""`GradientIndexer`: the Lightning glue. Life-cycle, ranks, inference mode and progress; no maths.

One validation batch flows: dataloader batch -> `projected_gradients` (gradients/: the loss under
capture hooks, output-grads, the Kronecker projection) -> `IndexWriter` rows at the batch's
dataset positions (index/writer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning as L
import numpy as np
import torch
from torch import nn

from gradian_lightning.config import STORAGE_DTYPES, module_patterns
from gradian_lightning.errors import ConfigError, DeviceOutOfMemoryError, GradianError
from gradian_lightning.gradients.batch import projected_gradients
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.loss import supervised_targets
from gradian_lightning.gradients.memory import LOGIT_PEAK_COPIES, fp32_logit_bytes, human_bytes
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.index.layout import fingerprint
from gradian_lightning.index.checkpoints import register_checkpoint
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.versions import package_versions


def find_causal_lm(pl_module: nn.Module, attribute: Optional[str] = None) -> nn.Module:
    """The Hugging Face model inside a LightningModule: `attribute` (dotted) or the top-most PreTrainedModel."""
    if attribute:
        model = pl_module
        for part in attribute.split("."):
            model = getattr(model, part, None)
            if model is None:
                raise ConfigError(f"GradientIndexer(model_attribute={attribute!r}): {type(pl_module).__name__} has no attribute {part!r}")
        return model
    from transformers import PreTrainedModel

    for _, module in pl_module.named_modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise ConfigError(f"GradientIndexer found no transformers PreTrainedModel inside {type(pl_module).__name__}; pass model_attribute='name_of_the_model_attribute'")


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
        meta: extra plain data stored in the index attributes (the CLI stores its config).
        checkpoints: keep every indexed validation run as one checkpoint of one index at `path`,
            keyed by global step (or `self.step` when set), with the learning rate at that step
            (index/checkpoints.py); queries then sum the checkpoints' scores (`query.checkpoints`).
        every_n_val_runs: index only every n-th validation run (1: each).
    """

    def __init__(
        self,
        path: str | Path,
        module_filter: str | List[str] = "down_proj",
        projection_dim: Optional[int] = 16,
        storage_dtype: str = "float16",
        seed: int = 0,
        dataloader_idx: int = 0,
        model_attribute: Optional[str] = None,
        overwrite: bool = False,
        meta: Optional[Dict[str, Any]] = None,
        checkpoints: bool = False,
        every_n_val_runs: int = 1,
    ) -> None:
        if storage_dtype not in STORAGE_DTYPES:
            raise ConfigError(f"setting 'grads.storage_dtype'={storage_dtype!r} is not allowed; use {' or '.join(STORAGE_DTYPES)}")
        if projection_dim is not None and projection_dim < 1:
            raise ConfigError(f"setting 'grads.projection_dim'={projection_dim!r} is not allowed; use an integer >= 1, or null for exact gradients")
        self.path_template = str(path)
        self.patterns = module_patterns(module_filter)
        self.projection_dim, self.storage_dtype, self.seed = projection_dim, storage_dtype, seed
        self.dataloader_idx, self.model_attribute, self.overwrite = dataloader_idx, model_attribute, overwrite
        self.extra_meta = dict(meta or {})
        self.summary: Optional[Dict[str, Any]] = None  # set on rank 0 after each indexing run
        self._writer: Optional[IndexWriter] = None
        self._todo: Optional[np.ndarray] = None
        if every_n_val_runs < 1:
            raise ConfigError(f"GradientIndexer(every_n_val_runs={every_n_val_runs!r}) is not allowed; use an integer >= 1")
        # checkpoints=True: each indexed validation run adds checkpoint `step` (default: the
        # global step) to one index at `path` (index/checkpoints.py) instead of replacing it.
        self.checkpoints, self.every_n_val_runs, self.step = checkpoints, every_n_val_runs, None
        self._val_runs, self._checkpoint = 0, None

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.model = find_causal_lm(pl_module, self.model_attribute)
        self.modules = select_modules(self.model, self.patterns)
        self.projector = KroneckerProjector(self.modules, self.projection_dim, self.seed)
        self.capture = LinearCapture(self.modules)

    def _active(self, trainer: L.Trainer, dataloader_idx: int = 0) -> bool:
        return not trainer.sanity_checking and dataloader_idx == self.dataloader_idx

    def _num_rows(self, trainer: L.Trainer) -> int:
        loaders = trainer.val_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        if self.dataloader_idx >= len(loaders):
            raise ConfigError(f"GradientIndexer(dataloader_idx={self.dataloader_idx}) but there are {len(loaders)} validation dataloaders")
        dataset = getattr(loaders[self.dataloader_idx], "dataset", None)
        try:
            return len(dataset)
        except TypeError:
            raise ConfigError("GradientIndexer needs a dataloader over a map-style dataset with a length (rows land at dataset positions)") from None

    def _meta(self, trainer: L.Trainer, num_rows: int) -> Dict[str, Any]:
        config = getattr(self.model, "config", None)
        model = {
            "class": type(self.model).__name__,
            "name_or_path": getattr(config, "_name_or_path", None) or self.extra_meta.get("model", {}).get("name_or_path"),
            "revision": self.extra_meta.get("model", {}).get("revision"),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "vocab_size": getattr(config, "vocab_size", None),
        }
        projection = {"kind": "kronecker_gaussian" if self.projection_dim else "exact", "dim": self.projection_dim, "seed": self.seed}
        modules = self.projector.describe()
        identity = {"model": model["name_or_path"], "modules": modules, "projection": projection, "storage_dtype": self.storage_dtype, "data": self.extra_meta.get("data")}
        indexer = {"path": self.path_template, "module_filter": self.patterns, "projection_dim": self.projection_dim, "storage_dtype": self.storage_dtype, "seed": self.seed, "dataloader_idx": self.dataloader_idx}
        return {
            **self.extra_meta,
            "indexer": indexer,
            "model": model,
            "modules": modules,
            "projection": projection,
            "loss": {"kind": "supervised_token_sum", "dtype": "float32"},
            "versions": package_versions(),
            "global_step": int(trainer.global_step),
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
                lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
                meta = {**meta, "global_step": step, "lr": lr, "num_rows": num_rows, "width": self.projector.width, "storage_dtype": self.storage_dtype}
                self._checkpoint = (path, step, lr)
                path = register_checkpoint(path, step, lr, meta, complete=False, overwrite=self.overwrite)
            self._writer = IndexWriter(path, num_rows, self.projector.width, self.storage_dtype, meta, self.overwrite)
            todo = self._writer.todo
        self._todo = trainer.strategy.broadcast(todo, src=0)
        self._rows_done = 0

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._active(trainer, dataloader_idx) or self._todo is None:
            return
        if not isinstance(batch, dict) or "index" not in batch:
            raise GradianError("GradientIndexer needs dict batches with an 'index' entry (dataset positions); use gradian_lightning.data.collate or add batch['index']")
        index = batch["index"]
        wanted = torch.as_tensor(self._todo[index.cpu().numpy()], device=index.device)
        rows, losses, supervised = self._compute(trainer, pl_module, batch, wanted)
        truncated = batch.get("truncated_tokens", torch.full_like(index, -1))
        ids = list(batch["id"]) if "id" in batch else [str(int(i)) for i in index]
        if trainer.world_size > 1:
            gathered = pl_module.all_gather({"rows": rows, "loss": losses, "sup": supervised, "trunc": truncated, "index": index, "wanted": wanted})
            rows, losses, supervised, truncated, index, wanted = (gathered[k].flatten(0, 1) for k in ("rows", "loss", "sup", "trunc", "index", "wanted"))
            all_ids: List[List[str]] = [None] * trainer.world_size  # type: ignore[list-item]
            torch.distributed.all_gather_object(all_ids, ids)
            ids = [i for part in all_ids for i in part]
        if trainer.is_global_zero:
            keep = wanted.cpu().numpy()
            self._writer.write(
                index.cpu().numpy()[keep], rows[wanted].cpu(), losses[wanted].cpu(), supervised[wanted].cpu(), truncated[wanted].cpu(), [i for i, k in zip(ids, keep) if k]
            )
            self._rows_done += int(keep.sum())
            pl_module.log("gradian_rows", float(self._rows_done), prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=len(keep), rank_zero_only=True)

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
        with torch.random.fork_rng(devices=devices, device_type=pl_module.device.type), torch.inference_mode(False), torch.enable_grad():
            sub = {k: batch[k][wanted] for k in ("input_ids", "attention_mask", "labels") if k in batch}
            try:
                sub_rows, sub_losses = projected_gradients(self.model, sub, self.capture, self.projector, trainer.precision_plugin.forward_context())
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
        batch_size = ((self.extra_meta.get("config") or {}).get("grads") or {}).get("batch_size", batch["input_ids"].shape[0])
        peak = f"{human_bytes(fp32_logit_bytes(n_supervised, vocab))}" if vocab else "unknown (vocab unknown)"
        rows = batch["index"][wanted]
        return DeviceOutOfMemoryError(
            f"device out of memory indexing rows {int(rows.min())}-{int(rows.max())}: a batch of {int(wanted.sum())} rows "
            f"(grads.batch_size={batch_size}, grads.max_seq_length={max_len if max_len is not None else 'unknown'}, padded length {batch['input_ids'].shape[1]}) "
            f"holds {n_supervised} supervised tokens × vocab {vocab}, so its fp32 logits alone need {peak} ({LOGIT_PEAK_COPIES}× that with their log-softmax and gradients, on top of weights and activations; gradian plan predicts the whole peak); "
            "lower grads.batch_size first (the peak is linear in it; it costs only wall time), then grads.max_seq_length (it can cut completions); "
            "grads.storage_dtype, grads.module_filter and grads.projection_dim shrink the index on disk, not this tensor (docs/faq/out-of-memory.md)"
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
            self.summary = summarize(writer, complete)
        self._todo = None
        trainer.strategy.barrier()


def _bytes_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


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
        "bytes_on_disk": _bytes_on_disk(writer.path),
        "grads_bytes": int(group["grads"].nbytes),
        "truncated_rows": int(((truncated > 0) & written).sum()),
        "empty_rows": [int(i) for i in empty],
        "nonfinite_rows": [int(i) for i in nonfinite],
        "ids": dict(zip((int(i) for i in named), (str(v) for v in group["id"].oindex[named]))) if len(named) else {},
    }
