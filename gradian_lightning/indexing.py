"""The `gradian index` recipe as plain functions: config -> model, data, Trainer -> index.

Everything the CLI does is here, so a notebook can do the same:
    cfg = load_config("configs/smollm2.yaml", ["data.train=my.jsonl"])
    summary = run_index(cfg)
"""

from __future__ import annotations

import hashlib
import inspect
import os
from functools import partial
from pathlib import Path
from typing import Any, Dict, Tuple

import lightning as L
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from gradian_lightning.callback import GradientIndexer
from gradian_lightning.config import require
from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.errors import ConfigError, GradianError


def _from_pretrained(load: Any, name: str, **kwargs: Any) -> Any:
    """`load(name, **kwargs)` (a transformers `from_pretrained`), its failure as one `ConfigError` line."""
    try:
        return load(name, **kwargs)
    except Exception as err:  # OSError, ValueError, ...: transformers' messages are long; keep the gist
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "trust_remote_code" in str(err):
            raise ConfigError(f"model {name!r} ships its own code; if you trust it, pass model.trust_remote_code=true") from None
        raise ConfigError(f"setting 'model.name_or_path'={name!r} could not be loaded ({first}); give a local model directory or a Hugging Face name that is cached or reachable") from None


def _pretrained_args(model_cfg: DictConfig) -> Tuple[str, Dict[str, Any]]:
    name = os.path.expanduser(model_cfg.name_or_path)  # "~/..." in a YAML file means the home directory
    return name, {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code}


def load_model_and_tokenizer(model_cfg: DictConfig) -> Tuple[Any, Any]:
    """`from_pretrained` model (causal LM, eval mode) and fast tokenizer from a `model.*` config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, kwargs = _pretrained_args(model_cfg)
    dtype = model_cfg.dtype if model_cfg.dtype == "auto" else getattr(torch, model_cfg.dtype)
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name, use_fast=True, **kwargs)
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained, name, dtype=dtype, **kwargs)
    return model.eval(), tokenizer


def load_tokenizer_and_config(model_cfg: DictConfig) -> Tuple[Any, Any]:
    """The fast tokenizer and the `PretrainedConfig` of a `model.*` config, without loading weights."""
    from transformers import AutoConfig, AutoTokenizer

    name, kwargs = _pretrained_args(model_cfg)
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name, use_fast=True, **kwargs)
    return tokenizer, _from_pretrained(AutoConfig.from_pretrained, name, **kwargs)


def pad_token_id(tokenizer: Any) -> int:
    """The id `collate` pads with: the tokenizer's pad token, else its EOS token, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


class CausalLMModule(L.LightningModule):
    """The smallest LightningModule around a Hugging Face model: validation does nothing itself,
    so the only work per batch is the indexer's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def validation_step(self, batch: Dict[str, Any], batch_idx: int) -> None:
        return None


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    indexer = GradientIndexer(cfg.index.path, g.module_filter, g.projection_dim, g.storage_dtype, g.seed, overwrite=cfg.index.overwrite, meta=meta)
    trainer = make_trainer(cfg, [indexer])  # before the model loads: trainer.* mistakes fail fast
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    dataset = JsonlDataset(rows, tokenizer, g.max_seq_length, source=str(cfg.data.train))
    loader = DataLoader(dataset, batch_size=g.batch_size, shuffle=False, collate_fn=partial(collate, pad_token_id=pad_token_id(tokenizer)))
    trainer.validate(CausalLMModule(model), dataloaders=loader, verbose=False)
    if indexer.summary is None:
        raise GradianError("indexing produced no summary; the validation loop did not run (check trainer.limit_val_batches)")
    return indexer.summary
