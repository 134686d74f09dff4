"""Fidelity: Spearman correlation of projected against exact per-example gradient cosine scores.

SmolLM2-135M-Instruct, gradian's quickstart queries (30) and train rows (120): all 3600 (query,
train) pairs. Loss gradients of every layer's down_proj are captured once (inputs x_t and
output-gradients g_t per token, fp32); then
  - exact inner products use ⟨G_a, G_b⟩ = Σ_t Σ_s (g_t·g_s)(x_t·x_s), summed over modules, so no
    576×1536 gradient is ever formed;
  - projected rows come from the same factors through `KroneckerProjector` (gradients/projection.py) and are
    stored and read back through the index encoding (store.encode/decode) of each storage_dtype.
Cosine scores, whole-row and per-module (the mean over modules of each module's cosine, the
default `query.normalize=module`), then Spearman ρ over all pairs (and the mean per-query ρ). How float16/bfloat16
storage changes the ranking is measured against float32 storage of the same projection: ρ and
the overlap of each query's top 10.

    PYTHONPATH=. python -m benchmarks.fidelity
    PYTHONPATH=. python -m benchmarks.fidelity --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence, Tuple

from benchmarks.common import ROOT, SMOLLM2, command_line, table, write_result

DIMS = (4, 8, 16, 32, 64)
DTYPES = ("float32", "float16", "bfloat16")
QUICKSTART = ROOT / "gradian_lightning" / "recipes" / "quickstart"

Factors = Dict[str, Tuple["torch.Tensor", "torch.Tensor"]]  # module -> (x [t, in], g [t, out]) fp32  # noqa: F821


def example_factors(
    model, tokenizer, rows: Sequence[dict], patterns: List[str], batch_size: int = 8
) -> Tuple[Dict[str, object], List[Factors]]:
    """(selected modules, per-example {module: (x [t, in], g [t, out])}) for the loss of each row."""
    import torch

    from gradian_lightning.data import JsonlDataset, collate
    from gradian_lightning.gradients.capture import LinearCapture, select_modules
    from gradian_lightning.gradients.loss import supervised_token_loss

    modules = select_modules(model, patterns)
    capture = LinearCapture(modules)
    dataset = JsonlDataset(rows, tokenizer, 512)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: List[Factors] = []
    for lo in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(lo, min(lo + batch_size, len(dataset)))], pad_token_id=pad)
        with torch.enable_grad(), capture:
            losses = supervised_token_loss(model, batch)
            grads = capture.output_grads(losses.sum())
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        for j, n in enumerate(lengths):
            out.append(
                {
                    name: (capture.inputs[name][j, :n].float().clone(), grads[name][j, :n].float().clone())
                    for name in modules
                }
            )
        capture.clear()
    return modules, out


def exact_module_grams(factors: List[Factors], names: Sequence[str]):
    """Exact ⟨G_a, G_b⟩ for all example pairs, one matrix per module: float64 [modules, n, n]."""
    import torch

    owner = torch.cat([torch.full((f[names[0]][0].shape[0],), i) for i, f in enumerate(factors)])
    select = torch.zeros(owner.shape[0], len(factors))
    select[torch.arange(owner.shape[0]), owner] = 1.0  # token -> example, [n_tokens, n]
    grams = []
    for name in names:
        x = torch.cat([f[name][0] for f in factors])
        g = torch.cat([f[name][1] for f in factors])
        token = (g @ g.T) * (x @ x.T)  # [n_tokens, n_tokens]
        grams.append((select.T @ token @ select).double())
    return torch.stack(grams)


def module_cosine(grams):
    """Mean over modules of the per-module cosines (query.normalize=module): float64 [n, n]."""
    import numpy as np

    norms = np.sqrt(np.maximum(np.einsum("mii->mi", grams), 1e-300))
    return np.mean(grams / (norms[:, :, None] * norms[:, None, :]), axis=0)


def projected_rows(modules, factors: List[Factors], dim: int, seed: int = 0):
    """float32 [n, width]: each example's row as the indexer computes it, from its factors."""
    import torch

    from gradian_lightning.gradients.projection import KroneckerProjector

    projector = KroneckerProjector(modules, dim, seed)
    return torch.cat(
        [
            projector.project({k: v[0][None] for k, v in f.items()}, {k: v[1][None] for k, v in f.items()}, 1)
            for f in factors
        ]
    )


def spearman(a, b) -> float:
    """Spearman ρ of two flat arrays (ties get ordinal ranks: scores here are continuous)."""
    import numpy as np

    ra = np.empty(len(a))
    ra[np.argsort(a, kind="stable")] = np.arange(len(a))
    rb = np.empty(len(b))
    rb[np.argsort(b, kind="stable")] = np.arange(len(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def cosine(rows_q, rows_t):

    q = rows_q.double() / rows_q.double().norm(dim=1, keepdim=True).clamp_min(1e-300)
    t = rows_t.double() / rows_t.double().norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (q @ t.T).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--train", type=int, default=120)
    parser.add_argument("--smoke", action="store_true", help="tiny Llama, 3 × 6 examples: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import numpy as np
    import torch

    from gradian_lightning.data import read_jsonl
    from gradian_lightning.gradients.projection import KroneckerProjector
    from gradian_lightning.index.layout import decode, encode
    from gradian_lightning.query.topk import _unit_modules

    torch.manual_seed(0)
    queries = read_jsonl(QUICKSTART / "queries.jsonl")[: 3 if args.smoke else args.queries]
    train = read_jsonl(QUICKSTART / "train.jsonl")[: 6 if args.smoke else args.train]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2))
    if args.smoke:
        from benchmarks.common import tiny_llama

        model, dims, label = (
            tiny_llama(vocab_size=len(tokenizer), hidden=64, layers=2),
            (4, 16),
            "tiny random-init Llama (hidden 64, 2 layers)",
        )
    else:
        from benchmarks.common import smollm2

        model, dims, label = smollm2(), DIMS, "SmolLM2-135M-Instruct"
    modules, factors = example_factors(model, tokenizer, queries + train, ["down_proj"])
    names = list(modules)
    grams = exact_module_grams(factors, names).numpy()
    gram = grams.sum(axis=0)
    norms = np.sqrt(np.diag(gram))
    exact = gram / np.outer(norms, norms)
    nq = len(queries)
    exact_qt = exact[:nq, nq:]
    exact_module_qt = module_cosine(grams)[:nq, nq:]

    rows = []
    fp16_rows = []
    curve = []  # (dim, ρ row cosine, ρ per-module cosine) at float16 storage, for the figure
    for dim in dims:
        projected = projected_rows(modules, factors, dim)
        projector_blocks = KroneckerProjector(modules, dim, 0).describe()
        scores = {}
        for dtype in DTYPES:
            stored = decode(encode(projected, dtype), dtype)
            scores[dtype] = cosine(stored[:nq], stored[nq:])
            per_query = np.mean([spearman(scores[dtype][i], exact_qt[i]) for i in range(nq)])
            # The default score: each module's block unit-normalised by the library's own code, then / M.
            unit = _unit_modules(stored.double().clone(), projector_blocks) / len(names) ** 0.5
            by_module = (unit[:nq] @ unit[nq:].T).numpy()
            per_query_module = np.mean([spearman(by_module[i], exact_module_qt[i]) for i in range(nq)])
            if dtype == "float16":
                curve.append(
                    (
                        dim,
                        spearman(scores[dtype].ravel(), exact_qt.ravel()),
                        spearman(by_module.ravel(), exact_module_qt.ravel()),
                    )
                )
            rows.append(
                [
                    dim,
                    dtype,
                    f"{spearman(scores[dtype].ravel(), exact_qt.ravel()):.4f}",
                    f"{per_query:.4f}",
                    f"{spearman(by_module.ravel(), exact_module_qt.ravel()):.4f}",
                    f"{per_query_module:.4f}",
                ]
            )
        for dtype in ("float16", "bfloat16"):
            k = min(10, exact_qt.shape[1])
            top = lambda s, k=k: [set(np.argsort(-s[i])[:k]) for i in range(nq)]  # noqa: E731
            overlap = np.mean([len(a & b) / k for a, b in zip(top(scores[dtype]), top(scores["float32"]))])
            diff = np.abs(scores[dtype] - scores["float32"]).max()
            fp16_rows.append(
                [
                    dim,
                    dtype,
                    f"{spearman(scores[dtype].ravel(), scores['float32'].ravel()):.6f}",
                    f"{overlap:.3f}",
                    f"{diff:.2e}",
                ]
            )
    tokens = sum(f[names[0]][0].shape[0] for f in factors)
    body = (
        f"{label}, down_proj of all {len(names)} layers, quickstart data: {nq} queries × {len(train)} train rows = {nq * len(train)} pairs, "
        f"{tokens} tokens; projection seed 0; cosine scores: whole-row (query.normalize=row) and the mean of per-module cosines (query.normalize=module, the default).\n\n"
        + table(
            [
                "projection_dim",
                "storage_dtype",
                "Spearman ρ vs exact, row cosine (all pairs)",
                "mean per-query ρ, row cosine",
                "Spearman ρ vs exact, per-module cosine (default score; all pairs)",
                "mean per-query ρ, per-module cosine",
            ],
            rows,
        )
        + "\n\nStorage precision against float32 storage of the same projection:\n\n"
        + table(
            [
                "projection_dim",
                "storage_dtype",
                "ρ vs float32 storage",
                "top-10 overlap with float32",
                "max abs Δ cosine",
            ],
            fp16_rows,
        )
    )
    write_result("fidelity", command_line(), body, args.out)
    plot(curve, label, args.out)


def plot(curve, label: str, out) -> None:
    """Spearman ρ against the exact scores as projection_dim grows, both scores, float16 storage."""
    from benchmarks.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    dims = [c[0] for c in curve]
    ax.plot(dims, [c[2] for c in curve], marker="o", label="per-module cosine (default score)")
    ax.plot(dims, [c[1] for c in curve], marker="s", label="whole-row cosine (query.normalize=row)")
    ax.axhline(0.9, color="tab:red", linestyle="--", linewidth=0.8, label="target ρ 0.9")
    ax.set_xscale("log", base=2)
    ax.set_xticks(dims, [str(d) for d in dims])
    ax.set_xlabel("grads.projection_dim (k; k² values per module)")
    ax.set_ylabel("Spearman ρ vs exact")
    ax.set_title(f"Fidelity, {label.split(' (')[0]}, float16 storage", fontsize=9)
    ax.legend(fontsize=7)
    save_figure("fidelity", fig, out)


if __name__ == "__main__":
    main()
