"""Issue 21: eigenvalue-corrected Kronecker preconditioning in the projected space (query.precondition=ekfac)
against diag and fisher, by LDS and planted-source MRR on the LDS sets, with the indexes and retrained
subsets lds_grid.py left in RUNS (nothing is retrained or re-indexed here).

    PYTHONPATH=. python benchmarks/lds_ekfac.py --runs /work/lds            # -> benchmarks/lds_results/ekfac.<kind>.json
    PYTHONPATH=. python benchmarks/lds_ekfac.py --report                     # the table of RANKING.md

ekfac keeps F (a module's k²×k² second moment of rows) only on the diagonal of the Kronecker basis
of its two partial traces (index/statistics.py `kronecker_whitening_factor`): k² variances instead of
fisher's k⁴ moments, all from the statistics the index already stores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from benchmarks.lds_grid import KINDS, RESULTS, SMOLLM2, lds_set, mrr, retrained, settings, study_arguments
from gradian_lightning.config import load_config
from gradian_lightning.index.layout import stored_meta
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.query import score_matrix
from gradian_lightning.validation.lds import linear_datamodeling_score, mean_and_standard_error

SCORERS: List[Dict] = [
    {"precondition": "diag"},
    {"precondition": "fisher"},
    *({"precondition": "ekfac", "damping": d} for d in (0.1, 1.0, 10.0)),
]


def run_kind(kind: str, runs: Path, only: List[str], dim: int = 16, scorers: List[Dict] = SCORERS) -> Dict:
    train, queries, sources = lds_set(kind)
    subsets, outputs = retrained(runs, kind)
    ft = f"[{SMOLLM2},{runs / f'{kind}-ft'}]"
    # k = 16: lds_grid.py's indexes; any other k: indexes of their own under RUNS, built here once.
    at = "" if dim == 16 else f"k{dim}-"
    pre, tuned = {"index.path": str(runs / f"{at}{kind}-pre")}, {"index.path": str(runs / f"{at}{kind}-ft-index")}
    cases = {
        "pretrained": pre,
        "fine-tuned, base+ft": {**tuned, "model.checkpoints": ft},
        "fine-tuned, ft": {**tuned, "model.checkpoints": ft, "query.checkpoints": "last"},
    }
    if dim != 16:
        for more in cases.values():
            more["grads.projection_dim"] = str(dim)
            if stored_meta(more["index.path"]) is None:
                run_index(load_config(None, settings(kind, runs, **more)))
    path = RESULTS / f"ekfac.{at}{kind}.json"
    result: Dict = json.loads(path.read_text()) if path.is_file() else {"kind": kind, "cases": {}}
    result.update(rows=len(train), queries=len(queries))
    for case, more in cases.items():
        if only and case not in only:
            continue
        table = {}
        for scorer in scorers:
            started = time.perf_counter()
            overrides = settings(kind, runs, **more) + [f"query.{k}={v}" for k, v in scorer.items()]
            scores = score_matrix(load_config(None, overrides + ["query.top_k=all"]), len(queries), len(train))
            per_query = linear_datamodeling_score(scores, subsets, outputs)
            lds, error = mean_and_standard_error(per_query)
            name = json.dumps(scorer, sort_keys=True)
            table[name] = {"lds": lds, "lds_se": error, "mrr": mrr(scores, sources), "per_query": list(per_query)}
            print(kind, case, name, table[name], f"{time.perf_counter() - started:.0f} s", flush=True)
        result["cases"][case] = table
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(result, indent=1))  # after each case: the others' results are kept
    return result


def paired(a: Dict, b: Dict) -> str:
    """mean ± standard error over queries of a's per-query LDS minus b's ("" without both)."""
    if "per_query" not in a or "per_query" not in b:
        return ""
    mean, error = mean_and_standard_error(np.asarray(a["per_query"]) - np.asarray(b["per_query"]))
    return f"{mean:+.3f} ± {error:.3f}"


def report() -> str:
    """The table: each scorer's LDS, MRR, and its paired difference from diag (the default at these
    row counts) and, for the pretrained case, from exact per-module cosine (lds_grid.py --dims)."""
    lines = [
        "| set, case | scorer | LDS ± se | minus diag (paired) | minus exact (paired) | MRR | worse of the two |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        path = RESULTS / f"ekfac.{kind}.json"
        if not path.is_file():
            continue
        dims = RESULTS / f"dims.{kind}.json"
        exact = json.loads(dims.read_text())["table"]["exact module cosine"] if dims.is_file() else {}
        for case, table in json.loads(path.read_text())["cases"].items():
            diag = table['{"precondition": "diag"}']
            for name, row in table.items():
                scorer = ", ".join(f"{k} {v}" for k, v in json.loads(name).items())
                worse = min(row["lds"], row["mrr"])
                against_exact = paired(row, exact) if case == "pretrained" else ""
                lines.append(
                    f"| {kind}, {case} | {scorer} | {row['lds']:+.3f} ± {row['lds_se']:.3f} | {paired(row, diag)} "
                    f"| {against_exact} | {row['mrr']:.3f} | {worse:+.3f} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--cases", nargs="*", default=[], help="only these cases (default: all three)")
    parser.add_argument("--dim", type=int, default=16, help="grads.projection_dim (not 16: indexes built under RUNS)")
    parser.add_argument("--only-default-and-diag", action="store_true", help="score ekfac 1.0 and diag alone")
    args = parser.parse_args()
    if args.report:
        print(report())
        return
    for kind in args.kinds:
        chosen = [{"precondition": "diag"}, {"precondition": "ekfac", "damping": 1.0}]
        run_kind(kind, args.runs, args.cases, args.dim, chosen if args.only_default_and_diag else SCORERS)


if __name__ == "__main__":
    main()
