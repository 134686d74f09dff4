"""Issue 21: how much of the defaults' LDS is the luck of one random projection? The same LDS sets,
cases and retrained subsets as lds_grid.py, indexed again under other `grads.seed`s (the seed of
the Kronecker projection, nothing else), each scored at the defaults and under none / diag, against
exact unprojected per-module cosine (which has no seed).

    PYTHONPATH=. python benchmarks/lds_seeds.py --runs /work/lds --seeds 0 1 2 3 4   # -> lds_results/seeds.<kind>.json
    PYTHONPATH=. python benchmarks/lds_seeds.py --report                            # the table of RANKING.md

Seed 0 reuses lds_grid.py's indexes (RUNS/<kind>-pre, RUNS/<kind>-ft-index); other seeds build
theirs under RUNS/seeds/. Exact scores are computed once per kind and model and kept in
RUNS/exact.<kind>.<base|ft>.npz. Resumable: a (seed, case, scorer) already in the result file is
not scored again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import torch

from benchmarks.lds_grid import KINDS, RESULTS, SMOLLM2, exact, lds_set, mrr, retrained, settings, study_arguments
from gradian_lightning.config import load_config
from gradian_lightning.index.layout import stored_meta
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.query import score_matrix
from gradian_lightning.validation.lds import linear_datamodeling_score, mean_and_standard_error

SCORERS: Dict[str, List[str]] = {
    "defaults (auto)": [],
    "none": ["query.precondition=none"],
    "diag": ["query.precondition=diag"],
}
CASES = ("pretrained", "fine-tuned, base+ft", "fine-tuned, ft")


def exact_scores(kind: str, runs: Path) -> Dict[str, np.ndarray]:
    """Exact per-module cosine [Q, N] per case (base+ft: the sum of the two models' scores)."""
    train, queries, _ = lds_set(kind)
    models = {}
    for which, model in (("base", SMOLLM2), ("ft", runs / f"{kind}-ft")):
        path = runs / f"exact.{kind}.{which}.npz"
        if not path.is_file():
            np.savez(path, **exact(model, train, queries))
        models[which] = np.load(path)["exact module cosine"]
    return {CASES[0]: models["base"], CASES[1]: models["base"] + models["ft"], CASES[2]: models["ft"]}


def case_settings(kind: str, runs: Path, seed: int, dim: int) -> Dict[str, List[str]]:
    """Each case's overrides at projection seed `seed` and k = `dim`, building its index first if it
    is missing (seed 0 reuses lds_grid.py's and lds_ekfac.py --dim's indexes)."""
    at = "" if dim == 16 else f"k{dim}-"
    where = (lambda name: runs / f"{at}{name}") if seed == 0 else (lambda name: runs / "seeds" / f"{at}{name}-s{seed}")
    checkpoints = f"[{SMOLLM2},{runs / f'{kind}-ft'}]"
    common = {"grads.seed": str(seed), "grads.projection_dim": str(dim)}
    pre = settings(kind, runs, **{"index.path": str(where(f"{kind}-pre")), **common})
    tuned = settings(
        kind, runs, **{"index.path": str(where(f"{kind}-ft-index")), "model.checkpoints": checkpoints, **common}
    )
    for overrides in (pre, tuned):
        cfg = load_config(None, overrides)
        if stored_meta(str(cfg.index.path)) is None:
            run_index(cfg)
    return {CASES[0]: pre, CASES[1]: tuned, CASES[2]: tuned + ["query.checkpoints=last"]}


def result_path(kind: str, dim: int) -> Path:
    return RESULTS / (f"seeds.{kind}.json" if dim == 16 else f"seeds.k{dim}-{kind}.json")


def run_kind(kind: str, runs: Path, seeds: Sequence[int], dim: int = 16) -> Dict:
    train, queries, sources = lds_set(kind)
    subsets, outputs = retrained(runs, kind)
    path = result_path(kind, dim)
    result: Dict = json.loads(path.read_text()) if path.is_file() else {"kind": kind, "seeds": {}}
    result.update(rows=len(train), queries=len(queries), subsets=int(subsets.shape[0]), projection_dim=dim)
    result["exact"] = {
        case: {"per_query": linear_datamodeling_score(scores, subsets, outputs).tolist(), "mrr": mrr(scores, sources)}
        for case, scores in exact_scores(kind, runs).items()
    }
    for seed in seeds:
        done = result["seeds"].setdefault(str(seed), {})
        for case, overrides in case_settings(kind, runs, seed, dim).items():
            for name, more in SCORERS.items():
                if name in done.get(case, {}):
                    continue
                started = time.perf_counter()
                cfg = load_config(None, overrides + more + ["query.top_k=all"])
                scores = score_matrix(cfg, len(queries), len(train))
                per_query = linear_datamodeling_score(scores, subsets, outputs)
                done.setdefault(case, {})[name] = {"per_query": per_query.tolist(), "mrr": mrr(scores, sources)}
                print(
                    kind, f"seed {seed}", case, name, f"LDS {per_query.mean():+.3f}",
                    f"{time.perf_counter() - started:.0f} s", flush=True,
                )  # fmt: skip
                RESULTS.mkdir(exist_ok=True)
                path.write_text(json.dumps(result, indent=1))  # after each cell: a killed run keeps the rest
    path.write_text(json.dumps(result, indent=1))
    return result


def report(dims: Sequence[int] = (16,)) -> str:
    """Per set and case: exact's LDS, and per k and scorer the LDS at each seed, their mean, and the
    seed-averaged per-query LDS minus exact's, paired by query (mean ± standard error)."""
    lines = [
        "| set, case | scorer | LDS per seed | mean over seeds | minus exact (paired, seed-averaged) | MRR (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        results = [json.loads(result_path(kind, d).read_text()) for d in dims if result_path(kind, d).is_file()]
        for case in CASES:
            if not results:
                continue
            ex = results[0]["exact"][case]
            exact_lds = np.asarray(ex["per_query"])
            lines.append(
                f"| {kind}, {case} | exact per-module cosine | | {exact_lds.mean():+.3f} | | {ex['mrr']:.3f} |"
            )
            for result, name in ((r, n) for r in results for n in SCORERS):
                cells = [c[case][name] for c in result["seeds"].values() if name in c.get(case, {})]
                if not cells:
                    continue
                per_seed = [float(np.mean(c["per_query"])) for c in cells]
                diff, error = mean_and_standard_error(np.mean([c["per_query"] for c in cells], axis=0) - exact_lds)
                lines.append(
                    f"| {kind}, {case} | k = {result.get('projection_dim', 16)}, {name} "
                    f"| {' '.join(f'{x:.3f}' for x in per_seed)} | {np.mean(per_seed):+.3f} "
                    f"| {diff:+.3f} ± {error:.3f} | {np.mean([c['mrr'] for c in cells]):.3f} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--dims", nargs="+", type=int, default=[16], help="grads.projection_dim (each its own indexes)")
    args = parser.parse_args()
    if args.report:
        print(report(args.dims))
        return
    torch.set_num_threads(2)
    (args.runs / "seeds").mkdir(parents=True, exist_ok=True)
    for dim in args.dims:
        for kind in args.kinds:
            run_kind(kind, args.runs, args.seeds, dim)
    print(report(args.dims))


if __name__ == "__main__":
    main()
