"""Full-space K-FAC / EK-FAC factors of the selected Linear modules. Plain torch: no Lightning, no zarr.

For a module y = W x (W [out, in]; a Conv1D's [in, out] weight is treated as its transpose, so
every factor here is in the (out, in) orientation), one example's weight gradient is
G_n = Σ_t δ_t x_tᵀ [out, in], δ_t = d loss_n / d y_t (the `supervised_token_loss`, summed over
the example's supervised tokens, true labels). The Fisher of that loss, E_n[vec G_n vec G_nᵀ], is
approximated by

    K-FAC:   G ⊗ A,   A = Σ x_t x_tᵀ / positions [in, in],   G = Σ δ_t δ_tᵀ / examples [out, out]
    EK-FAC:  (Q_G ⊗ Q_A) diag(Λ) (Q_G ⊗ Q_A)ᵀ,   Λ[o, i] = Σ_n (Q_Gᵀ G_n Q_A)[o, i]² / examples

with A = Q_A diag(λ_A) Q_Aᵀ and G = Q_G diag(λ_G) Q_Gᵀ. K-FAC's eigenvalues are then λ_G[o] λ_A[i].

A module fitted with a *diagonal* G (`diagonal_g`: the output head, whose vocab × vocab G would be
9.7 GB in float32 at SmolLM2's 49,152 words) keeps λ_G = diag(G) and the identity as Q_G, stored
as an empty tensor (`in_output_basis`): G's off-diagonal, the words' co-occurrence in one softmax, is
dropped, and the per-word second moment E[Σ_t δ_t²] stays, an IDF learnt from the softmax
(benchmarks/studies/lds_sets/README.md, "the output head's gradient against BM25").

Decisions (the issue left them open):
  - Positions: A and G sum over the *gradient-carrying* positions of each row, the attended
    positions at or before its last supervised position (`carrying_positions`). Later positions
    and padding have δ = 0 exactly (causal attention), so they add nothing to G; leaving them out
    of A keeps A the second moment of the inputs whose gradients the Fisher is made of (Bergson
    collects the same positions; Kronfluence takes every attended position into A).
  - Normalisation: A per position, G per example (examples = rows with a supervised token), so
    that G ⊗ A ≈ E_n[vec G_n vec G_nᵀ] on the scale of EK-FAC's Λ, itself per example. Kronfluence
    and Bergson divide both by the position count, which is the same up to one factor common to
    every module that sees every position; with damping relative to each module's mean eigenvalue
    (exact.py) a common factor changes no ranking.

Fitting streams batches through two passes with bounded memory: `FactorFit.covariances` (A, G
sums, [in, in] + [out, out] per module), then `Eigenbases.from_sums`, then `FactorFit.lambdas`
(Λ sums, [out, in] per module, needs the bases). Each pass returns `FactorSums`, plain tensors
that add (`a + b`): batches, and ranks (an all-reduce of `.tensors`), sum into one. A pass over
many batches adds each batch's products into one running `FactorSums` in place (`into=`), and
`from_sums(..., consume=True)` frees each module's sums as its bases are made: the sums of
SmolLM2-135M's MLP are 0.97 GB in float32, and a new sum per batch (`total + part`) held three
such sets at once, which glibc then kept (benchmarks/RESULTS.md §13).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Collection, ContextManager, Dict, Iterable, Optional

import torch
from torch import nn
from torch.func import functional_call

from gradian_lightning.errors import GradianError
from gradian_lightning.gradients.batch import BATCH_KEYS, _gradient_mode, _Holder
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss
from gradian_lightning.gradients.peft import unwrap_peft
from gradian_lightning.gradients.recompute import recomputed_modules
from gradian_lightning.specs import IndexSpec

# Elements of the largest temporary a per-example step makes at once ([c, out, in] examples'
# rotated gradients): 2**25 float32 is 128 MiB, whatever the batch.
CHUNK_ELEMENTS = 2**25


def carrying_positions(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool [B, T]: attended positions at or before the row's last supervised position (t with
    labels[t + 1] != -100), the positions whose output-gradient can be non-zero."""
    keep = supervised_targets(batch["labels"])
    steps = torch.arange(1, keep.shape[1] + 1, device=keep.device)
    last = (keep * steps).amax(dim=1)  # 1 + last supervised position, 0 for a row with none
    mask = steps[None, :] <= last[:, None]
    attention = batch.get("attention_mask")
    return mask if attention is None else mask & attention.bool()


# What `TokenPass` hands on for each module: (name, x [B, L, in], δ [B, L, out]) in the pass's
# dtype: L = T with both zero outside `carrying_positions`, or, for a module that ran on the
# gathered supervised positions only (the output head under `logits_to_keep`), L = the most
# supervised positions of any row, each row's packed at the front and zero after. Every consumer
# sums over a row's positions (Σ_t δ_t x_tᵀ, Σ x xᵀ, ...), which their order does not change.
ModuleStep = Callable[[str, torch.Tensor, torch.Tensor], None]


class TokenPass:
    """One forward + backward of `supervised_token_loss` that shows each selected module's inputs
    and output-gradients to a callback, as `GradientRows` makes rows: the same module selection,
    eval mode, forked RNG, detached parameters (no `.grad` touched), recomputation.

    Args:
        model: a Hugging Face causal LM (a PEFT model runs as its base model).
        spec: `module_filter`, `recompute` and `loss_chunk_tokens` are used.
        modules: the modules by name, instead of `select_modules(model, spec.module_filter)`.
        dtype: what x and δ are cast to before the callback (float32, or float64 in tests).

    `run(batch, step)` calls `step(name, x, δ)` once per module as the backward reaches it, with
    x [B, L, in] and δ [B, L, out] as `ModuleStep` says; each module's input is
    held from the forward until then (in the model's dtype), as a training backward holds it, and
    let go after.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: IndexSpec,
        modules: Optional[Dict[str, nn.Module]] = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = unwrap_peft(model)
        self.spec, self.dtype = spec, dtype
        self.modules = select_modules(self.model, spec.module_filter) if modules is None else modules

    def run(
        self,
        batch: Dict[str, torch.Tensor],
        step: ModuleStep,
        forward_context: Optional[ContextManager] = None,
    ) -> torch.Tensor:
        """Calls `step` for every module; returns the losses [B] float32 (nats)."""
        model = self.model
        with _gradient_mode(model, batch["input_ids"].device):
            batch = {k: batch[k].clone() for k in BATCH_KEYS if k in batch}  # ordinary tensors
            mask = carrying_positions(batch)
            gathered = supervised_targets(batch["labels"])  # where a head under logits_to_keep ran
            # Row and packed slot of each gathered position, in the row-major order the head saw them:
            # a head's δ is [B, most supervised, vocab], not [B, T, vocab] (4.2 GB at T = 2,048 for a
            # batch of 4 over Llama-3's 128,256 words, where the supervised positions may be a few).
            rows, at = gathered.nonzero(as_tuple=True)
            slot = (gathered.cumsum(dim=1) - 1)[rows, at]
            packed = int(gathered.sum(dim=1).max()) if gathered.numel() else 0

            def dense(t: torch.Tensor, name: str) -> torch.Tensor:
                # [B, T, f] masked, or a module that ran on the gathered supervised positions only
                # ([n, f]) packed to [B, most supervised, f]: every consumer sums over positions.
                with torch.autocast(t.device.type, enabled=False):
                    t = t.to(self.dtype)
                    if t.dim() == 3 and t.shape[:2] == mask.shape:
                        return t * mask[..., None]
                    if t.dim() == 2 and t.shape[0] == len(rows):
                        out = t.new_zeros(mask.shape[0], packed, t.shape[1])
                        out[rows, slot] = t
                        return out
                raise GradianError(
                    f"module {name!r} saw input of shape {tuple(t.shape)}, not [batch, tokens, features]; leave it out of grads.module_filter"
                )

            def on_grad(name: str, grad: torch.Tensor) -> torch.Tensor:
                # The input is let go as soon as its module's backward has used it, not at the end.
                step(name, dense(capture.inputs.pop(name), name), dense(grad, name))
                return grad.new_zeros(0)  # nothing for the capture to keep

            capture = LinearCapture(self.modules, lambda name, x: x, on_grad)
            detached = {f"model.{name}": p.detach() for name, p in model.named_parameters()}

            def forward_backward() -> torch.Tensor:
                with (
                    forward_context or contextlib.nullcontext(),
                    capture,
                    recomputed_modules(model, capture, self.spec.recompute),
                ):
                    losses = supervised_token_loss(model, batch, self.spec.loss_chunk_tokens)
                    capture.output_grads(losses.sum())
                    return losses

            try:
                losses = functional_call(_Holder(model), detached, (forward_backward,), strict=False)
            finally:
                capture.clear()
        return losses.detach()


class FactorSums:
    """Partial sums of a factor pass, one rank's or one batch's: `tensors` maps a key to a tensor,
    and two sums over disjoint rows add (`a + b`) to the sum over both. Keys:
    "{module}/A" Σ x xᵀ [in, in], "{module}/G" Σ δ δᵀ [out, out] (or "{module}/G_diagonal" Σ δ² [out]
    for a module fitted with a diagonal G), "{module}/positions" int64 [],
    "{module}/lambda" Σ_n (Q_Gᵀ G_n Q_A)² [out, in], and "examples" int64 [] (rows with a
    supervised token). Units: the loss's nats, squared, times the inputs' units squared."""

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __add__(self, other: "FactorSums") -> "FactorSums":
        if set(self.tensors) != set(other.tensors):
            raise GradianError(
                f"factor sums over other modules cannot be added ({sorted(set(self.tensors) ^ set(other.tensors))}); fit every part with the same grads.module_filter"
            )
        return FactorSums({k: v + other.tensors[k].to(v.device) for k, v in self.tensors.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _accumulate(tensors: Dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    # In place into a running sum (its own tensor: a value shared by several keys is cloned first).
    if key in tensors:
        tensors[key] += value.to(tensors[key].device)
    else:
        tensors[key] = value.clone()


class Eigenbases:
    """Each module's A = Q_A diag(λ_A) Q_Aᵀ and G = Q_G diag(λ_G) Q_Gᵀ (module docstring).

    `bases[name]` = (q_a [in, in], lam_a [in], q_g [out, out], lam_g [out]), in `dtype`;
    eigenvalues below zero (rounding of a singular second moment) are clipped to zero. A module
    fitted with a diagonal G has an empty q_g (the identity) and lam_g = diag(G) (module docstring).
    """

    def __init__(self, bases: Dict[str, tuple]) -> None:
        self.bases = bases

    @classmethod
    def from_sums(cls, sums: FactorSums, dtype: torch.dtype = torch.float32, consume: bool = False) -> "Eigenbases":
        """Decomposes A = Σ x xᵀ / positions and G = Σ δ δᵀ / examples in float64 (eigh of a
        float32 matrix loses the small eigenvalues that the inverse weighs most). With `consume`,
        each module's sums are removed from `sums` once its bases are made, so the sums and the
        bases are never both held whole."""
        t, bases = sums.tensors, {}
        examples = max(int(t["examples"]), 1)
        for name in [k[: -len("/A")] for k in t if k.endswith("/A")]:
            a = t[f"{name}/A"].double() / max(int(t[f"{name}/positions"]), 1)
            lam_a, q_a = torch.linalg.eigh(a)
            if f"{name}/G_diagonal" in t:
                lam_g, q_g = t[f"{name}/G_diagonal"].double() / examples, a.new_empty(0)
            else:
                lam_g, q_g = torch.linalg.eigh(t[f"{name}/G"].double() / examples)
            if consume:
                for part in ("A", "G", "G_diagonal", "positions"):
                    t.pop(f"{name}/{part}", None)
            # Contiguous, as a set read back from the index's cache is: eigh's eigenvectors come
            # column-major, and a matmul with the other layout rounds differently in the last bit.
            bases[name] = tuple(v.to(dtype).contiguous() for v in (q_a, lam_a.clamp_min(0), q_g, lam_g.clamp_min(0)))
        return cls(bases)


def in_output_basis(g: torch.Tensor, q_g: torch.Tensor) -> torch.Tensor:
    """g [..., out] in the output eigenbasis: g Q_G, or g itself where Q_G is the identity (a
    module fitted with a diagonal G holds it as an empty tensor)."""
    return g if q_g.numel() == 0 else g @ q_g.to(g)


class Factors:
    """What the exact pass preconditions with: each module's eigenbases and the eigenvalues of
    its curvature in them, [out, in]: K-FAC's λ_G ⊗ λ_A, or EK-FAC's Λ (`lambdas` given)."""

    def __init__(self, bases: Eigenbases, lambdas: Optional[FactorSums] = None) -> None:
        self.bases = bases.bases
        self.kind = "kfac" if lambdas is None else "ekfac"
        self.eigenvalues: Dict[str, torch.Tensor] = {}
        for name, (_, lam_a, _, lam_g) in self.bases.items():
            if lambdas is None:
                self.eigenvalues[name] = torch.outer(lam_g, lam_a)
            else:
                examples = max(int(lambdas.tensors["examples"]), 1)
                self.eigenvalues[name] = (lambdas.tensors[f"{name}/lambda"] / examples).to(lam_a)

    PARTS = ("q_a", "lam_a", "q_g", "lam_g", "eigenvalues")

    def state(self) -> Dict[str, torch.Tensor]:
        """Plain tensors to store (an index's `factors/`): "{module}/{part}" for each of `PARTS`."""
        return {
            f"{name}/{part}": t
            for name, base in self.bases.items()
            for part, t in zip(self.PARTS, (*base, self.eigenvalues[name]))
        }

    @classmethod
    def from_state(cls, state: Dict[str, torch.Tensor], kind: str) -> "Factors":
        """The factors `state()` gave, with their `kind` ("kfac" or "ekfac") stored beside them."""
        factors = cls.__new__(cls)
        names = [k[: -len("/q_a")] for k in state if k.endswith("/q_a")]
        factors.bases = {n: tuple(state[f"{n}/{p}"] for p in cls.PARTS[:4]) for n in names}
        factors.eigenvalues = {n: state[f"{n}/eigenvalues"] for n in names}
        factors.kind = kind
        return factors

    def part(self, names: Iterable[str]) -> "Factors":
        """The same factors over modules `names` only, sharing their tensors: its `mean_eigenvalue`,
        and with it an unrolling's horizon, is that part's own (the exact pass's parts, exact.py)."""
        part = Factors.__new__(Factors)
        names = list(names)
        part.bases = {n: self.bases[n] for n in names}
        part.eigenvalues = {n: self.eigenvalues[n] for n in names}
        part.kind = self.kind
        return part

    def mean_eigenvalue(self) -> float:
        """Ē, the mean eigenvalue over every module's [out, in] eigenvalues together: the curvature
        scale that `precondition`'s horizon is measured in."""
        if "_mean_eigenvalue" not in self.__dict__:  # once: every module's weights need it
            total = sum(float(e.sum()) for e in self.eigenvalues.values())
            self._mean_eigenvalue = total / max(sum(e.numel() for e in self.eigenvalues.values()), 1)
        return self._mean_eigenvalue

    def precondition(self, name: str, g: torch.Tensor, damping: float, horizon: Optional[float] = None) -> torch.Tensor:
        """f(H) g for gradients g [Q, out, in] of module `name`, in full space:
        Q_G ((Q_Gᵀ g Q_A) ⊙ f(E)) Q_Aᵀ, f(E) the `weights` [out, in]."""
        q_a, _, q_g, _ = self.bases[name]
        g = g.to(q_a.dtype)
        if q_g.numel() == 0:  # a diagonal G (Q_G the identity): the output side needs no rotation
            return ((g @ q_a) * self.weights(name, damping, horizon)) @ q_a.T
        return q_g @ ((q_g.T @ g @ q_a) * self.weights(name, damping, horizon)) @ q_a.T

    def weights(self, name: str, damping: float, horizon: Optional[float] = None) -> torch.Tensor:
        """f(E) [out, in] of module `name`, E its eigenvalues in the eigenbases (Q_G, Q_A).

        horizon None, the influence function: f(E) = 1 / (E + λ), λ = damping × mean(E) (a
        fraction of the module's mean eigenvalue, so it is free of the loss's and the inputs'
        units). A direction whose damped eigenvalue is zero (damping 0 on a dead direction) gets
        zero, the pseudo-inverse's value.

        horizon h >= 0, approximate unrolling (SOURCE, Bae et al. 2024): f(E) = Ē (1 − e^(−h E/Ē)) / E,
        what gradient descent for a time t with h = t Ē does to a loss of curvature E (its limit h
        at E = 0), scaled by Ē so that it is a pure number: h × the identity (TracIn's gradient
        product) where h E/Ē is small, Ē / E (the influence function) where it is large. Ē is
        `mean_eigenvalue()`, over every module of these factors (of a part's alone, `part`), so a
        short horizon weighs modules as the inner product does. `damping` is not used: f is bounded by h."""
        e = self.eigenvalues[name]
        tiny = torch.finfo(e.dtype).tiny
        if horizon is None:
            damped = e + damping * e.mean()
            return torch.where(damped > 0, 1 / damped.clamp_min(tiny), torch.zeros_like(e))
        scaled = e / self.mean_eigenvalue()
        return torch.where(
            scaled > 0, -torch.expm1(-horizon * scaled) / scaled.clamp_min(tiny), torch.full_like(e, horizon)
        )

    def nbytes(self) -> int:
        """Bytes held: per module Q_A, Q_G, λ_A, λ_G and the eigenvalues [out, in]."""
        tensors = [t for b in self.bases.values() for t in b] + list(self.eigenvalues.values())
        return sum(t.numel() * t.element_size() for t in tensors)


class FactorFit:
    """Fits `Factors` over batches (`input_ids`, `attention_mask`, `labels` [B, T]), each call one
    batch's `FactorSums`; the model and its `.grad`, modes and RNG are left as they were
    (`TokenPass`). `dtype` is the sums' (float32; float64 in tests)."""

    def __init__(
        self,
        model: nn.Module,
        spec: IndexSpec,
        modules: Optional[Dict[str, nn.Module]] = None,
        dtype: torch.dtype = torch.float32,
        diagonal_g: Collection[str] = (),
    ) -> None:
        self.tokens = TokenPass(model, spec, modules, dtype)
        self.diagonal_g = frozenset(diagonal_g)  # modules whose G is summed as its diagonal only

    def covariances(
        self, batch: Dict[str, torch.Tensor], forward_context=None, into: Optional[FactorSums] = None
    ) -> FactorSums:
        """Σ x xᵀ, Σ δ δᵀ and the position count of every module, and the example count, of one
        batch; with `into`, added to its sums in place (and `into` returned)."""
        sums = {} if into is None else into.tensors
        _accumulate(sums, "examples", supervised_targets(batch["labels"]).any(dim=1).sum())
        positions = carrying_positions(batch).sum()

        def step(name: str, x: torch.Tensor, g: torch.Tensor) -> None:
            x, g = x.flatten(0, 1), g.flatten(0, 1)  # zero rows (masked positions) add nothing
            _accumulate(sums, f"{name}/A", x.T @ x)
            if name in self.diagonal_g:
                _accumulate(sums, f"{name}/G_diagonal", g.square().sum(dim=0))
            else:
                _accumulate(sums, f"{name}/G", g.T @ g)
            _accumulate(sums, f"{name}/positions", positions)

        self.tokens.run(batch, step, forward_context)
        return FactorSums(sums) if into is None else into

    def lambdas(
        self,
        batch: Dict[str, torch.Tensor],
        bases: Eigenbases,
        forward_context=None,
        into: Optional[FactorSums] = None,
    ) -> FactorSums:
        """Σ_n (Q_Gᵀ G_n Q_A)² [out, in] of every module over one batch's examples, and their
        count; with `into`, added to its sums in place (and `into` returned).

        G_n is made in the eigenbases a few examples at a time ([c, out, in], c·out·in at most
        `CHUNK_ELEMENTS`): Q_Gᵀ G_n Q_A = Σ_t (Q_Gᵀ δ_t)(Q_Aᵀ x_t)ᵀ."""
        sums = {} if into is None else into.tensors
        _accumulate(sums, "examples", supervised_targets(batch["labels"]).any(dim=1).sum())

        def step(name: str, x: torch.Tensor, g: torch.Tensor) -> None:
            q_a, _, q_g, _ = bases.bases[name]
            x, g = x @ q_a.to(x), in_output_basis(g, q_g)  # [B, T, in], [B, T, out] in the eigenbases
            key = f"{name}/lambda"
            if key not in sums:
                sums[key] = x.new_zeros(g.shape[-1], x.shape[-1])
            for lo, hi in example_chunks(x.shape[0], g.shape[-1] * x.shape[-1]):
                sums[key] += torch.bmm(g[lo:hi].transpose(1, 2), x[lo:hi]).square_().sum(dim=0)

        self.tokens.run(batch, step, forward_context)
        return FactorSums(sums) if into is None else into


def example_chunks(batch_size: int, per_example: int) -> Iterable[tuple]:
    """(lo, hi) ranges of examples whose [hi - lo, per_example] temporary stays within `CHUNK_ELEMENTS`."""
    size = max(1, CHUNK_ELEMENTS // max(per_example, 1))
    return [(lo, min(lo + size, batch_size)) for lo in range(0, batch_size, size)]


def fit_factors(
    model: nn.Module,
    spec: IndexSpec,
    batches: Iterable[Dict[str, torch.Tensor]],
    ekfac: bool = True,
    modules: Optional[Dict[str, nn.Module]] = None,
    dtype: torch.dtype = torch.float32,
    diagonal_g: Collection[str] = (),
) -> Factors:
    """One process's fit over `batches` (iterated twice for EK-FAC: a list or a DataLoader, not a
    generator); K-FAC's eigenvalues unless `ekfac`; the modules in `diagonal_g` keep only G's
    diagonal. Under a distributed strategy, sum each pass's `FactorSums` over ranks before the next
    step instead (module docstring)."""
    fit = FactorFit(model, spec, modules, dtype, diagonal_g)
    total = None
    for batch in batches:
        total = fit.covariances(batch, into=total)
    if total is None:
        raise GradianError("no batch to fit factors on; give at least one training row")
    bases = Eigenbases.from_sums(total, dtype, consume=True)
    del total
    if not ekfac:
        return Factors(bases)
    lambdas = None
    for batch in batches:
        lambdas = fit.lambdas(batch, bases, into=lambdas)
    return Factors(bases, lambdas)
