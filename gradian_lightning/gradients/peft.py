"""PEFT (LoRA) models: the causal LM to hook, and the names their Linear layers answer to.

PEFT's LoRA replaces each targeted `nn.Linear` (say `q_proj`) by a wrapper that is not itself an
`nn.Linear` and holds three that are:
  - `q_proj.base_layer`: the original layer, frozen (weight W, out × in);
  - `q_proj.lora_A.<adapter>`: A (r × in) and `q_proj.lora_B.<adapter>`: B (out × r), trainable;
and computes `q_proj(x) = W x + scaling · B A dropout(x)` (`<adapter>` is `default` unless named).
Every one of them sees the wrapper's own output-gradient path, so the gradient captured on
`base_layer` is d loss / d W with the adapter active, and the ones on `lora_A`/`lora_B` are the
gradients of the adapter's parameters: what LESS indexes.

Besides its own dotted name, each such Linear answers to a shorter one (`module_aliases`):
`q_proj.base_layer` also to `q_proj` (the layer means the same weight with or without LoRA), and
`q_proj.lora_A.default` also to `q_proj.lora_A` when `default` is an active adapter. Matrices of
inactive, disabled or merged adapters do not run in the forward, so they are no candidates.
PEFT wraps GPT-2's `Conv1D` layers the same way (its `base_layer` is the Conv1D).
Duck-typed: PEFT is not a dependency of gradian.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from torch import nn


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a `peft.PeftModel` (LoRA layers injected in place); else `model`.

    Its forward takes `logits_to_keep` (the PeftModel's `**kwargs` forward hides it), and its
    module names are those of the plain model plus the LoRA children.
    """
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA wrapper: a `base_layer` and `lora_A`/`lora_B` dicts of adapters."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def _adapter_runs(wrapper: nn.Module, adapter: str) -> bool:
    active = getattr(wrapper, "active_adapters", None) or []
    return (
        adapter in active and not getattr(wrapper, "disable_adapters", False) and not getattr(wrapper, "merged", False)
    )


def _adapter_layer(modules: Dict[str, nn.Module], name: str) -> Optional[nn.Module]:
    """The LoRA layer whose adapter matrix `name` is (`q_proj` for `q_proj.lora_A.default`), else None."""
    grand, _, kind = name.rpartition(".")[0].rpartition(".")
    wrapper = modules.get(grand) if grand else None
    return wrapper if wrapper is not None and kind.startswith("lora_") and is_lora_layer(wrapper) else None


def is_adapter_matrix(modules: Dict[str, nn.Module], name: str) -> bool:
    """Module `name` of `modules` (a model's `named_modules()`) is a LoRA adapter's A or B matrix."""
    return _adapter_layer(modules, name) is not None


def module_aliases(modules: Dict[str, nn.Module], name: str) -> Optional[List[str]]:
    """The names the linear module `name` of `modules` (a model's `named_modules()`) answers to, its own first.

    Plain models: its own name only. In PEFT LoRA layers, see the module docstring. None for a LoRA
    matrix of an adapter that does not run: it is no candidate.
    """
    parent, _, leaf = name.rpartition(".")
    wrapper = modules.get(parent) if parent else None
    if wrapper is not None and leaf == "base_layer" and is_lora_layer(wrapper):
        return [name, parent]
    wrapper = _adapter_layer(modules, name)
    if wrapper is not None:
        return [name, parent] if _adapter_runs(wrapper, leaf) else None
    return [name]
