"""The byte arithmetic of the fp32 loss peak, shared by `gradian plan` and the out-of-memory error.

`supervised_token_loss` (loss.py) upcasts only the gathered supervised positions, so its one fp32
tensor is `n_supervised × vocab × 4` bytes, `n_supervised` counting the whole batch's supervised tokens;
with `grads.loss_chunk_tokens` it is `min(n_supervised, loss_chunk_tokens) × vocab × 4`.
"""

from __future__ import annotations

from typing import Optional

FP32_BYTES = 4


def logit_peak_copies(logits_itemsize: int) -> float:
    """Tensors the size of the fp32 logits that the loss holds at its peak, for a model whose head
    computes logits of `logits_itemsize` bytes (4: fp32; 2: bf16/fp16, autocast included).

    The fp32 logits themselves, alone: the cross-entropy keeps nothing else of that size and writes
    their gradient into them (loss.py, `token_cross_entropy`). A 16-bit head adds its own output in
    the forward and that output's gradient in the backward, half the size, one at a time.
    """
    return 1.0 if logits_itemsize >= FP32_BYTES else 1.0 + logits_itemsize / FP32_BYTES


# What `gradian plan` and the out-of-memory error suggest for grads.loss_chunk_tokens: small enough
# that the [chunk, vocab] fp32 logits and a 16-bit head's copy stay under 200 MiB at Llama-3's
# 128,256-token vocabulary.
SUGGESTED_LOSS_CHUNK_TOKENS = 256


def fp32_logit_bytes(n_supervised: int, vocab_size: int, chunk_tokens: Optional[int] = None) -> int:
    """Bytes of the fp32 logit tensor for a batch with `n_supervised` supervised tokens in all.

    With `chunk_tokens` (grads.loss_chunk_tokens) the head and cross-entropy see at most that many
    tokens at a time, so the tensor is `min(n_supervised, chunk_tokens) × vocab × 4` bytes.
    """
    n = int(n_supervised) if chunk_tokens is None else min(int(n_supervised), int(chunk_tokens))
    return n * int(vocab_size) * FP32_BYTES


def human_bytes(n: float) -> str:
    """Bytes in binary units, e.g. '1.50 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
