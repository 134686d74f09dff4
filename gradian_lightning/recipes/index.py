"""The `gradian index` recipe as plain functions: config -> model, data, Trainer -> index.

Everything the CLI does is here, so a notebook can do the same:
    cfg = load_config("configs/smollm2.yaml", ["data.train=my.jsonl"])
    summary = run_index(cfg)
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, Dict, Optional

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import TQDMProgressBar
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from gradian_lightning.config import require
from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.hub import file_sha256, load_model_and_tokenizer, normalized_name, pad_token_id
from gradian_lightning.index.callback import GradientIndexer
from gradian_lightning.index.location import Location
from gradian_lightning.recipes.plan import format_index_start, index_layout
from gradian_lightning.saved_models import load_saved_model, saved_models


class CausalLMModule(L.LightningModule):
    """The smallest LightningModule around a Hugging Face model: validation does nothing itself,
    so the only work per batch is the indexer's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def validation_step(self, batch: Dict[str, Any], batch_idx: int) -> None:
        return None


class IndexProgressBar(TQDMProgressBar):
    """Lightning's progress bar, with the indexer's numbers (gradian_rows, gradian_rows_per_s,
    gradian_eta_s) on the validation bar: `trainer.validate` has no training bar, which is where
    Lightning puts logged metrics."""

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        super().on_validation_batch_end(trainer, pl_module, *args, **kwargs)
        if not trainer.sanity_checking and not trainer.training:
            self.val_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)


def make_trainer(cfg: DictConfig, callbacks: list) -> L.Trainer:
    """A `lightning.Trainer` from `cfg.trainer` (passed as is) with quiet defaults for indexing."""
    user = OmegaConf.to_container(cfg.trainer, resolve=True)
    allowed = set(inspect.signature(L.Trainer.__init__).parameters) - {"self", "callbacks"}
    unknown = sorted(set(user) - allowed)
    if unknown:
        raise ConfigError(
            f"setting 'trainer.{unknown[0]}' is not a lightning.Trainer argument; see the Trainer's documentation for the names"
        )
    quiet = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False}
    if user.get("enable_progress_bar", True):
        callbacks = [*callbacks, IndexProgressBar()]
    try:
        return L.Trainer(callbacks=callbacks, **{**quiet, **user})
    except (ValueError, TypeError, MisconfigurationException) as err:
        # Lightning's message lists what it accepts but not which setting it was; find the key by
        # building a Trainer with each user setting alone (cheap: no model, no data).
        key = next((k for k in user if not _trainer_accepts(quiet, k, user[k])), next(iter(user), "?"))
        first = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"setting 'trainer.{key}'={user.get(key)!r} is refused by lightning.Trainer ({first}); see the Trainer's documentation for the values it takes"
        ) from None


def _trainer_accepts(quiet: Dict[str, Any], key: str, value: Any) -> bool:
    try:
        L.Trainer(**{**quiet, key: value})
    except (ValueError, TypeError, MisconfigurationException):
        return False
    return True


def run_index(cfg: DictConfig, announce: Optional[Callable[[str], None]] = None) -> Optional[Dict[str, Any]]:
    """Index `cfg.data.train` into `cfg.index.path`. Returns the summary of `GradientIndexer`.

    Under a multi-process strategy (trainer.strategy=ddp, num_nodes > 1) every process runs this and
    global rank 0 alone writes the index: it returns the summary, the other ranks None.
    `announce` (e.g. `print`) gets one line before the first batch: rows, modules, row width and
    the predicted index size, as `gradian plan` computes them.
    """
    require(cfg, "model.name_or_path", "data.train")
    rows = read_jsonl(cfg.data.train)  # data mistakes fail before the model loads
    Location(str(cfg.index.path))  # so does an s3:// or gs:// path whose filesystem is not installed
    meta = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model": {"name_or_path": normalized_name(cfg.model.name_or_path), "revision": cfg.model.revision},
        "data": {
            "path": normalized_name(str(cfg.data.train)),  # resolved: a resume from another folder is the same job
            "sha256": file_sha256(cfg.data.train),
            "max_seq_length": cfg.grads.max_seq_length,
        },
    }
    g = cfg.grads
    checkpoints = saved_models(
        cfg.model.checkpoints or []
    )  # steps and learning rates: a bad list fails before any model loads
    indexer = GradientIndexer(
        cfg.index.path,
        g.module_filter,
        g.projection_dim,
        g.storage_dtype,
        g.seed,
        overwrite=cfg.index.overwrite,
        meta=meta,
        rows_per_chunk=cfg.index.rows_per_chunk,
        loss_chunk_tokens=g.loss_chunk_tokens,
        recompute=g.recompute,
        checkpoints=bool(checkpoints),
        verbose=False,  # the CLI prints the summary
    )
    trainer = make_trainer(cfg, [indexer])  # before the model loads: trainer.* mistakes fail fast
    # model.checkpoints: one index, one checkpoint per saved model, keyed by its step (saved_models.py).
    for run, saved in enumerate(checkpoints or [None]):
        model, tokenizer = load_saved_model(cfg.model, saved.entry) if saved else load_model_and_tokenizer(cfg.model)
        dataset = JsonlDataset(rows, tokenizer, g.max_seq_length, source=str(cfg.data.train))
        if announce is not None and trainer.is_global_zero:  # before the launch too: ranks > 0 know their rank
            announce(
                format_index_start(
                    len(dataset), index_layout(model, g, len(dataset)), g.storage_dtype, str(cfg.index.path)
                )
            )
        loader = DataLoader(
            dataset,
            batch_size=g.batch_size,
            shuffle=False,
            collate_fn=partial(collate, pad_token_id=pad_token_id(tokenizer)),
        )
        indexer.step, indexer.lr, indexer.summary = (saved.step, saved.lr, None) if saved else (None, None, None)
        if run:
            trainer = make_trainer(cfg, [indexer])
        trainer.validate(CausalLMModule(model), dataloaders=loader, verbose=False)
        if not trainer.is_global_zero:
            continue
        if indexer.summary is None:
            raise GradianError(
                "indexing produced no summary; the validation loop did not run (check trainer.limit_val_batches)"
            )
    if not trainer.is_global_zero:
        return None
    return indexer.summary
