"""One batch -> one projected loss-gradient row per example. Plain torch: no Lightning, no zarr.

supervised_token_loss (loss.py)  under  LinearCapture hooks (capture.py)
  -> autograd.grad(sum of per-example losses, module outputs)  -> output-grads
  -> KroneckerProjector.project(inputs, output-grads)  (projection.py)  -> rows
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.capture import LinearCapture
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.gradients.recompute import recomputed_modules


class _Holder(nn.Module):
    """Holds the model as a child, so that `functional_call` swaps its parameters around any closure."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Callable[[], Any]) -> Any:
        return run()


@contextlib.contextmanager
def gradient_mode(device: torch.device) -> Iterator[None]:
    """What a gradient run inside someone else's loop needs: autograd on, and their RNG untouched.

    Lightning validates under `torch.inference_mode`, and a notebook may run under `no_grad`:
    autograd needs both lifted (tensors made under inference mode are only usable as inputs, so
    callers index batches into ordinary copies). `fork_rng`: a model left in train mode (dropout)
    must not advance the user's RNG, on the CPU or on `device`.
    """
    devices = [device] if device.type != "cpu" else []
    with (
        torch.random.fork_rng(devices=devices, device_type=device.type),
        torch.inference_mode(False),
        torch.enable_grad(),
    ):
        yield


def projected_gradients(
    model: nn.Module,
    batch: Dict[str, torch.Tensor],
    capture: LinearCapture,
    projector: KroneckerProjector,
    forward_context: Optional[ContextManager] = None,
    loss_chunk_tokens: Optional[int] = None,
    recompute: str = "none",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, D] float32 (the projected per-example gradients) and losses [B] float32 (nats).

    `batch` holds `input_ids`, `attention_mask`, `labels` [B, T]. `forward_context` wraps the
    forward and backward only (e.g. Lightning's autocast); the projection always runs in float32
    outside it. `loss_chunk_tokens`: see `supervised_token_loss`. No parameter's `.grad`,
    `requires_grad` or value is touched. Gradient mode must be enabled by the caller.

    Only output-gradients are needed, never weight gradients, so the forward runs with detached
    parameters (`torch.func.functional_call`): autograd then keeps no Linear's input for a weight
    gradient, and nothing at all before the first captured module. The captured inputs are
    projected in the forward hook and each output-gradient as the backward reaches it
    (capture.py's `_Tap`), so only [B, T, k] of each is held instead of [B, T, in] and [B, T, out].
    `recompute` ("none", "mlp" or "layers", `grads.recompute`) names what keeps only its input
    and is run again in the backward (recompute.py): lower peak memory for more time, the same
    rows (benchmarks/RESULTS.md, capture overhead).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if loss_chunk_tokens is not None and any(m is head for m in capture.modules.values()):
        raise ConfigError(
            f"setting 'grads.loss_chunk_tokens'={loss_chunk_tokens} runs the output head in chunks of its own, so the head cannot be captured; leave it out of grads.module_filter or set grads.loss_chunk_tokens=null"
        )
    detached = {f"model.{name}": p.detach() for name, p in model.named_parameters()}
    own_transform, own_output_transform = capture.input_transform, capture.output_transform
    if own_transform is None:
        capture.input_transform = projector.project_input
    if own_output_transform is None:
        capture.output_transform = projector.project_output

    def forward_backward() -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        with forward_context or contextlib.nullcontext(), capture, recomputed_modules(model, capture, recompute):
            losses = supervised_token_loss(model, batch, loss_chunk_tokens)
            return losses, capture.output_grads(losses.sum())

    try:
        # The detached parameters stand in for the model's own through the backward too, where
        # the recomputed layers run again (functional_call restores the model's own after).
        losses, output_grads = functional_call(_Holder(model), detached, (forward_backward,), strict=False)
        token_rows = supervised_targets(batch["labels"]).nonzero()[:, 0]
        rows = projector.project(
            capture.inputs,
            output_grads,
            batch["input_ids"].shape[0],
            token_rows,
            inputs_projected=own_transform is None,
            outputs_projected=own_output_transform is None,
        )
    finally:
        capture.clear()
        capture.input_transform, capture.output_transform = own_transform, own_output_transform
    return rows, losses.detach()
