"""Which linear modules to capture, and forward hooks that keep their inputs and output-gradients.

Capturable modules are the linear maps y = W x + b of a transformer: `nn.Linear` (weight [out, in])
and transformers' `Conv1D` (GPT-2's; weight [in, out], y = x W + b), see `linear_features`.
A pattern of `grads.module_filter` is matched against dotted module names
(`model.layers.3.mlp.down_proj`):
  - a pattern with `*`, `?` or `[` is a glob matched against the whole name (`*.layers.1?.mlp.*`);
  - any other pattern matches the whole name or a dotted suffix of it, component by component:
    `down_proj` and `mlp.down_proj` match every layer's down projection, `layers.3.mlp.down_proj`
    one of them, and `proj` matches nothing (it is not a whole component).
A capturable module is selected when a pattern matches its name or the name of a module it sits
in: `mlp` names every decoder layer's MLP block and so selects the linear maps inside each (the
default; Llama's gate/up/down projections, Phi's fc1/fc2, GPT-NeoX's dense_h_to_4h/dense_4h_to_h,
GPT-2's c_fc/c_proj), `layers.3` everything in layer 3. Every pattern must select something: one
that selects nothing is an error naming it, even beside patterns that do.

In a PEFT LoRA model a layer's Linears also answer to shorter names (peft.py): `q_proj` selects
the frozen `q_proj.base_layer`, `lora_A` / `lora_B` (or `q_proj.lora_A`, ...) select the active
adapter's matrices `q_proj.lora_A.default`, ... Adapter matrices are selected only by such names
(or a glob matching their own), never through a block they sit in: `mlp` selects the MLP's base
layers, not the adapters wrapped around them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import sys
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.gradients.peft import is_adapter_matrix, module_aliases

# What the errors call a capturable module.
CAPTURABLE = "nn.Linear or Conv1D"


def _conv1d_class() -> Optional[type]:
    # transformers' Conv1D, looked up rather than imported: importing transformers costs seconds, and
    # a model holding a Conv1D has imported it already.
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def linear_features(module: nn.Module) -> Optional[Tuple[int, int]]:
    """(out_features, in_features) of a capturable module, None for any other.

    Capturable: `nn.Linear` (weight [out, in]) and transformers' `Conv1D` (weight [in, out]).
    """
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return module.nf, module.nx
    return None


def weight_is_transposed(module: nn.Module) -> bool:
    """True when the module's weight is [in, out] (transformers' `Conv1D`), False for [out, in] (`nn.Linear`)."""
    conv1d = _conv1d_class()
    return conv1d is not None and isinstance(module, conv1d)


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


def _enclosing(name: str) -> List[str]:
    """The names of the modules `name` sits in: `a.b.c` -> [`a.b`, `a`]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def select_modules(model: nn.Module, patterns: List[str]) -> Dict[str, nn.Module]:
    """The capturable submodules of `model` (`linear_features`) that the patterns select, in model order.

    A module is selected when a pattern matches its name, a PEFT alias, or the name of a module
    it sits in (module docstring). Keys are the modules' own dotted names as in the unwrapped model
    (`unwrapped_name`), so an index written under FSDP, activation checkpointing or torch.compile
    names its modules as one written without. Raises `ConfigError` naming every pattern that
    selects nothing, with the candidates.
    """
    modules = dict(model.named_modules())
    linears: Dict[str, nn.Module] = {}
    answers: Dict[str, List[str]] = {}  # unwrapped name -> every name a pattern may match to select it
    for name, module in modules.items():
        aliases = module_aliases(modules, name) if linear_features(module) is not None else None
        if aliases is None:
            continue
        own = unwrapped_name(name)
        names = [unwrapped_name(a) for a in aliases]
        if not is_adapter_matrix(modules, name):
            names += [outer for alias in names for outer in _enclosing(alias)]
        linears[own], answers[own] = module, names
    selects = {p: {n for n, names in answers.items() if any(_matches(a, p) for a in names)} for p in patterns}
    unmatched = [p for p in patterns if not selects[p]]
    if unmatched:
        # Layer numbers make the list long and repetitive; show each distinct shape once.
        shapes = sorted({".".join("N" if part.isdigit() else part for part in name.split(".")) for name in linears})
        which = f"pattern {unmatched[0]!r} matches" if len(unmatched) == 1 else f"patterns {unmatched!r} match"
        raise ConfigError(
            f"setting 'grads.module_filter'={list(patterns)!r}: {which} no {CAPTURABLE} module; candidates (N = layer number), or a module holding some of them: {', '.join(shapes)}"
        )
    return {name: m for name, m in linears.items() if any(name in chosen for chosen in selects.values())}


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
        modules: Dict[str, nn.Module],
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
