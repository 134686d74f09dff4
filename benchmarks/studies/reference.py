"""What every quality study measures against, in one place: the data (LDS sets whose queries name
their planted sources), exact per-example gradients, and the LDS of a score matrix.

The exact side uses no gradient code of the package: plain forward hooks on the nn.Linear modules
keep each one's input x_t, a tensor hook its output-gradient g_t, for the summed supervised-token
cross-entropy of each row (rows of a batch are independent, so one backward gives every row's
tokens). A row's weight gradient is G = Σ_t g_tᵀ x_t, so ⟨G_a, G_b⟩ = Σ_t Σ_s (g_t·g_s)(x_t·x_s)
and no [out, in] gradient is ever formed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import SMOLLM2  # noqa: F401  (the studies' model, re-exported)
from gradian_lightning import JsonlDataset, collate, read_jsonl

HERE = Path(__file__).resolve().parents[1]
DATA, RESULTS = HERE / "lds_data", HERE / "lds_results"  # the LDS sets and what the studies measured on them
KINDS = ("fact", "newword")

Tokens = Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # module -> (x [B, T, in], g [B, T, out]) float32


def lds_set(kind: str, data: Path = DATA) -> Tuple[List[Dict], List[Dict], List[List[int]]]:
    """A set's training rows, its queries, and each query's planted sources as row positions."""
    train, queries = read_jsonl(data / f"{kind}.train.jsonl"), read_jsonl(data / f"{kind}.queries.jsonl")
    ids = [r["id"] for r in train]
    return train, queries, [[ids.index(s) for s in q["sources"]] for q in queries]


def linear_modules(model: torch.nn.Module, suffixes: Sequence[str]) -> Dict[str, torch.nn.Linear]:
    """The model's nn.Linear modules whose name ends with one of `suffixes` (e.g. the MLP's)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(tuple(suffixes))}


def token_factors(
    model: torch.nn.Module, tokenizer, rows: List[Dict], modules: Dict[str, torch.nn.Linear], batch_size: int = 8
) -> Iterator[Tokens]:
    """Per batch of `rows`: each module's inputs and loss output-gradients per position (zero at
    positions the loss does not depend on). Loss: a row's summed supervised-token cross-entropy."""
    dataset = JsonlDataset(rows, tokenizer, 512)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs: Dict[str, torch.Tensor] = {}
    outputs: Dict[str, torch.Tensor] = {}

    def keep(name: str, args: tuple, output: torch.Tensor) -> None:
        inputs[name] = args[0].detach().float()
        outputs[name] = output

    for lo in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(lo, min(lo + batch_size, len(dataset)))], pad_token_id=pad)
        hooks = [m.register_forward_hook(lambda _, a, o, n=n: keep(n, a, o)) for n, m in modules.items()]
        try:
            with torch.enable_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss = F.cross_entropy(  # summed over every supervised token of every row
                    logits[:, :-1].float().flatten(0, 1),
                    batch["labels"][:, 1:].flatten(),
                    ignore_index=-100,
                    reduction="sum",
                )
                grads = torch.autograd.grad(loss, [outputs[n] for n in modules])
        finally:
            for h in hooks:
                h.remove()
        yield {n: (inputs[n], g.float()) for n, g in zip(modules, grads)}


def exact_inner(query_tokens: List[Tokens], train_tokens: Iterator[Tokens]) -> Tuple[torch.Tensor, ...]:
    """Exact per-module gradient inner products: (⟨G_q, G_t⟩ [Q, N, M], ⟨G_q, G_q⟩ [Q, M],
    ⟨G_t, G_t⟩ [N, M]), float64, modules in the order of the token dicts. The training batches
    are reduced against the queries' tokens as they come, so only the queries' are kept."""
    names = list(query_tokens[0])
    pad = max(b[names[0]][0].shape[1] for b in query_tokens)
    qx = {n: torch.cat([F.pad(b[n][0], (0, 0, 0, pad - b[n][0].shape[1])) for b in query_tokens]) for n in names}
    qg = {n: torch.cat([F.pad(b[n][1], (0, 0, 0, pad - b[n][1].shape[1])) for b in query_tokens]) for n in names}

    def self_inner(x, g):  # [B, M]: Σ_t Σ_s (g_t·g_s)(x_t·x_s) per row
        return (torch.einsum("bti,bsi->bts", g, g) * torch.einsum("bti,bsi->bts", x, x)).sum((1, 2)).double()

    q_self = torch.stack([self_inner(qx[n], qg[n]) for n in names], 1)
    inner, t_self = [], []
    for batch in train_tokens:
        cross = []
        for n in names:
            x, g = batch[n]
            tt = torch.einsum("qti,bsi->qbts", qg[n], g) * torch.einsum("qti,bsi->qbts", qx[n], x)
            cross.append(tt.sum((2, 3)).double())
        inner.append(torch.stack(cross, 2))
        t_self.append(torch.stack([self_inner(*batch[n]) for n in names], 1))
    return torch.cat(inner, 1), q_self, torch.cat(t_self)


def exact_scores(model: torch.nn.Module, tokenizer, train: List[Dict], queries: List[Dict], suffixes: Sequence[str]):
    """Exact per-module cosine (the default score, unprojected), whole-row cosine and inner product
    of the `suffixes` modules' gradients, numpy float64 [Q, N] each."""
    modules = linear_modules(model, suffixes)
    query_tokens = list(token_factors(model, tokenizer, queries, modules))
    inner, q_self, t_self = exact_inner(query_tokens, token_factors(model, tokenizer, train, modules))
    per_module = inner / (q_self[:, None, :] * t_self[None, :, :]).sqrt().clamp_min(1e-300)
    row = inner.sum(2) / (q_self.sum(1)[:, None] * t_self.sum(1)[None, :]).sqrt()
    return {
        "exact module cosine": per_module.mean(2).numpy(),
        "exact row cosine": row.numpy(),
        "exact inner": inner.sum(2).numpy(),
    }


def mrr(scores: np.ndarray, sources: List[List[int]]) -> float:
    """Mean reciprocal rank of each query's first planted source among all rows ([Q, N] scores)."""
    ranks = [1 + int((scores[q] > max(scores[q, s] for s in src)).sum()) for q, src in enumerate(sources)]
    return float(np.mean([1.0 / r for r in ranks]))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman ρ of two flat arrays (ordinal ranks: the scores here are continuous)."""
    ra, rb = np.empty(len(a)), np.empty(len(b))
    ra[np.argsort(a, kind="stable")] = np.arange(len(a))
    rb[np.argsort(b, kind="stable")] = np.arange(len(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def lds(scores: np.ndarray, subsets: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Per query, the linear datamodeling score: Spearman ρ over the M retrained subsets between
    the summed scores of each subset's rows and the query's measured output after retraining on it.
    `scores` [Q, N], `subsets` bool [M, N], `outputs` [M, Q] (-loss). Returns [Q]."""
    predicted = subsets.astype(np.float64) @ scores.T  # [M, Q]
    return np.array([spearman(predicted[:, q], outputs[:, q]) for q in range(scores.shape[0])])


def mean_and_se(values: np.ndarray) -> Tuple[float, float]:
    """Mean and its standard error (ddof 1)."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))


def retrained(runs: Path) -> Tuple[np.ndarray, np.ndarray]:
    """(subsets bool [M, N], outputs -loss [M, Q]) of the half-subsets `gradian validate` retrained
    into `runs`, averaged over repeats as validate does."""
    from gradian_lightning.validation.subsets import SubsetRuns

    done = SubsetRuns.existing(runs)
    return done.subsets, -done.losses().mean(axis=0)


def product_scores(cfg) -> np.ndarray:
    """Float64 [Q, N]: every query's score of every row as `gradian query` scores them, through the
    product's dense `score_all` path (the QuerySpec of cfg.query); 0 for rows never ranked."""
    from gradian_lightning.recipes.query import dense_scores
    from gradian_lightning.specs import QuerySpec

    (scores,) = dense_scores(cfg, [QuerySpec.from_config(cfg.query)])
    return np.nan_to_num(scores.astype(np.float64), nan=0.0)
