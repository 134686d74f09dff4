"""Which Linear modules to capture, and forward hooks that keep their inputs and output-gradients.

A module is selected when a pattern of `grads.module_filter` matches its dotted name
(`model.layers.3.mlp.down_proj`):
  - a pattern with `*`, `?` or `[` is a glob matched against the whole name (`*.layers.1?.mlp.*`);
  - any other pattern matches the whole name or a dotted suffix of it, component by component:
    `down_proj` and `mlp.down_proj` match every layer's down projection, `layers.3.mlp.down_proj`
    one of them, and `proj` matches nothing (it is not a whole component).
Only `nn.Linear` modules are candidates. In a PEFT LoRA model a layer's Linears also answer to
shorter names (peft.py): `q_proj` selects the frozen `q_proj.base_layer`, `lora_A` / `lora_B` (or
`q_proj.lora_A`, ...) select the active adapter's matrices `q_proj.lora_A.default`, ...
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.gradients.peft import module_aliases


def _matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


# What wrappers insert into module names: FSDP1 units, activation-checkpoint wrappers (as Lightning's
# FSDP strategies apply them) and torch.compile. FSDP2's fully_shard inserts nothing.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A module's name as in the unwrapped model: `_fsdp_wrapped_module.model.layers.0.mlp` -> `model.layers.0.mlp`."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def select_modules(model: nn.Module, patterns: List[str]) -> Dict[str, nn.Linear]:
    """The `nn.Linear` submodules of `model` whose names (or PEFT aliases) match any pattern, in model order.

    Keys are the modules' own dotted names as in the unwrapped model (`unwrapped_name`), so an
    index written under FSDP, activation checkpointing or torch.compile names its modules as one
    written without. Raises `ConfigError` listing the candidates when nothing matches.
    """
    modules = dict(model.named_modules())
    own_names = module_aliases(model)
    aliases = {unwrapped_name(name): [unwrapped_name(a) for a in names] for name, names in own_names.items()}
    linears = {unwrapped_name(name): modules[name] for name in own_names}
    chosen = {
        name: m for name, m in linears.items() if any(_matches(alias, p) for alias in aliases[name] for p in patterns)
    }
    if not chosen:
        # Layer numbers make the list long and repetitive; show each distinct shape once.
        shapes = sorted({".".join("N" if part.isdigit() else part for part in name.split(".")) for name in linears})
        raise ConfigError(
            f"setting 'grads.module_filter'={patterns!r} matches no nn.Linear module; candidates (N = layer number): {', '.join(shapes)}"
        )
    return chosen


class _Tap(torch.autograd.Function):
    """Identity on a module's output whose backward hands the output-gradient to the capture.

    Its second input, the capture's scalar `anchor`, is what the backward is taken with respect
    to: every tap lies on a path from the loss to it, so each output-gradient passes through its
    tap once and is not kept by autograd until the end of the backward, as gradients with respect
    to the outputs themselves would be."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, anchor: torch.Tensor, name: str, capture: "LinearCapture") -> torch.Tensor:
        ctx.name, ctx.capture = name, capture
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        capture = ctx.capture
        capture.grads[ctx.name] = capture.output_transform(ctx.name, grad)
        return grad, grad.new_zeros(()), None, None


class LinearCapture:
    """Context manager: while active, each selected module's last input and output are kept.

    `inputs[name]` is the module's input, detached ([B, T, in] or [n, in]), or what
    `input_transform(name, input)` makes of it (the projection's input side, so that only
    [B, T, k] is kept through the backward instead of [B, T, in]). Without `output_transform`,
    `outputs[name]` is its output, left in the autograd graph so that `output_grads` can take
    `torch.autograd.grad` with respect to it. With `output_transform(name, grad)` (the projection's
    output side) no output is kept: each output passes through a `_Tap`, and `output_grads` gets
    `output_transform` of every output-gradient as the backward reaches it, so only [B, T, k] of
    each is held instead of every [B, T, out] at once (benchmarks/RESULTS.md, capture overhead).
    Outputs are made to require grad when the weights are frozen or detached, without touching any
    parameter.
    """

    def __init__(
        self,
        modules: Dict[str, nn.Linear],
        input_transform: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
        output_transform: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        self.modules = modules
        self.input_transform = input_transform
        self.output_transform = output_transform
        self.inputs: Dict[str, torch.Tensor] = {}
        self.outputs: Dict[str, torch.Tensor] = {}
        self.grads: Dict[str, torch.Tensor] = {}  # output_transform of each output-gradient, filled by the taps
        self._shapes: Dict[
            str, tuple
        ] = {}  # (shape, dtype, device) of each captured output, for modules the loss never reached
        self._anchor: Optional[torch.Tensor] = None
        self._handles: List[torch.utils.hooks.RemovableHandle] = []
        self._recomputing = False

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """While active, the hooks treat each module's run as a recomputation (recompute.py) of a
        forward already captured: outputs are marked as in that forward, nothing is kept."""
        self._recomputing = True
        try:
            yield
        finally:
            self._recomputing = False

    def _hook(self, name: str):
        def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if self._recomputing:
                if not output.requires_grad:
                    output.requires_grad_(True)  # the recomputed graph must save what the first one saved
                return
            if name in self._shapes:
                raise GradianError(
                    f"module {name!r} ran twice in one forward; shared modules cannot be captured, leave it out of grads.module_filter"
                )
            self._shapes[name] = (output.shape, output.dtype, output.device)
            x = args[0].detach()
            self.inputs[name] = x if self.input_transform is None else self.input_transform(name, x)
            if self.output_transform is not None:
                if self._anchor is None:
                    self._anchor = torch.zeros((), device=output.device, requires_grad=True)
                return _Tap.apply(output, self._anchor, name, self)  # the tapped output replaces the module's
            if not output.requires_grad:
                output.requires_grad_(True)  # frozen weights: a leaf, so this only marks it
            self.outputs[name] = output
            # Returning None keeps the module's output as it is.

        return keep

    def __enter__(self) -> "LinearCapture":
        self.clear()
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def output_grads(self, loss: torch.Tensor) -> Dict[str, torch.Tensor]:
        """d loss / d output for every captured module (passed through `output_transform` when
        set), without touching any parameter's `.grad`. A module the loss does not depend on gets zeros."""
        names = list(self.modules)
        missing = [n for n in names if n not in self._shapes]
        if missing:
            raise GradianError(
                f"modules {missing} did not run in the forward pass; remove them from grads.module_filter"
            )
        if self.output_transform is None:
            grads = torch.autograd.grad(loss, [self.outputs[n] for n in names], materialize_grads=True)
            return dict(zip(names, grads))
        self.grads.clear()
        torch.autograd.grad(loss, [self._anchor], allow_unused=True)
        for n in names:
            if n not in self.grads:  # the loss does not depend on this output
                shape, dtype, device = self._shapes[n]
                self.grads[n] = self.output_transform(n, torch.zeros(shape, dtype=dtype, device=device))
        return {n: self.grads[n] for n in names}

    def clear(self) -> None:
        """Drop the kept tensors (and with them the autograd graph)."""
        self.inputs.clear()
        self.outputs.clear()
        self.grads.clear()
        self._shapes.clear()
        self._anchor = None
