"""Which weights a model holds, as a short digest: an index records it, a query checks it.

An index is only meaningful for the weights its rows were made with. A path says little (the same
weights live under many paths; a fine-tune can be saved over its base), so an index records a
digest of the weights themselves, and a query with other weights is refused however its model
was named (query/rows.py).
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
from torch import nn

from gradian_lightning.gradients.capture import unwrapped_name

# Values sampled per parameter: training moves essentially every value of every tensor it updates,
# so a few thousand evenly spaced ones tell two checkpoints apart, at a cost independent of model
# size (hashing every byte of a 7B model would take a minute).
SAMPLES_PER_PARAMETER = 4096


def weights_digest(model: nn.Module) -> Optional[str]:
    """Hex SHA-256 (16 characters) of the model's parameters: for each, in name order, its name,
    dtype, shape and SAMPLES_PER_PARAMETER evenly spaced values (their bytes as stored).

    None when a parameter is sharded (FSDP2's DTensor): no rank holds the whole tensor there.
    """
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters(), key=lambda item: unwrapped_name(item[0])):
        if type(parameter.data).__name__ == "DTensor":
            return None
        flat = parameter.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLES_PER_PARAMETER)].to("cpu").contiguous()
        digest.update(f"{unwrapped_name(name)}|{parameter.dtype}|{tuple(parameter.shape)}|".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
