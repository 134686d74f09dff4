"""Per-example language-model loss, fp32 only where it is supervised ("gather-then-upcast").

The full fp32 logits of a batch are `B × T × vocab × 4` bytes, the largest tensor of the whole job.
Only supervised positions enter the loss, so they are gathered first:
  - when the model's forward takes a boolean `logits_to_keep` mask (transformers' Llama, Mistral,
    Qwen, ...), the output head runs only at the gathered hidden states, so even the
    low-precision logits are `n_supervised × vocab`;
  - otherwise the full logits are computed in the model's dtype and gathered before the upcast.
The one fp32 tensor is then `n_supervised × vocab × 4` bytes, where `n_supervised` counts the
supervised tokens in the whole batch: at most `batch_size × supervised_tokens_per_row`.

The cross-entropy (`token_cross_entropy`) keeps only that tensor for the backward and computes its
gradient in place of it, so it is the only tensor of that size alive at the peak (F.cross_entropy
keeps the log-softmax beside it and makes two more in its backward: three).

With `chunk_tokens` (`grads.loss_chunk_tokens`) the output head and the fp32 cross-entropy run over
the gathered positions `chunk_tokens` at a time, under `torch.utils.checkpoint`: each chunk's logits
are freed before the next and recomputed in the backward, so the fp32 part of the peak is
`chunk_tokens × vocab × 4` bytes whatever the batch, for one more head matmul per token.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradian_lightning.data import IGNORE_INDEX
from gradian_lightning.errors import ConfigError, GradianError

# Config keys of architectures that transform logits after the output head (Gemma's soft-capping,
# Cohere's and Granite's scaling): the chunked loss owns the head, so it cannot reproduce them.
# What `supervised_token_loss` computes, as an index records it: a query of an index that recorded
# another loss is refused (query/rows.py).
LOSS_KIND = "supervised_token_sum"
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def supervised_targets(labels: torch.Tensor) -> torch.Tensor:
    """Bool mask [B, T]: position t is supervised when it predicts a label (labels[t + 1] != -100)."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


@functools.lru_cache(maxsize=None)
def _accepts_logits_to_keep(model_class: type) -> bool:
    # Once per model class, not per batch: inspecting a signature is slow next to a tiny model's step.
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


# Rows of the logits exponentiated at once in the log-sum-exp: its temporary is [LSE_ROWS, vocab], not [n, vocab].
LSE_ROWS = 16


class _TokenCrossEntropy(torch.autograd.Function):
    """-log softmax(logits)[target] per row, keeping only the logits and writing their gradient into them."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)
        for i in range(0, logits.shape[0], LSE_ROWS):
            lse[i : i + LSE_ROWS] = torch.logsumexp(logits[i : i + LSE_ROWS], dim=1)
        ctx.save_for_backward(logits, targets, lse)
        return lse - logits.gather(1, targets[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        # d loss_i / d logits_ij = softmax_ij - [j = target_i]. The logits are this function's own
        # fp32 tensor (made for the loss, read by nothing else after the forward), so the gradient
        # overwrites them: no second [n, vocab] tensor. Should another op have saved them,
        # autograd's version check fails loudly when it unpacks them. A view (a captured head's
        # output, seen through the capture's tap) must not be written: it gets a new tensor.
        out = logits.sub(lse[:, None]) if logits._is_view() else logits.sub_(lse[:, None])
        out = out.exp_().mul_(grad[:, None])
        out[torch.arange(len(targets), device=out.device), targets] -= grad
        return out, None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each row of fp32 `logits` [n, vocab] at `targets` int64 [n]: float32 [n], nats.

    The same values as `F.cross_entropy(logits, targets, reduction="none")` (to float32 rounding),
    with one [n, vocab] tensor at the peak instead of three (module docstring). `logits` must be a
    tensor made for this loss (the fp32 upcast, or the head's fp32 output): its values are
    overwritten by the backward.
    """
    return _TokenCrossEntropy.apply(logits, targets)


def _head_cross_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return token_cross_entropy(F.linear(hidden, weight, bias).float(), targets)


def _chunked_token_loss(
    model: nn.Module,
    inputs: Dict[str, Any],
    keep: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """Token losses [n_supervised] fp32 from the decoder's hidden states, head + cross-entropy in checkpointed chunks."""
    if chunk_tokens < 1:
        raise ConfigError(
            f"setting 'grads.loss_chunk_tokens'={chunk_tokens!r} is not allowed; use an integer >= 1, or null for the whole batch at once"
        )
    config = getattr(model, "config", None)
    transforms = [k for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if transforms or not isinstance(head, nn.Linear) or decoder is None or decoder is model:
        why = (
            f"its logits go through {', '.join(transforms)} after the head"
            if transforms
            else "it has no nn.Linear output head over a separate decoder"
        )
        raise ConfigError(
            f"setting 'grads.loss_chunk_tokens'={chunk_tokens} cannot be used with {type(model).__name__}: {why}; set grads.loss_chunk_tokens=null"
        )
    hidden = decoder(**inputs, use_cache=False).last_hidden_state[keep]  # [n_supervised, H]
    # The head's tensors are read now, not at recompute time: ones that `functional_call` swapped
    # in for this call (GradientRows' detached parameters) stay in use in the backward.
    weight, bias = head.weight, head.bias
    parts = [
        checkpoint(
            _head_cross_entropy,
            hidden[i : i + chunk_tokens],
            targets[i : i + chunk_tokens],
            weight,
            bias,
            use_reentrant=False,
        )
        for i in range(0, hidden.shape[0], chunk_tokens)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def supervised_token_loss(
    model: nn.Module,
    batch: Dict[str, torch.Tensor],
    chunk_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Per-example loss: the sum of token cross-entropies over supervised positions, in fp32.

    `batch` holds `input_ids`, `attention_mask` and `labels` (int64 [B, T], labels -100 where not
    supervised; the causal shift is applied here). Returns float32 [B], nats. A row with no
    supervised token gets exactly 0. Summing (not averaging) keeps examples' gradients independent.
    `chunk_tokens`: run the head and cross-entropy that many supervised tokens at a time,
    recomputed in the backward (bounded fp32 peak, same losses).
    """
    labels = batch["labels"]
    keep = supervised_targets(labels)  # [B, T]
    targets = labels[:, 1:][keep[:, :-1]]  # [n_supervised]
    rows = keep.nonzero()[:, 0]  # example of each supervised position, [n_supervised]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
    if chunk_tokens is not None:
        token_loss = _chunked_token_loss(model, inputs, keep, targets, chunk_tokens)
    else:
        if _accepts_logits_to_keep(type(model)):
            logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
            if logits.shape[:-1] != targets.shape:
                raise GradianError(
                    f"{type(model).__name__} ignored the boolean logits_to_keep mask (logits {tuple(logits.shape)}); "
                    "upgrade transformers to a version whose forward accepts a 2-D bool logits_to_keep"
                )
        else:
            logits = model(**inputs, use_cache=False).logits[keep]
        token_loss = token_cross_entropy(logits.float(), targets)  # [n_supervised] fp32
    losses = torch.zeros(labels.shape[0], dtype=torch.float32, device=labels.device)
    return losses.index_add(0, rows, token_loss)
