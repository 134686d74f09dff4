"""Issue 21: where the fine-tuned model's LDS gap to exact gradients comes from. For each projection
seed, the fine-tuned index's per-module cosine (no preconditioner) is rebuilt three ways: as the
product computes it (projected inner products over projected norms), with exact norms in place of
the projected ones, and with exact inner products in place of the projected ones. Whichever swap
closes the gap names the part of the projection that costs it.

    PYTHONPATH=. python benchmarks/lds_projection_error.py --runs /work/lds    # -> lds_results/projection_error.<kind>.json

Needs lds_grid.py's RUNS (fine-tuned model, retrained subsets) and lds_seeds.py's indexes for
seeds other than 0. The queries' projected rows come from indexing the query file itself with the
same settings (RUNS/seeds/queries-<kind>-s<seed>); the exact parts from ranking_grid.Captured, kept
in RUNS/exact-parts.<kind>.<base|ft>.npz.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import torch

from benchmarks.lds_grid import DATA, KINDS, RESULTS, SMOLLM2, lds_set, retrained, settings, study_arguments
from benchmarks.ranking_grid import Captured
from gradian_lightning.config import load_config
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.hub import load_model_and_tokenizer
from gradian_lightning.index.layout import stored_meta
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.recipes.index import run_index
from gradian_lightning.validation.lds import linear_datamodeling_score, mean_and_standard_error

VARIANTS = ("as the product computes it", "exact norms", "exact inner products")


def exact_parts(kind: str, runs: Path, which: str) -> Dict[str, np.ndarray]:
    """Exact per-module inner products [Q, N, M] and squared norms (queries [Q, M], rows [N, M])."""
    path = runs / f"exact-parts.{kind}.{which}.npz"
    if not path.is_file():
        cfg = load_config(None, [f"model.name_or_path={SMOLLM2 if which == 'base' else runs / f'{kind}-ft'}"])
        model, tokenizer = load_model_and_tokenizer(cfg.model)
        modules = select_modules(model, list(cfg.grads.module_filter))
        train, queries, _ = lds_set(kind)
        q = Captured(modules, dims=[]).run(model, tokenizer, queries)
        t = Captured(modules, dims=[]).run(model, tokenizer, train, queries=q)
        np.savez(path, inner=t.inner.numpy(), queries=q.self_inner.numpy(), rows=t.self_inner.numpy())
    return dict(np.load(path))


def module_rows(path: Path, step: int) -> np.ndarray:
    """An index checkpoint's rows as float64 [N, M, k²]."""
    index = IndexReader(path, checkpoint=step)
    rows = index.rows(slice(None)).double().numpy()
    return rows.reshape(len(rows), len(index.meta["modules"]), -1)


def per_module_cosine(inner: np.ndarray, queries: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Mean over modules of inner [Q, N, M] / (|q| |r|), from squared norms [Q, M] and [N, M]."""
    return (inner / np.sqrt(queries[:, None, :] * rows[None, :, :]).clip(1e-300)).mean(2)


def run_kind(kind: str, runs: Path, seeds: Sequence[int]) -> Dict:
    subsets, outputs = retrained(runs, kind)
    exact = {w: exact_parts(kind, runs, w) for w in ("base", "ft")}
    checkpoints = f"[{SMOLLM2},{runs / f'{kind}-ft'}]"
    cases = {"fine-tuned, base+ft": ("base", "ft"), "fine-tuned, ft": ("ft",)}
    reference = {
        case: linear_datamodeling_score(
            sum(per_module_cosine(exact[w]["inner"], exact[w]["queries"], exact[w]["rows"]) for w in ws),
            subsets,
            outputs,
        )
        for case, ws in cases.items()
    }
    result: Dict = {"kind": kind, "exact": {c: float(r.mean()) for c, r in reference.items()}, "seeds": {}}
    for seed in seeds:
        index = runs / f"{kind}-ft-index" if seed == 0 else runs / "seeds" / f"{kind}-ft-index-s{seed}"
        queries = runs / "seeds" / f"queries-{kind}-s{seed}"
        if stored_meta(str(queries)) is None:  # the query file indexed as rows, same model and projection
            more = {"index.path": str(queries), "grads.seed": str(seed), "model.checkpoints": checkpoints}
            run_index(
                load_config(None, settings(kind, runs, **more) + [f"data.train={DATA / f'{kind}.queries.jsonl'}"])
            )
        scores, errors = {}, {}
        for step, w in enumerate(("base", "ft")):
            q, t = module_rows(queries, step), module_rows(index, step)
            inner, qn, tn = np.einsum("qmi,nmi->qnm", q, t), (q * q).sum(2), (t * t).sum(2)
            e = exact[w]
            scores[w] = {
                VARIANTS[0]: per_module_cosine(inner, qn, tn),
                VARIANTS[1]: per_module_cosine(inner, e["queries"], e["rows"]),
                VARIANTS[2]: per_module_cosine(e["inner"], qn, tn),
            }
            # per module: the projected cosine's error, its share common to every query, and the exact spread
            err = inner / np.sqrt(qn[:, None] * tn[None]) - e["inner"] / np.sqrt(
                e["queries"][:, None] * e["rows"][None]
            )
            spread = (e["inner"] / np.sqrt(e["queries"][:, None] * e["rows"][None])).std((0, 1))
            shared = err.mean(0).var(0) / err.var((0, 1))
            errors[w] = {
                "error_std": float(np.median(err.std((0, 1)))),
                "exact_spread": float(np.median(spread)),
                "shared_fraction": float(np.median(shared)),
            }
        cells = {}
        for case, ws in cases.items():
            for variant in VARIANTS:
                per_query = linear_datamodeling_score(sum(scores[w][variant] for w in ws), subsets, outputs)
                diff, error = mean_and_standard_error(per_query - reference[case])
                cells.setdefault(case, {})[variant] = {"lds": float(per_query.mean()), "minus_exact": [diff, error]}
                print(
                    kind,
                    f"seed {seed}",
                    case,
                    variant,
                    f"{per_query.mean():+.3f} ({diff:+.3f} ± {error:.3f})",
                    flush=True,
                )
        result["seeds"][str(seed)] = {"cells": cells, "modules": errors}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"projection_error.{kind}.json").write_text(json.dumps(result, indent=1))
    return result


def report() -> str:
    """Per seed, the LDS of each way of building the per-module cosine; then, per model, the medians
    over modules (averaged over seeds) of the projected cosine's error, the exact cosines' spread
    and the share of the error that is the same for every query (a per-row bias)."""
    lines = [
        "| set, case | per-module cosine | LDS per seed | mean | minus exact, per seed |",
        "|---|---|---|---|---|",
    ]
    paths = {kind: RESULTS / f"projection_error.{kind}.json" for kind in KINDS}
    results = {kind: json.loads(path.read_text()) for kind, path in paths.items() if path.is_file()}
    for kind, result in results.items():
        for case, exact_lds in result["exact"].items():
            lines.append(f"| {kind}, {case} | exact | | {exact_lds:+.3f} | |")
            for variant in VARIANTS:
                cells = [s["cells"][case][variant] for s in result["seeds"].values()]
                lds = [c["lds"] for c in cells]
                minus = [c["minus_exact"][0] for c in cells]
                lines.append(
                    f"| {kind}, {case} | {variant} | {' '.join(f'{x:.3f}' for x in lds)} "
                    f"| {np.mean(lds):+.3f} "
                    f"| {' '.join(f'{x:+.3f}' for x in minus)} |"
                )
    lines += [
        "",
        "| set, model | projected per-module cosine's error, std | exact per-module cosines' spread, std "
        "| share of the error common to every query |",
        "|---|---|---|---|",
    ]
    for kind, result in results.items():
        seeds = result["seeds"].values()
        for model in ("base", "ft"):
            mean = {
                key: np.mean([s["modules"][model][key] for s in seeds])
                for key in ("error_std", "exact_spread", "shared_fraction")
            }
            lines.append(
                f"| {kind}, {model} | {mean['error_std']:.3f} | {mean['exact_spread']:.3f} | {mean['shared_fraction']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    if not args.report:
        torch.set_num_threads(2)
        for kind in args.kinds:
            run_kind(kind, args.runs, args.seeds)
    print(report())


if __name__ == "__main__":
    main()
