"""The `gradian index` recipe as plain functions: config -> model, data, Trainer -> index.

Everything the CLI does is here, so a notebook can do the same:
    cfg = load_config("configs/smollm2.yaml", ["data.train=my.jsonl"])
    summary = run_index(cfg)
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Dict

import lightning as L
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from gradian_lightning.config import require
from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.hub import file_sha256, load_model_and_tokenizer, pad_token_id
from gradian_lightning.index.callback import GradientIndexer


class CausalLMModule(L.LightningModule):
    """The smallest LightningModule around a Hugging Face model: validation does nothing itself,
    so the only work per batch is the indexer's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def validation_step(self, batch: Dict[str, Any], batch_idx: int) -> None:
        return None


def make_trainer(cfg: DictConfig, callbacks: list) -> L.Trainer:
    """A `lightning.Trainer` from `cfg.trainer` (passed as is) with quiet defaults for indexing."""
    user = OmegaConf.to_container(cfg.trainer, resolve=True)
    allowed = set(inspect.signature(L.Trainer.__init__).parameters) - {"self", "callbacks"}
    unknown = sorted(set(user) - allowed)
    if unknown:
        raise ConfigError(f"setting 'trainer.{unknown[0]}' is not a lightning.Trainer argument; see the Trainer's documentation for the names")
    kwargs = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False, **user}
    return L.Trainer(callbacks=callbacks, **kwargs)


def run_index(cfg: DictConfig) -> Dict[str, Any]:
    """Index `cfg.data.train` into `cfg.index.path`. Returns the summary of `GradientIndexer`."""
    require(cfg, "model.name_or_path", "data.train")
    rows = read_jsonl(cfg.data.train)  # data mistakes fail before the model loads
    meta = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model": {"name_or_path": cfg.model.name_or_path, "revision": cfg.model.revision},
        "data": {"path": str(cfg.data.train), "sha256": file_sha256(cfg.data.train), "max_seq_length": cfg.grads.max_seq_length},
    }
    g = cfg.grads
    checkpoints = list(cfg.model.checkpoints or [])
    indexer = GradientIndexer(cfg.index.path, g.module_filter, g.projection_dim, g.storage_dtype, g.seed, overwrite=cfg.index.overwrite, meta=meta, checkpoints=bool(checkpoints))
    make_trainer(cfg, [])  # before the model loads: trainer.* mistakes fail fast
    # model.checkpoints: one index, one checkpoint per saved model, keyed by its position in the list.
    for step, name in enumerate(checkpoints or [cfg.model.name_or_path]):
        model_cfg = OmegaConf.merge(cfg.model, {"name_or_path": name})
        model, tokenizer = load_model_and_tokenizer(model_cfg)
        dataset = JsonlDataset(rows, tokenizer, g.max_seq_length, source=str(cfg.data.train))
        loader = DataLoader(dataset, batch_size=g.batch_size, shuffle=False, collate_fn=partial(collate, pad_token_id=pad_token_id(tokenizer)))
        indexer.step, indexer.summary = (step if checkpoints else None), None
        make_trainer(cfg, [indexer]).validate(CausalLMModule(model), dataloaders=loader, verbose=False)
        if indexer.summary is None:
            raise GradianError("indexing produced no summary; the validation loop did not run (check trainer.limit_val_batches)")
    return indexer.summary
