"""Fidelity: Spearman correlation of projected against exact per-example gradient cosine scores.

SmolLM2-135M-Instruct, gradian's quickstart queries (30) and train rows (120): all 3600 (query,
train) pairs. Loss gradients of every layer's down_proj, per token (inputs x_t and output-gradients
g_t, fp32, reference.py's hooks); then
  - exact scores from reference.exact_scores: ⟨G_a, G_b⟩ = Σ_t Σ_s (g_t·g_s)(x_t·x_s), so no
    576×1536 gradient is ever formed;
  - projected rows from the same per-token factors through `KroneckerProjector`, stored and read back
    through the index's encoding (index/layout.py round_trip) of each storage_dtype.
Cosine scores, whole-row and per-module (the mean over modules of each module's cosine, the
default `query.normalize=module`), then Spearman ρ over all pairs (and the mean per-query ρ). How float16/bfloat16
storage changes the ranking is measured against float32 storage of the same projection: ρ and
the overlap of each query's top 10.

    PYTHONPATH=. python -m benchmarks.studies.fidelity
    PYTHONPATH=. python -m benchmarks.studies.fidelity --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from benchmarks.common import ROOT, SMOLLM2, write_result
from benchmarks.studies.reference import exact_scores, linear_modules, spearman, token_factors
from gradian_lightning.data import read_jsonl
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.index.layout import round_trip

DIMS = (4, 8, 16, 32, 64)
DTYPES = ("float32", "float16", "bfloat16", "int8")
QUICKSTART = ROOT / "gradian_lightning" / "recipes" / "quickstart"


def projected_rows(
    model, tokenizer, rows: List[Dict], modules: Dict[str, torch.nn.Linear], dims: Sequence[int]
) -> Dict[int, Tuple[torch.Tensor, KroneckerProjector]]:
    """Per k in `dims`: float32 [n, width], each row as the indexer computes it (projection seed 0)
    from its per-token factors, and the projector. One backward per batch serves every k."""
    projectors = {k: KroneckerProjector(modules, k, 0) for k in dims}
    out: Dict[int, List[torch.Tensor]] = {k: [] for k in dims}
    for tokens in token_factors(model, tokenizer, rows, modules):
        xs, gs = {m: x for m, (x, _) in tokens.items()}, {m: g for m, (_, g) in tokens.items()}
        for k, projector in projectors.items():
            out[k].append(projector.project(xs, gs, next(iter(xs.values())).shape[0]))
    return {k: (torch.cat(out[k]), projectors[k]) for k in dims}


def cosine(rows_q: torch.Tensor, rows_t: torch.Tensor) -> np.ndarray:
    q = rows_q.double() / rows_q.double().norm(dim=1, keepdim=True).clamp_min(1e-300)
    t = rows_t.double() / rows_t.double().norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (q @ t.T).numpy()


def module_cosine(rows_q: torch.Tensor, rows_t: torch.Tensor, projector: KroneckerProjector) -> np.ndarray:
    """The default score: the mean over modules of each module block's cosine."""
    blocks = [(b.offset, b.size) for b in projector.blocks]
    return np.mean([cosine(rows_q[:, o : o + s], rows_t[:, o : o + s]) for o, s in blocks], axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--train", type=int, default=120)
    parser.add_argument("--smoke", action="store_true", help="tiny Llama, 3 × 6 examples: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

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
    modules = linear_modules(model, ["down_proj"])
    exact = exact_scores(model, tokenizer, train, queries, ["down_proj"])
    exact_qt, exact_module_qt = exact["exact row cosine"], exact["exact module cosine"]
    nq = len(queries)

    rows = []
    fp16_rows = []
    for dim, (projected, projector) in projected_rows(model, tokenizer, queries + train, modules, dims).items():
        scores = {}
        for dtype in DTYPES:
            stored = round_trip(projected, dtype, projector.blocks)
            scores[dtype] = cosine(stored[:nq], stored[nq:])
            per_query = np.mean([spearman(scores[dtype][i], exact_qt[i]) for i in range(nq)])
            by_module = module_cosine(stored[:nq], stored[nq:], projector)
            per_query_module = np.mean([spearman(by_module[i], exact_module_qt[i]) for i in range(nq)])
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
    text = (
        f"{label}, down_proj of all {len(modules)} layers, quickstart data: {nq} queries × {len(train)} train rows = {nq * len(train)} pairs; "
        f"projection seed 0; cosine scores: whole-row (query.normalize=row) and the mean of per-module cosines (query.normalize=module, the default)."
    )
    fidelity_header = [
        "projection_dim",
        "storage_dtype",
        "Spearman ρ vs exact, row cosine (all pairs)",
        "mean per-query ρ, row cosine",
        "Spearman ρ vs exact, per-module cosine (default score; all pairs)",
        "mean per-query ρ, per-module cosine",
    ]
    storage_header = [
        "projection_dim",
        "storage_dtype",
        "ρ vs float32 storage",
        "top-10 overlap with float32",
        "max abs Δ cosine",
    ]
    tables = [
        {"header": fidelity_header, "rows": rows},
        {
            "title": "Storage precision against float32 storage of the same projection:",
            "header": storage_header,
            "rows": fp16_rows,
        },
    ]
    write_result("fidelity", text, tables, args.out)


if __name__ == "__main__":
    main()
