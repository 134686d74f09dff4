"""`GradientRows`: (model, batch) -> one projected loss-gradient row per example. Plain torch: no Lightning, no zarr.

    select_modules (capture.py) -> KroneckerProjector (projection.py) -> LinearCapture hooks that
    project each input in the forward and each output-gradient in the backward
      -> supervised_token_loss (loss.py) -> autograd to the module outputs -> rows [B, D] float32

Indexing (index/session.py), query rows (query/rows.py) and token scores (query/token_scores.py)
all make their rows with one of these, so the three cannot disagree: the same modules, projection,
loss, eval mode and RNG handling.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch
from torch import nn
from torch.func import functional_call

from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.loss import LOSS_KIND, supervised_targets, supervised_token_loss
from gradian_lightning.gradients.peft import unwrap_peft
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.gradients.recompute import recomputed_modules
from gradian_lightning.gradients.weights import weights_digest
from gradian_lightning.hub import describe_model
from gradian_lightning.specs import IndexSpec

BATCH_KEYS = ("input_ids", "attention_mask", "labels")


class _Holder(nn.Module):
    """Holds the model as a child, so that `functional_call` swaps its parameters around any closure."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Callable[[], Any]) -> Any:
        return run()


@contextlib.contextmanager
def _gradient_mode(model: nn.Module, device: torch.device) -> Iterator[None]:
    """What a gradient run inside someone else's loop needs, all undone on the way out.

    Eval mode: rows are made without dropout, however the caller left the model (Lightning
    validates in eval mode; a notebook's model may be in train mode), and every submodule's own
    mode is restored after. `fork_rng`: nothing the run draws advances the caller's RNG, on the
    CPU or on `device`. Lightning validates under `torch.inference_mode`, and a notebook may run
    under `no_grad`: autograd needs both lifted.
    """
    training = {m: m.training for m in model.modules()}
    devices = [device] if device.type != "cpu" else []
    try:
        model.eval()
        with (
            torch.random.fork_rng(devices=devices, device_type=device.type),
            torch.inference_mode(False),
            torch.enable_grad(),
        ):
            yield
    finally:
        for module, mode in training.items():
            module.training = mode


class GradientRows:
    """Projected per-example loss gradients of one model's selected Linear modules.

    Args:
        model: a Hugging Face causal LM (a `peft.PeftModel` runs as its base model, adapters in place).
        spec: the row settings (specs.py): module_filter, projection_dim, seed, loss_chunk_tokens
            and recompute are used here; storage_dtype is the store's.
        modules: the modules to capture, by name, instead of `select_modules(model, spec.module_filter)`
            (a query takes the index's modules by the names it stored).

    Calling it with a batch gives (rows [B, D] float32, losses [B] float32 nats), or with
    `per_position=True` each position's part of the rows ([B, T, D], token scores); `projector.width`
    is D and `projector.describe()` the row layout. The model's parameters, their `.grad` and
    `requires_grad`, every submodule's train/eval mode and the caller's RNG are left as they were.
    """

    def __init__(self, model: nn.Module, spec: IndexSpec, modules: Optional[Dict[str, nn.Linear]] = None) -> None:
        self.model = model = unwrap_peft(model)
        self.spec = spec
        self.modules = select_modules(model, spec.module_filter) if modules is None else modules
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if spec.loss_chunk_tokens is not None and any(m is head for m in self.modules.values()):
            raise ConfigError(
                f"setting 'grads.loss_chunk_tokens'={spec.loss_chunk_tokens} runs the output head in chunks of its own, so the head cannot be captured; leave it out of grads.module_filter or set grads.loss_chunk_tokens=null"
            )
        self.projector = KroneckerProjector(self.modules, spec.projection_dim, spec.seed)
        # Inputs are projected in the forward hook and each output-gradient as the backward
        # reaches it (capture.py's `_Tap`): only [B, T, k] of each is held, not [B, T, in] and [B, T, out].
        self.capture = LinearCapture(self.modules, self.projector.project_input, self.projector.project_output)

    def describe(self, name_or_path: Optional[str] = None) -> Dict[str, Any]:
        """What an index records of how its rows were made: the model (class, name, vocabulary,
        dtype and weights digest, which a query's model must match: query/rows.py), the row layout
        ("modules": the width is their sum) and the loss."""
        return {
            "model": {**describe_model(self.model, name_or_path), "weights_sha256": weights_digest(self.model)},
            "modules": self.projector.describe(),
            "loss": {"kind": LOSS_KIND, "dtype": "float32"},
        }

    def __call__(
        self,
        batch: Dict[str, torch.Tensor],
        forward_context: Optional[ContextManager] = None,
        per_position: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rows [B, D] float32 and losses [B] float32 (nats) of a batch of `input_ids`,
        `attention_mask`, `labels` [B, T] on the model's device.

        `per_position`: rows [B, T, D] instead, each position's own part of its example's row
        (`KroneckerProjector.project_positions`): the part carried by position t's inputs and
        output-gradients, the latter those of the whole example's loss. They sum over T to the
        rows made without it (to float32 rounding), from the same one forward and backward.

        `forward_context` wraps the forward and backward only (e.g. Lightning's autocast); the
        projection always runs in float32. Tensors made under inference mode are fine: the run
        works on ordinary copies of them.

        Only output-gradients are needed, never weight gradients, so the forward runs with
        detached parameters (`torch.func.functional_call`): autograd then keeps no Linear's input
        for a weight gradient, and nothing at all before the first captured module.
        `spec.recompute` names what keeps only its input and is run again in the backward
        (recompute.py): lower peak memory for more time, the same rows.
        """
        model, capture = self.model, self.capture
        with _gradient_mode(model, batch["input_ids"].device):
            batch = {k: batch[k].clone() for k in BATCH_KEYS if k in batch}  # ordinary tensors
            detached = {f"model.{name}": p.detach() for name, p in model.named_parameters()}

            def forward_backward() -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
                with (
                    forward_context or contextlib.nullcontext(),
                    capture,
                    recomputed_modules(model, capture, self.spec.recompute),
                ):
                    losses = supervised_token_loss(model, batch, self.spec.loss_chunk_tokens)
                    return losses, capture.output_grads(losses.sum())

            try:
                # The detached parameters stand in for the model's own through the backward too,
                # where the recomputed layers run again (functional_call restores the model's own after).
                losses, output_grads = functional_call(_Holder(model), detached, (forward_backward,), strict=False)
                supervised = supervised_targets(batch["labels"]).nonzero()  # [n, 2]: (example, position)
                if per_position:
                    rows = self.projector.project_positions(
                        capture.inputs,
                        output_grads,
                        tuple(batch["input_ids"].shape),
                        supervised,
                        inputs_projected=True,
                        outputs_projected=True,
                    )
                else:
                    rows = self.projector.project(
                        capture.inputs,
                        output_grads,
                        batch["input_ids"].shape[0],
                        supervised[:, 0],
                        inputs_projected=True,
                        outputs_projected=True,
                    )
            finally:
                capture.clear()
        return rows, losses.detach()
