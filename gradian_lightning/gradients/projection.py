"""Kronecker random projection of per-example linear-module gradients, computed from the factors.

For an `nn.Linear` with input x_t ∈ R^in and output-gradient g_t ∈ R^out at token t, one example's
weight gradient is G = Σ_t g_t x_tᵀ ∈ R^{out×in}. We store P_out G P_inᵀ ∈ R^{k×k}, which equals
Σ_t (P_out g_t)(P_in x_t)ᵀ, so G is never materialised: cost O(T·k·(in + out)) per example.
A block keeps its weight's layout: transformers' `Conv1D` (GPT-2) holds its weight as [in, out]
(y = x W + b), so its gradient is Gᵀ = Σ_t x_t g_tᵀ ∈ R^{in×out} and its block P_in Gᵀ P_outᵀ.
Exact rows (`dim=None`) hold each weight gradient itself, flattened row-major as `.grad` would be.

P_out [k, out] and P_in [k, in] have i.i.d. N(0, 1/k) entries, so inner products of projected
gradients are unbiased estimates of the exact ones. They are drawn on the CPU from a generator
seeded by (seed, module name), hence identical on every device and rank and independent of the
global RNG (drawing from it would change the user's training run).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.gradients.capture import linear_features, weight_is_transposed


def module_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from (seed, module name), stable across runs and platforms."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class ModuleBlock:
    """Where one module's projected gradient lives in a row: columns [offset, offset + size).

    `shape` is (k_out, k_in), or (out, in) when exact; with `transposed` (a Conv1D, weight [in, out])
    (k_in, k_out), or (in, out) when exact: the block is laid out as the module's weight is.
    """

    name: str
    out_features: int
    in_features: int
    shape: Tuple[int, int]
    offset: int
    transposed: bool = False

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def to_entry(self) -> Dict[str, object]:
        """This block as plain data, for the index attribute "modules". A Conv1D's block adds
        `"transposed": true` (laid out [in, out]); an nn.Linear's has no such key."""
        return {
            "name": self.name,
            "out_features": self.out_features,
            "in_features": self.in_features,
            "shape": list(self.shape),
            "offset": self.offset,
            "size": self.size,
            **({"transposed": True} if self.transposed else {}),
        }

    @classmethod
    def from_entry(cls, entry: Dict[str, Any]) -> "ModuleBlock":
        """The block `to_entry` wrote. A layout given to `IndexWriter` by hand may name only each
        block's "offset" and "size" (and "name"): such a block is one flat [1, size] block."""
        shape = entry.get("shape") or (1, entry["size"])
        return cls(
            entry.get("name", f"block@{entry['offset']}"),
            int(entry.get("out_features", shape[0])),
            int(entry.get("in_features", shape[1])),
            (int(shape[0]), int(shape[1])),
            int(entry["offset"]),
            bool(entry.get("transposed", False)),
        )


class KroneckerProjector:
    """Maps captured (inputs, output-grads) of linear modules (`capture.linear_features`) to one row per example.

    `dim=None` stores the exact flattened weight gradient (out × in per module, in the weight's
    layout): for small modules and tests.
    """

    def __init__(self, modules: Dict[str, nn.Module], dim: Optional[int], seed: int) -> None:
        self.dim, self.seed = dim, seed
        self.blocks: List[ModuleBlock] = []
        self._matrices: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        offset = 0
        for name, module in modules.items():
            out_f, in_f = linear_features(module)
            transposed = weight_is_transposed(module)
            if dim is None:
                shape = (in_f, out_f) if transposed else (out_f, in_f)
            else:
                if dim > min(out_f, in_f):
                    raise ConfigError(
                        f"setting 'grads.projection_dim'={dim} exceeds module {name!r} ({out_f}×{in_f}); use at most {min(out_f, in_f)} or leave that module out"
                    )
                shape = (dim, dim)
                generator = torch.Generator().manual_seed(module_seed(seed, name))
                p_out = torch.randn(dim, out_f, generator=generator) / dim**0.5
                p_in = torch.randn(dim, in_f, generator=generator) / dim**0.5
                self._matrices[name] = (p_out, p_in)
            self.blocks.append(ModuleBlock(name, out_f, in_f, shape, offset, transposed))
            offset += shape[0] * shape[1]
        self.width = offset
        self._on_device: Dict[torch.device, Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = {}

    def matrices(self, name: str, device: torch.device | str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
        """(P_out [k, out], P_in [k, in]) float32 for one module, on `device`."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = {n: (a.to(device), b.to(device)) for n, (a, b) in self._matrices.items()}
        return self._on_device[device][name]

    def project_input(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The input side of module `name`'s projection: x [.., in] -> x P_inᵀ [.., k] float32.

        Exact rows (dim None) keep x as it is. Runs in float32 even inside an autocast region, so
        that it can be applied in a forward hook (`LinearCapture(input_transform=...)`), where it
        lets the wide input go before the backward; `project(..., inputs_projected=True)` then
        gives the very same rows.
        """
        if self.dim is None:
            return x
        p_in = self.matrices(name, x.device)[1]
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ p_in.T

    def project_output(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """The output side of module `name`'s projection: g [.., out] -> g P_outᵀ [.., k] float32.

        Exact rows (dim None) keep g as it is. Like `project_input`, runs in float32 outside
        autocast, so that it can be applied to each output-gradient during the backward
        (`LinearCapture(output_transform=...)`); `project(..., outputs_projected=True)` then gives
        the very same rows.
        """
        if self.dim is None:
            return g
        p_out = self.matrices(name, g.device)[0]
        with torch.autocast(g.device.type, enabled=False):
            return g.float() @ p_out.T

    def project(
        self,
        inputs: Dict[str, torch.Tensor],
        output_grads: Dict[str, torch.Tensor],
        batch_size: int,
        token_rows: Optional[torch.Tensor] = None,
        inputs_projected: bool = False,
        outputs_projected: bool = False,
    ) -> torch.Tensor:
        """Rows [batch_size, width] float32, one per example.

        `inputs[name]` and `output_grads[name]` are [B, T, in] / [B, T, out] (per-position), or
        [n, in] / [n, out] for a module that ran only on gathered positions, in which case
        `token_rows` (int64 [n]) says which example each position belongs to. Any dtype: the
        arithmetic is done in float32. `inputs_projected` / `outputs_projected`: `inputs` /
        `output_grads` already went through `project_input` / `project_output` ([.., k]).
        """
        out = []
        for block in self.blocks:
            rows, cols = self._factors(block, inputs, output_grads, inputs_projected, outputs_projected)
            if rows.dim() == 3:
                grad = torch.einsum("btr,btc->brc", rows, cols)
            elif rows.dim() == 2 and token_rows is not None and token_rows.shape[0] == rows.shape[0]:
                owner = torch.zeros(batch_size, rows.shape[0], dtype=rows.dtype, device=rows.device)
                owner[token_rows, torch.arange(rows.shape[0], device=rows.device)] = 1.0
                grad = torch.einsum("bn,nr,nc->brc", owner, rows, cols)
            else:
                raise GradianError(
                    f"module {block.name!r} saw input of shape {tuple(inputs[block.name].shape)}, not [batch, tokens, features]; leave it out of grads.module_filter"
                )
            out.append(grad.reshape(batch_size, -1))
        return torch.cat(out, dim=1)

    def _factors(
        self,
        block: ModuleBlock,
        inputs: Dict[str, torch.Tensor],
        output_grads: Dict[str, torch.Tensor],
        inputs_projected: bool,
        outputs_projected: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One module's projected (rows, cols) per position, float32 [.., k] each, in the order of
        the weight's layout: (P_out g, P_in x) for [out, in], (P_in x, P_out g) for a Conv1D's [in, out]."""
        x = inputs[block.name]
        if not inputs_projected:
            x = self.project_input(block.name, x)
        x = x.float()
        g = output_grads[block.name]
        g = g.float() if outputs_projected else self.project_output(block.name, g)  # [.., k]
        return (x, g) if block.transposed else (g, x)

    def project_positions(
        self,
        inputs: Dict[str, torch.Tensor],
        output_grads: Dict[str, torch.Tensor],
        shape: Tuple[int, int],
        positions: Optional[torch.Tensor] = None,
        inputs_projected: bool = False,
        outputs_projected: bool = False,
    ) -> torch.Tensor:
        """Per-position rows [B, T, width] float32: at [b, t], each module's term of position t,
        (P_out g_t)(P_in x_t)ᵀ, not summed over positions. Summed over T they are `project`'s rows,
        to float32 rounding (the sum is taken in another order).

        `shape` is the batch's (B, T). A module that ran only on gathered positions ([n, in], e.g.
        an output head run at supervised positions) fills the positions `positions` (int64 [n, 2]:
        example and position of each) and leaves the others zero. Other arguments as in `project`.
        """
        batch_size, length = shape
        out: Optional[torch.Tensor] = None
        for block in self.blocks:
            rows, cols = self._factors(block, inputs, output_grads, inputs_projected, outputs_projected)
            if out is None:
                out = torch.zeros(batch_size, length, self.width, device=rows.device)
            where = slice(block.offset, block.offset + block.size)
            if rows.dim() == 3:
                out[:, :, where] = torch.einsum("btr,btc->btrc", rows, cols).reshape(batch_size, length, -1)
            elif rows.dim() == 2 and positions is not None and positions.shape[0] == rows.shape[0]:
                out[positions[:, 0], positions[:, 1], where] = torch.einsum("nr,nc->nrc", rows, cols).reshape(
                    rows.shape[0], -1
                )
            else:
                raise GradianError(
                    f"module {block.name!r} saw input of shape {tuple(inputs[block.name].shape)}, not [batch, tokens, features]; leave it out of grads.module_filter"
                )
        return out if out is not None else torch.zeros(batch_size, length, 0)

    def describe(self) -> List[Dict[str, object]]:
        """The row layout as plain data, for the index attributes (`ModuleBlock.to_entry`)."""
        return [b.to_entry() for b in self.blocks]
