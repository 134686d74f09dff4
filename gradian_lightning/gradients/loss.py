"""Per-example language-model loss, fp32 only where it is supervised ("gather-then-upcast").

The full fp32 logits of a batch are `B × T × vocab × 4` bytes, the largest tensor of the whole job.
Only supervised positions enter the loss, so they are gathered first:
  - when the model's forward takes a boolean `logits_to_keep` mask (transformers' Llama, Mistral,
    Qwen, ...), the output head runs only at the gathered hidden states, so even the
    low-precision logits are `n_supervised × vocab`;
  - otherwise the full logits are computed in the model's dtype and gathered before the upcast.
The one fp32 tensor is then `n_supervised × vocab × 4` bytes, where `n_supervised` counts the
supervised tokens in the whole batch: at most `batch_size × supervised_tokens_per_row`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from gradian_lightning.data import IGNORE_INDEX
from gradian_lightning.errors import GradianError


def supervised_targets(labels: torch.Tensor) -> torch.Tensor:
    """Bool mask [B, T]: position t is supervised when it predicts a label (labels[t + 1] != -100)."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


@functools.lru_cache(maxsize=None)
def _accepts_logits_to_keep(model_class: type) -> bool:
    # Once per model class, not per batch: inspecting a signature is slow next to a tiny model's step.
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def supervised_token_loss(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example loss: the sum of token cross-entropies over supervised positions, in fp32.

    `batch` holds `input_ids`, `attention_mask` and `labels` (int64 [B, T], labels -100 where not
    supervised; the causal shift is applied here). Returns float32 [B], nats. A row with no
    supervised token gets exactly 0. Summing (not averaging) keeps examples' gradients independent.
    """
    labels = batch["labels"]
    keep = supervised_targets(labels)  # [B, T]
    targets = labels[:, 1:][keep[:, :-1]]  # [n_supervised]
    rows = keep.nonzero()[:, 0]  # example of each supervised position, [n_supervised]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
    if _accepts_logits_to_keep(type(model)):
        logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
        if logits.shape[:-1] != targets.shape:
            raise GradianError(
                f"{type(model).__name__} ignored the boolean logits_to_keep mask (logits {tuple(logits.shape)}); "
                "upgrade transformers to a version whose forward accepts a 2-D bool logits_to_keep"
            )
    else:
        logits = model(**inputs, use_cache=False).logits[keep]
    token_loss = F.cross_entropy(logits.float(), targets, reduction="none")  # [n_supervised] fp32
    losses = torch.zeros(labels.shape[0], dtype=torch.float32, device=labels.device)
    return losses.index_add(0, rows, token_loss)
