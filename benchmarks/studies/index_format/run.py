"""Fidelity per stored byte of candidate index formats (issue 29, item 4), against exact gradients.

What an index stores for a module is an estimate of its per-example weight gradient G [out, in];
what scoring needs from it is the inner products <G_a, G_b> between rows, module by module. This
study takes the exact per-module gradients that the LDS sets' exact indexes hold
(benchmarks/studies/lds_sets: `index-exact`, `grads.projection_dim=null`), applies each candidate
format to them offline, and measures how well the stored rows reproduce the exact inner products,
per stored byte. A Kronecker projection of G is linear in G, so projecting the exact G here is
what capture would store (up to float rounding); the draws are N(0, 1/k), as gradients/projection.py
draws them, from this study's own generator.

Candidates, each at its bytes per module (against k = 16 in float16, 512 bytes, the default when it was run):
    kron-k{K}-f16      a Kronecker factor at k = K in float16 (K² values, 2 bytes each)
    kron-k{K}-int8     the same in int8 with one float32 absmax scale per module block (QLESS-style)
    kron-k{K}-sjlt{D}  a wider Kronecker factor (K² values) then a sparse JL map (s = 4 nonzeros a
                       column, ±1/√s) down to D values, float16 (FactGraSS-style)
    kron-k{K}-1bit     the Kronecker block's signs, one bit a value, and its float32 norm: inner
                       products from the share of differing signs (SimHash; QLESS's 1-bit rows)
    kron-k16-x2        two independent k = 16 draws, their inner products averaged (1,024 bytes)

Measures, over the first --rows training rows at each checkpoint (row pairs a ≠ b):
    module r     Pearson r of estimated against exact inner products, mean over modules
    row ρ        per anchor row, Spearman ρ of estimated against exact whole-row inner products
                 (summed over modules) with every other row; mean over anchors
    cosine ρ     the same for the per-module cosine (mean over modules), the score users rank by
                 under ekfac/diag/none

Needs the exact indexes that `python -m benchmarks.studies.lds_sets.run KIND ...` leaves under
/tmp/gradian-lds-sets (the sets' own command builds them):

    PYTHONPATH=. python -m benchmarks.studies.index_format.run
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch

from gradian_lightning import open_index

WORK = Path("/tmp/gradian-lds-sets")
RESULTS = Path(__file__).parent / "results.json"
SETS = ["facts-N256", "facts-N2048", "format-N512", "shared-N512", "smollm2"]
# SmolLM2-135M-Instruct pretrained, exact rows of two of its MLP modules (up_proj [1536, 576] of
# layer 15, down_proj [576, 1536] of layer 29: 885K values each, where k = 16 keeps 0.03%), on the
# 80 fact rows of benchmarks/studies/lds_sets/data; the tiny model's modules are [128, 64], so a
# large k there comes close to keeping them whole.
SMOLLM2_EXACT = Path("/tmp/gradian-index-format/smollm2-exact")
SMOLLM2_COMMAND = (
    "gradian index model.name_or_path=~/.cache/gradian/smollm2-135m-instruct"
    " data.train=benchmarks/studies/lds_sets/data/fact.train.jsonl grads.projection_dim=null"
    " grads.storage_dtype=float32 'grads.module_filter=[model.layers.29.mlp.down_proj,model.layers.15.mlp.up_proj]'"
    f" grads.batch_size=4 index.path={SMOLLM2_EXACT}"
)


def gaussian(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, cols] float64 with i.i.d. N(0, 1/rows) entries: the projection's distribution."""
    return torch.randn(rows, cols, generator=generator, dtype=torch.float64) / rows**0.5


def kronecker(grads: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """P_out G P_inᵀ for every row: grads [n, out, in] → [n, k²] float64."""
    p_out, p_in = gaussian(k, grads.shape[1], generator), gaussian(k, grads.shape[2], generator)
    return torch.einsum("ko,noi,li->nkl", p_out, grads, p_in).reshape(len(grads), k * k)


def sparse_jl(rows: torch.Tensor, width: int, generator: torch.Generator, nonzeros: int = 4) -> torch.Tensor:
    """A sparse JL map of rows [n, d] to [n, width]: each input coordinate goes to `nonzeros` random
    output coordinates with random signs ±1/√nonzeros (Kane-Nelson's SJLT), so inner products are
    preserved in expectation."""
    d = rows.shape[1]
    targets = torch.stack([torch.randperm(width, generator=generator)[:nonzeros] for _ in range(d)])  # [d, s]
    signs = torch.randint(0, 2, (d, nonzeros), generator=generator).double() * 2 - 1
    matrix = torch.zeros(d, width, dtype=torch.float64)
    matrix.scatter_(1, targets, signs / nonzeros**0.5)
    return rows @ matrix


def as_float16(rows: torch.Tensor) -> torch.Tensor:
    return rows.to(torch.float16).double()


def as_int8(rows: torch.Tensor) -> torch.Tensor:
    """Rounded to int8 with one absmax scale per row (of one module block), then read back."""
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
    return torch.round(rows / scale).clamp(-127, 127) * scale


def gram(rows: torch.Tensor) -> torch.Tensor:
    """Estimated inner products [n, n] of rows stored as they are."""
    return rows @ rows.T


def sign_gram(rows: torch.Tensor) -> torch.Tensor:
    """Estimated inner products [n, n] of rows stored as sign bits plus each row's norm: |a| |b|
    cos(π × the share of signs that differ), the angle a random hyperplane estimates (SimHash)."""
    signs = torch.sign(rows)
    agree = (signs @ signs.T) / rows.shape[1]  # 1 - 2 × share differing
    norms = torch.linalg.vector_norm(rows, dim=1)
    return torch.outer(norms, norms) * torch.cos(torch.pi * (1 - agree) / 2)


# name → (bytes per module block, function(grads [n, out, in], generator) → estimated inner
# products [n, n] of the rows' blocks for that module).
Candidate = Tuple[int, Callable[[torch.Tensor, torch.Generator], torch.Tensor]]


def candidates() -> Dict[str, Candidate]:
    out: Dict[str, Candidate] = {}
    for k in (8, 16, 22, 32):
        out[f"kron-k{k}-f16"] = (2 * k * k, lambda g, gen, k=k: gram(as_float16(kronecker(g, k, gen))))
    for k in (16, 32):
        out[f"kron-k{k}-int8"] = (k * k + 4, lambda g, gen, k=k: gram(as_int8(kronecker(g, k, gen))))
    for k, width in ((32, 512), (64, 512)):
        out[f"kron-k{k}-sjlt{width}-f16"] = (
            2 * width,
            lambda g, gen, k=k, w=width: gram(as_float16(sparse_jl(kronecker(g, k, gen), w, gen))),
        )
    out["kron-k64-sjlt1024-int8"] = (
        1024 + 4,
        lambda g, gen: gram(as_int8(sparse_jl(kronecker(g, 64, gen), 1024, gen))),
    )
    for k in (64, 90):  # 1 bit a value plus a float32 norm
        out[f"kron-k{k}-1bit"] = (k * k // 8 + 4, lambda g, gen, k=k: sign_gram(kronecker(g, k, gen)))
    out["kron-k16-x2-f16"] = (
        2 * 2 * 256,
        lambda g, gen: sum(gram(as_float16(kronecker(g, 16, gen))) for _ in range(2)) / 2,
    )
    return out


def spearman_rows(estimated: np.ndarray, exact: np.ndarray) -> float:
    """Mean over anchor rows of the Spearman ρ of one row of `estimated` against `exact` [n, n],
    the anchor itself left out."""
    n = len(exact)
    values = []
    for a in range(n):
        keep = np.arange(n) != a
        x, y = estimated[a, keep], exact[a, keep]
        rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
        values.append(np.corrcoef(rx, ry)[0, 1])
    return float(np.mean(values))


def measure(grads: List[torch.Tensor], name: str, candidate: Candidate, seeds: List[int]) -> Dict[str, float]:
    """The three measures of one candidate on one checkpoint's exact module gradients, mean over seeds."""
    _, store = candidate
    exact = [g.reshape(len(g), -1) @ g.reshape(len(g), -1).T for g in grads]  # per module [n, n]
    n = len(exact[0])
    off = ~np.eye(n, dtype=bool)
    figures: Dict[str, List[float]] = {"module_r": [], "row_rho": [], "cosine_rho": []}
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        estimated = [store(g, generator) for g in grads]
        figures["module_r"].append(
            float(np.mean([np.corrcoef(e.numpy()[off], x.numpy()[off])[0, 1] for e, x in zip(estimated, exact)]))
        )
        figures["row_rho"].append(spearman_rows(sum(estimated).numpy(), sum(exact).numpy()))

        def cosine(blocks: List[torch.Tensor]) -> np.ndarray:
            return sum(b / torch.outer(b.diag(), b.diag()).clamp_min(1e-300).sqrt() for b in blocks).numpy() / len(
                blocks
            )

        figures["cosine_rho"].append(spearman_rows(cosine(estimated), cosine(exact)))
    return {key: float(np.mean(v)) for key, v in figures.items()} | {
        f"{key}_spread": float(np.ptp(v)) for key, v in figures.items()
    }


def exact_module_grads(path: Path, step: int, rows: int) -> List[torch.Tensor]:
    """The first `rows` rows of an exact index at checkpoint `step`, split into module gradients [n, out, in]."""
    index = open_index(path).reader.at(step)
    table = index.rows(slice(0, min(rows, len(index)))).double()
    return [table[:, b.offset : b.offset + b.size].reshape(len(table), *b.shape) for b in index.meta.blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", nargs="+", default=SETS)
    parser.add_argument("--rows", type=int, default=256, help="training rows per set (pairs: rows × rows)")
    parser.add_argument("--seeds", type=int, default=3, help="projection draws per candidate")
    args = parser.parse_args()
    started = time.time()
    result = {
        "command": "PYTHONPATH=. python -m benchmarks.studies.index_format.run",
        "machine": f"torch {torch.__version__}, Python {platform.python_version()}, commit "
        + subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        + time.strftime(", %Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": args.rows,
        "seeds": args.seeds,
        "cells": [],
    }
    for name in args.sets:
        path = SMOLLM2_EXACT if name == "smollm2" else WORK / name / "index-exact"
        if not path.exists():
            how = SMOLLM2_COMMAND if name == "smollm2" else f"python -m benchmarks.studies.lds_sets.run for {name}"
            raise SystemExit(f"{path} is missing: build it with {how}")
        steps = [c["step"] for c in open_index(path).checkpoints]
        labels = ["pretrained"] if len(steps) == 1 else ["base", "fine-tuned"]
        for step, label in zip(steps, labels):
            grads = exact_module_grads(path, step, args.rows)
            for cand, candidate in candidates().items():
                figures = measure(grads, cand, candidate, list(range(args.seeds)))
                result["cells"].append(
                    {"set": name, "checkpoint": label, "candidate": cand, "bytes": candidate[0]} | figures
                )
                print(name, label, cand, candidate[0], {k: round(v, 3) for k, v in figures.items()}, flush=True)
    result["wall_seconds"] = time.time() - started
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))


def report(result: Dict) -> str:
    """A Markdown table: per candidate, bytes per module and each measure's worst and mean over the cells."""
    by: Dict[str, List[Dict]] = {}
    for cell in result["cells"]:
        by.setdefault(cell["candidate"], []).append(cell)
    lines = [
        "| candidate | bytes per module (× k16-f16) | module r: worst / mean | row ρ: worst / mean | cosine ρ: worst / mean |",
        "|---|---|---|---|---|",
    ]
    for cand, cells in by.items():
        parts = [
            f"{min(c[m] for c in cells):.3f} / {np.mean([c[m] for c in cells]):.3f}"
            for m in ("module_r", "row_rho", "cosine_rho")
        ]
        lines.append(f"| {cand} | {cells[0]['bytes']} ({cells[0]['bytes'] / 512:.2f}×) | " + " | ".join(parts) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
