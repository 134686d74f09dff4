"""One training run of a validation: a plain Lightning fine-tune on a subset, then each query's loss.

The run is seeded and leaves the caller's torch RNG as it was. The model comes from a factory, so a
Python user can retrain their own LightningModule (`gradian_lightning.run_validate(cfg, module_factory=...)`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.gradients.loss import supervised_token_loss
from gradian_lightning.hub import pad_token_id
from gradian_lightning.interrupts import keyboard_interrupt


class FineTune(L.LightningModule):
    """Plain causal-LM fine-tuning (AdamW at `lr`, the model's mean token loss); its validation step only logs the loss."""

    def __init__(self, model: Any, lr: float = 3e-3) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def _loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), batch_size=len(batch["index"]), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def run_seed(seed: int, subset: int, repeat: int) -> int:
    """The seed of subset `subset`'s `repeat`-th training run: distinct for every run of a validation."""
    return seed + 1000 * repeat + subset


def fine_tune(
    module: L.LightningModule,
    rows: Sequence[Dict[str, Any]],
    tokenizer: Any,
    max_seq_length: int,
    batch_size: int,
    epochs: int,
    seed: int,
    trainer_kwargs: Dict[str, Any],
) -> None:
    """Train `module` on `rows` for `epochs` epochs (shuffled by `seed`), with Lightning."""
    dataset = JsonlDataset(rows, tokenizer, max_seq_length, source="validate subset")
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        collate_fn=partial(collate, pad_token_id=pad_token_id(tokenizer)),
        generator=torch.Generator().manual_seed(seed),
    )
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        trainer = L.Trainer(max_epochs=epochs, **{**quiet, **trainer_kwargs})
        with keyboard_interrupt():  # Ctrl-C stays KeyboardInterrupt: `gradian validate` says what was kept
            trainer.fit(module, loader)


def query_losses(
    model: torch.nn.Module, tokenizer: Any, queries: Sequence[Dict[str, Any]], max_seq_length: int, batch_size: int
) -> np.ndarray:
    """Each query's loss under `model`: float64 [Q], nats summed over its supervised tokens."""
    dataset = JsonlDataset(queries, tokenizer, max_seq_length, source="query.data")
    loader = DataLoader(
        dataset, batch_size=batch_size, collate_fn=partial(collate, pad_token_id=pad_token_id(tokenizer))
    )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses: List[torch.Tensor] = []
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            losses.append(supervised_token_loss(model, batch).double().cpu())
    model.train(was_training)
    return torch.cat(losses).numpy()
