"""The byte arithmetic of the fp32 loss peak, shared by `gradian plan` and the out-of-memory error.

`supervised_token_loss` (loss.py) upcasts only the gathered supervised positions, so its one fp32
tensor is `n_supervised × vocab × 4` bytes, `n_supervised` counting the whole batch's supervised tokens.
"""

from __future__ import annotations

FP32_BYTES = 4
# The fp32 logits are not alone at the peak: cross-entropy keeps their log-softmax for backward,
# and backward makes a gradient of each, so three tensors of that size are alive at once.
LOGIT_PEAK_COPIES = 3


def fp32_logit_bytes(n_supervised: int, vocab_size: int) -> int:
    """Bytes of the fp32 logit tensor for a batch with `n_supervised` supervised tokens in all."""
    return int(n_supervised) * int(vocab_size) * FP32_BYTES


def human_bytes(n: float) -> str:
    """Bytes in binary units, e.g. '1.50 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
