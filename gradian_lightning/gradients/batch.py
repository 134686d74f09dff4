"""One batch -> one projected loss-gradient row per example. Plain torch: no Lightning, no zarr.

    supervised_token_loss (loss.py)  under  LinearCapture hooks (capture.py)
      -> autograd.grad(sum of per-example losses, module outputs)  -> output-grads
      -> KroneckerProjector.project(inputs, output-grads)  (projection.py)  -> rows
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Dict, Optional, Tuple

import torch
from torch import nn

from gradian_lightning.gradients.capture import LinearCapture
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss
from gradian_lightning.gradients.projection import KroneckerProjector


def projected_gradients(
    model: nn.Module,
    batch: Dict[str, torch.Tensor],
    capture: LinearCapture,
    projector: KroneckerProjector,
    forward_context: Optional[ContextManager] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, D] float32 (the projected per-example gradients) and losses [B] float32 (nats).

    `batch` holds `input_ids`, `attention_mask`, `labels` [B, T]. `forward_context` wraps the
    forward and backward only (e.g. Lightning's autocast); the projection always runs in float32
    outside it. No parameter's `.grad` is touched. Gradient mode must be enabled by the caller.
    """
    with forward_context or contextlib.nullcontext(), capture:
        losses = supervised_token_loss(model, batch)
        output_grads = capture.output_grads(losses.sum())
    token_rows = supervised_targets(batch["labels"]).nonzero()[:, 0]
    try:
        rows = projector.project(capture.inputs, output_grads, batch["input_ids"].shape[0], token_rows)
    finally:
        capture.clear()
    return rows, losses.detach()
