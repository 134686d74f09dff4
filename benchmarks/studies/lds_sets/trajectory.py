"""The product's scorers on an LDS set against the number of checkpoints indexed along the
fine-tune (issue 41, item 4), for the projected index and the exact pass (`query.method=exact`).

Run after `run.py KIND` and `estimators.py NAME --epochs-between 1 2 3` (which saves the
fine-tune's models after each epoch, the first epochs of the same run):

    PYTHONPATH=. python -m benchmarks.studies.lds_sets.trajectory facts-N256
    PYTHONPATH=. python -m benchmarks.studies.lds_sets.trajectory smollm2-N80 --scorers '[{}, {"method": "exact"}]'

Each checkpoint list gets its own index (k = 32 int8, `grads.seed` 0; the two-checkpoint one is
run.py's), scored through `dense_scores` (what `gradian query` and `gradian validate` run) against
the set's retrained subsets: raw and centred LDS, R@10 and MRR, written to trajectory/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.studies.lds_sets.common import (
    FORMATS,
    bm25,
    index,
    lds_figures,
    noise_ceiling,
    paired_difference,
    per_query,
    retrieval,
    settings,
    subset_standard_error,
)
from gradian_lightning import read_jsonl
from gradian_lightning.config import load_config
from gradian_lightning.recipes.query import dense_scores, open_for_query, resolve_scoring
from gradian_lightning.recipes.validate import scorer_name
from gradian_lightning.specs import QuerySpec
from gradian_lightning.validation.lds import linear_datamodeling_score, mean_and_standard_error
from gradian_lightning.validation.subsets import SubsetRuns, write_json_atomically

HERE = Path(__file__).resolve().parent
SCORERS: List[Dict[str, Any]] = [
    {},  # today's defaults: query.method=auto (the exact pass within query.exact_budget)
    {"method": "index"},  # the index path's defaults
    {"method": "index", "checkpoints": "last"},
    {"method": "exact", "checkpoints": "last"},
    {"method": "exact", "precondition": "none", "score": "inner"},
    {"method": "exact", "precondition": "none", "score": "cosine"},
    {"method": "exact", "precondition": "kfac", "horizon": None, "damping": 0.1, "score": "inner"},
    {"method": "exact", "precondition": "ekfac", "horizon": None, "damping": 0.1, "score": "inner"},
]


def report(results: List[Dict[str, Any]]) -> str:
    """One Markdown table: each set's scorers, raw and centred LDS, R@10, MRR and (results that
    hold BM25) raw LDS minus BM25's paired by query, per checkpoint list; then BM25 and the noise ceiling."""
    lines = [
        "| set | checkpoints | scorer | raw LDS | centred LDS | R@10 | MRR | minus BM25 (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def figures(e: Dict[str, Any]) -> str:
        return (
            f"{e['lds']:+.3f} ± {e['standard_error']:.3f} | {e['centred_lds']:+.3f} ± {e['centred_standard_error']:.3f} | "
            f"{e.get('recall@10', float('nan')):.2f} | {e.get('mrr', float('nan')):.2f}"
        )

    for result in results:
        lexical = result.get("bm25")
        for entry in result["lists"].values():
            for e in entry["scorers"]:
                paired = paired_difference(e["per_query"]["raw"], lexical["per_query"]["raw"]) if lexical else None
                versus = f"{paired[0]:+.3f} ± {paired[1]:.3f} ({paired[0] / paired[1]:.1f} SE)" if paired else ""
                if paired and "minus_bm25_subset_standard_error" in e:  # both parts of the error
                    both = float(np.hypot(paired[1], e["minus_bm25_subset_standard_error"]))
                    versus += f"; with the subsets' ± {e['minus_bm25_subset_standard_error']:.3f}: ± {both:.3f} ({paired[0] / both:.1f} SE)"
                lines.append(
                    f"| {result['set']} | {len(entry['checkpoints'])} | {e['name']} | {figures(e)} | {versus} |"
                )
        if lexical:
            lines.append(f"| {result['set']} | | BM25 | {figures(lexical)} | |")
        if result.get("ceiling"):
            c = result["ceiling"]
            lines.append(
                f"| {result['set']} | | noise ceiling | {c['lds']:+.3f} ± {c['standard_error']:.3f} | "
                f"{c['centred_lds']:+.3f} ± {c['centred_standard_error']:.3f} | | | |"
            )
    return "\n".join(lines) + "\n"


def on_first_subsets(
    scores: np.ndarray, subsets: np.ndarray, outputs: np.ndarray, counts: Sequence[int]
) -> Dict[str, List[float]]:
    """Per-query raw LDS [Q] on only the first m retrained subsets, for each m of `counts` under M:
    how a figure and its standard error move with the number of subsets, on the same queries."""
    return {
        str(m): linear_datamodeling_score(scores, subsets[:m], outputs[:m]).tolist() for m in counts if m < len(subsets)
    }


def by_subsets(results: List[Dict[str, Any]]) -> str:
    """A Markdown table: each scorer's raw LDS and its difference from BM25 (paired by query) on the
    first m subsets (`--first-subsets`) and on all of them: the standard error against M."""
    lines = ["| set | subsets | scorer | raw LDS | minus BM25 (paired) |", "|---|---|---|---|---|"]
    for result in results:
        lexical = result["bm25"]
        for entry in result["lists"].values():
            for e in entry["scorers"]:
                counts = {**e.get("first_subsets", {}), str(result["num_subsets"]): e["per_query"]["raw"]}
                for m, raw in counts.items():
                    words = {
                        **lexical.get("first_subsets", {}),
                        str(result["num_subsets"]): lexical["per_query"]["raw"],
                    }[m]
                    mean, error = mean_and_standard_error(np.asarray(raw))
                    paired = paired_difference(raw, words)
                    versus = f"{paired[0]:+.3f} ± {paired[1]:.3f} ({paired[0] / paired[1]:.1f} SE)" if paired else ""
                    lines.append(f"| {result['set']} | {m} | {e['name']} | {mean:+.3f} ± {error:.3f} | {versus} |")
    return "\n".join(lines) + "\n"


def finished_runs(output: Path, partial: bool) -> Tuple[np.ndarray, np.ndarray]:
    """The retrained subsets (bool [M, N]) and their query losses (float64 [repeats, M, Q]). With
    `partial`, a run still training gives its subsets whose every repeat has finished: validate
    trains subset by subset in order, so they are the first M' (the LDS of fewer subsets)."""
    runs = SubsetRuns.existing(output)
    losses = runs.losses()
    if losses is not None:
        return runs.subsets, losses
    if not partial:
        raise SystemExit(f"{output}: {len(runs.todo())} training runs are unfinished; wait, or pass --partial")
    done = min(m for m, _ in runs.todo())
    losses = [
        [json.loads(runs._path(m, r).read_text())["query_loss"] for m in range(done)] for r in range(runs.repeats)
    ]
    return runs.subsets[:done], np.asarray(losses, dtype=np.float64)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="the set's work folder, e.g. facts-N256")
    parser.add_argument("--report", action="store_true", help="print the table of every result in --results")
    parser.add_argument("--root", type=Path, default=Path("/tmp/gradian-lds-sets"))
    parser.add_argument("--results", type=Path, default=HERE / "trajectory")
    parser.add_argument("--scorers", type=json.loads, default=SCORERS, help="a JSON list of query.* overrides")
    parser.add_argument("--lists", nargs="+", default=["2", "all"], help="checkpoint lists: 2 (base, ft), all")
    parser.add_argument(
        "--first-subsets", type=int, nargs="*", default=[],
        help="also each scorer's per-query LDS on only the first m subsets, for each m (the SE against M)",
    )  # fmt: skip
    parser.add_argument(
        "--partial", action="store_true", help="a run still training: score its finished subsets (finished_runs)"
    )
    args = parser.parse_args(argv)
    if args.report:
        results = [json.loads(p.read_text()) for p in sorted(args.results.glob("*.json"))]
        print(report(results))
        if any("first_subsets" in r.get("bm25", {}) for r in results):
            print(by_subsets([r for r in results if "first_subsets" in r.get("bm25", {})]))
        return 0
    work = args.root / args.name
    started = time.perf_counter()
    from benchmarks.studies.lds_sets.common import SetSpec
    from benchmarks.studies.lds_sets.run import spec_for

    if (work / "result.json").is_file():
        known = json.loads((work / "result.json").read_text())["spec"]
        spec = SetSpec(**{k: v for k, v in known.items() if k in SetSpec.__dataclass_fields__})
    else:  # run.py stopped before its last index: the set's spec as run.py makes it
        kind, rows = args.name.split("-N")[0], int(args.name.split("-N")[1].split("-")[0])
        spec = spec_for(kind, rows, smoke=False)
    base = Path(spec.base) if spec.base else work / "base"
    ft = work / "ft"
    between = sorted(work.glob("ft-e*"), key=lambda p: int(p.name[len("ft-e") :]))
    train, queries = read_jsonl(work / "train.jsonl"), read_jsonl(work / "queries.jsonl")
    ids = [r["id"] for r in train]
    sources = [[ids.index(s) for s in q["sources"]] for q in queries] if all("sources" in q for q in queries) else None
    subsets, losses = finished_runs(work / "runs", args.partial)
    outputs = -losses.mean(axis=0)
    lexical = bm25(train, queries)
    out: Dict[str, Any] = {
        "set": args.name,
        "command": "PYTHONPATH=. python -m benchmarks.studies.lds_sets.trajectory "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "num_subsets": int(subsets.shape[0]),
        "repeats": int(losses.shape[0]),
        "queries": len(queries),
        "ceiling": noise_ceiling(losses),
        "bm25": {
            **lds_figures(lexical, subsets, outputs),
            "per_query": per_query(lexical, subsets, outputs),
            "first_subsets": on_first_subsets(lexical, subsets, outputs, args.first_subsets),
            "subset_standard_error": subset_standard_error(lexical, subsets, outputs),
            **(retrieval(lexical, sources) if sources else {}),
        },
        "lists": {},
    }
    for label in args.lists:
        models = [base, ft] if label == "2" else [base, *between, ft]
        more = {**FORMATS["k32-int8"], "grads.seed": "0"}
        path = work / (
            "index-projected-k32-int8-seed0" if label == "2" else f"index-trajectory{len(models)}-k32-int8-seed0"
        )
        cfg_args = settings(spec, work, base, ft, **{"model.checkpoints": "[" + ",".join(map(str, models)) + "]"})
        index(cfg_args, path, **more)
        # query.method=auto, today's default (common.settings pins the stored rows for run.py's scorers)
        scored = [*cfg_args, f"index.path={path}", *(f"{k}={v}" for k, v in more.items()), "query.method=auto"]
        cfg = load_config(None, scored)
        specs = [
            QuerySpec.from_config(
                load_config(None, [*scored, *(f"query.{k}={json.dumps(v)}" for k, v in s.items())]).query
            )
            for s in args.scorers
        ]
        entries = []
        opened = open_for_query(cfg)[0]  # what query.method=auto chooses for each scorer, and why
        chosen = [resolve_scoring(cfg, opened, q) for q in specs]
        for scorer, matrix, (resolved, why) in zip(args.scorers, dense_scores(cfg, specs), chosen):
            scores = np.nan_to_num(matrix.astype(np.float64), nan=0.0)
            entry = {"scorer": scorer, "name": scorer_name(scorer), **lds_figures(scores, subsets, outputs)}
            entry.update(method=resolved.method, scoring=why, per_query=per_query(scores, subsets, outputs))
            entry["first_subsets"] = on_first_subsets(scores, subsets, outputs, args.first_subsets)
            # The draw of subsets moves every query's LDS together: its share of the error, jackknifed.
            entry["subset_standard_error"] = subset_standard_error(scores, subsets, outputs)
            entry["minus_bm25_subset_standard_error"] = subset_standard_error(scores, subsets, outputs, lexical)
            if sources:
                entry.update(retrieval(scores, sources))
            entries.append(entry)
            print(
                f"{args.name} {len(models)} checkpoints: {entry['name']:60s} raw {entry['lds']:+.3f} ± {entry['standard_error']:.3f} "
                f"centred {entry['centred_lds']:+.3f} R@10 {entry.get('recall@10', float('nan')):.2f} ({resolved.method})",
                flush=True,
            )
        out["lists"][label] = {"checkpoints": [str(m) for m in models], "scorers": entries}
    out["wall_seconds"] = time.perf_counter() - started
    args.results.mkdir(parents=True, exist_ok=True)
    write_json_atomically(args.results / f"{args.name}.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
