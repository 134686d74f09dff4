"""Recompute activations in the indexing backward instead of keeping them (`grads.recompute`).

    forward:  each unit (`mlp`: every decoder layer's MLP block; `layers`: every decoder layer)
              runs under `torch.utils.checkpoint` (non-reentrant): autograd keeps only the unit's
              inputs, not what its matmuls' consumers (SiLU, the gate product, attention, norms) save
    backward: a unit's forward is re-run (with the same detached parameters and RNG state) when
              the backward reaches it, stopping as soon as what it saved is back, and those
              tensors are freed after its backward

Why `mlp` is the default: an MLP block keeps more than half of a Llama layer's activations (its
gate and up outputs, 1,536 wide against the 576 of SmolLM2's hidden state, and their product), and
re-running it costs its gate and up matmuls only (the down projection's output is saved by
nothing, so the recomputation stops before it). Its peak memory and time beside keeping everything
and recomputing whole layers: benchmarks/RESULTS.md §1.
The model is not changed: each unit's `forward` is wrapped on the instance for the duration of
the context and restored after. Units that another wrapper already manages (FSDP units,
activation checkpointing, sharded DTensor parameters) are left as they are, and a model without
transformers' `get_decoder().layers` (GPT-2: `.h`; or layers without an `mlp`) runs as it is: recomputation
changes memory and time, never the rows.
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
    """The decoder layers of a transformers causal LM (`get_decoder().layers`; GPT-2's `.h`), or [] when it has none."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        layers = getattr(decoder, "h", None)  # GPT-2 keeps the name of its original code
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _wrapped(module: nn.Module) -> bool:
    return any(name in c.__name__ for c in type(module).__mro__ for name in _MANAGED)


def _managed(layer: nn.Module) -> bool:
    return _wrapped(layer) or any(type(p).__name__ == "DTensor" for p in layer.parameters(recurse=True))


def recomputed_units(model: nn.Module, what: str) -> List[nn.Module]:
    """The modules `grads.recompute` = `what` runs again in the backward: "layers" the decoder
    layers, "mlp" their `mlp` blocks, "none" nothing. A unit that a wrapper already manages, or
    that sits in a layer it manages, is left to that wrapper."""
    if what == "none":
        return []
    units = []
    for layer in decoder_layers(model):
        unit = layer if what == "layers" else getattr(layer, "mlp", None)
        if isinstance(unit, nn.Module) and not _managed(layer) and not _wrapped(unit):
            units.append(unit)
    return units


@contextlib.contextmanager
def recomputed_modules(model: nn.Module, capture: LinearCapture, what: str) -> Iterator[None]:
    """While active, the units of `recomputed_units(model, what)` keep only their inputs for the
    backward (module docstring).

    `capture`'s hooks see the recomputation as such (`LinearCapture.recomputing`), so each module
    is still captured once. The forward and the backward must both run inside this context.
    """
    units = recomputed_units(model, what)
    own = [
        unit.__dict__.get("forward") for unit in units
    ]  # an instance-level forward (e.g. accelerate's hooks) is kept and called

    def recomputed(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            contexts = lambda: (contextlib.nullcontext(), capture.recomputing())  # noqa: E731
            return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        return forward

    try:
        for unit, inner in zip(units, own):
            unit.forward = recomputed(inner or functools.partial(type(unit).forward, unit))
        yield
    finally:
        for unit, inner in zip(units, own):
            if inner is None:
                unit.__dict__.pop("forward", None)
            else:
                unit.forward = inner
