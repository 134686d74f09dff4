"""Recompute each decoder layer's activations in the indexing backward instead of keeping them.

    forward:  each decoder layer runs under `torch.utils.checkpoint` (non-reentrant): autograd keeps
              only the layer's inputs, not what its attention, MLP and norms would save
    backward: a layer's forward is re-run (with the same detached parameters and RNG state) when
              the backward reaches it, and its saved tensors are freed after its backward

So the activations kept through the backward are one [tokens, hidden] input per layer plus one
layer's own, instead of every layer's; the cost is a second forward of the layers. The model is
not changed: each layer's `forward` is wrapped on the instance for the duration of the context
and restored after. Layers that another wrapper already manages (FSDP units, activation
checkpointing, sharded DTensor parameters) are left as they are.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, List

from torch import nn
from torch.utils.checkpoint import checkpoint

from gradian_lightning.gradients.capture import LinearCapture

# Wrappers that already own their layer's forward and backward: recomputing around them would
# gather FSDP shards twice or checkpoint twice.
_MANAGED = ("FullyShardedDataParallel", "CheckpointWrapper", "FSDPModule")


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The decoder layers of a transformers causal LM (`get_decoder().layers`), or [] when it has none."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _managed(layer: nn.Module) -> bool:
    if any(name in c.__name__ for c in type(layer).__mro__ for name in _MANAGED):
        return True
    return any(type(p).__name__ == "DTensor" for p in layer.parameters(recurse=True))


@contextlib.contextmanager
def recomputed_layers(model: nn.Module, capture: LinearCapture) -> Iterator[None]:
    """While active, `model`'s decoder layers keep only their inputs for the backward (module docstring).

    `capture`'s hooks see the recomputation as such (`LinearCapture.recomputing`), so each module
    is still captured once. The forward and the backward must both run inside this context.
    """
    layers = [layer for layer in decoder_layers(model) if not _managed(layer)]
    own = [layer.__dict__.get("forward") for layer in layers]  # an instance-level forward (e.g. accelerate's hooks) is kept and called

    def recomputed(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            contexts = lambda: (contextlib.nullcontext(), capture.recomputing())  # noqa: E731
            return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        return forward

    try:
        for layer, inner in zip(layers, own):
            layer.forward = recomputed(inner or functools.partial(type(layer).forward, layer))
        yield
    finally:
        for layer, inner in zip(layers, own):
            if inner is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = inner
