"""Issue 21's measurement: the scorers by counterfactual LDS and planted-source MRR together, on the
LDS sets (lds_make_data.py), SmolLM2-135M pretrained and fine-tuned, with exact unprojected
gradients as the reference. Through the product: `gradian index` builds each index, `gradian validate`
retrains the 24 half-subsets (kept in RUNS/<kind>-runs and shared by every case of a kind) and scores.

    PYTHONPATH=. python benchmarks/lds_grid.py --kinds fact newword      # -> benchmarks/lds_results/<kind>.json
    PYTHONPATH=. python benchmarks/lds_grid.py --report                  # the tables of RANKING.md
    PYTHONPATH=. python benchmarks/lds_grid.py --kinds fact newword --dims 16 32   # -> lds_results/dims.<kind>.json

Cases, per kind:
  pretrained     the index of SmolLM2 as built (what the 24 subsets are fine-tuned from);
  fine-tuned     SmolLM2 fine-tuned on all 80 rows with validate's recipe (2 epochs, AdamW 1e-4,
                 batch 8, seed 0), indexed as model.checkpoints=[base, ft]: scored at the newest
                 checkpoint alone (ft) and summed over both (base+ft, the default query.checkpoints).
Scorers: score cosine (per module, or whole row) or inner, under precondition none/diag/fisher at
damping 1.0 (fisher also 0.1 and 10), and auto. Exact: unprojected per-module cosine, whole-row
cosine and inner product of the MLP modules' gradients, from <G_a, G_b> = Σ_t Σ_s (g_t·g_s)(x_t·x_s)
(ranking_grid.Captured), never materialising a gradient.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from benchmarks.ranking_grid import Captured
from gradian_lightning.config import load_config
from gradian_lightning.data import read_jsonl
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.hub import load_model_and_tokenizer
from gradian_lightning.index.layout import stored_meta
from gradian_lightning.query.precondition import resolve
from gradian_lightning.query.topk import Index
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.query import score_matrix
from gradian_lightning.recipes.validate import run_validate
from gradian_lightning.validation.lds import linear_datamodeling_score, mean_and_standard_error
from gradian_lightning.validation.retrain import FineTune, fine_tune
from gradian_lightning.validation.subsets import SubsetRuns

HERE = Path(__file__).resolve().parent
DATA, RESULTS = HERE / "lds_data", HERE / "lds_results"
SMOLLM2 = Path.home() / ".cache" / "gradian" / "smollm2-135m-instruct"
KINDS = ("fact", "newword")
SCORERS: List[Dict] = [
    {"precondition": "auto"},
    *({"precondition": p} for p in ("none", "diag", "fisher")),
    {"precondition": "fisher", "damping": 0.1},
    {"precondition": "fisher", "damping": 10.0},
    *({"normalize": "row", "precondition": p} for p in ("none", "fisher")),
    *({"score": "inner", "precondition": p} for p in ("none", "diag", "fisher")),
]


def settings(kind: str, runs: Path, **more: str) -> List[str]:
    base = {
        "model.name_or_path": str(SMOLLM2),
        "data.train": str(DATA / f"{kind}.train.jsonl"),
        "query.data": str(DATA / f"{kind}.queries.jsonl"),
        "trainer.accelerator": "cpu",
        "trainer.enable_progress_bar": "false",
        "grads.batch_size": "8",
        "grads.max_seq_length": "64",
        "validate.num_subsets": "24",
        "validate.output": str(runs / f"{kind}-runs"),
        **more,
    }
    return [f"{k}={v}" for k, v in base.items()]


def lds_set(kind: str) -> Tuple[List[Dict], List[Dict], List[List[int]]]:
    """A kind's training rows, its queries, and each query's planted sources as row positions."""
    train, queries = read_jsonl(DATA / f"{kind}.train.jsonl"), read_jsonl(DATA / f"{kind}.queries.jsonl")
    ids = [r["id"] for r in train]
    return train, queries, [[ids.index(s) for s in q["sources"]] for q in queries]


def study_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every study on lds_grid.py's runs shares (--kinds, --runs, --report); each
    script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--runs", type=Path, default=Path("/tmp/gradian-lds"), help="lds_grid.py's RUNS folder")
    parser.add_argument("--report", action="store_true", help="print the table from the saved results")
    return parser


def mrr(scores: np.ndarray, sources: List[List[int]]) -> float:
    """Mean reciprocal rank of each query's first planted source among all rows."""
    ranks = [1 + int((scores[q] > max(scores[q, s] for s in src)).sum()) for q, src in enumerate(sources)]
    return float(np.mean([1.0 / r for r in ranks]))


def retrained(runs: Path, kind: str):
    """(subsets bool [M, N], outputs -loss [M, Q]) of the kind's retrained half-subsets."""
    done = SubsetRuns.existing(runs / f"{kind}-runs")
    return done.subsets, -done.losses().mean(axis=0)  # averaged over repeats, as gradian validate does


def finetuned(kind: str, runs: Path) -> Path:
    """SmolLM2 fine-tuned on the kind's 80 rows with validate's recipe (saved once)."""
    out = runs / f"{kind}-ft"
    if (out / "config.json").is_file():
        return out
    cfg = load_config(None, settings(kind, runs))
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    v = cfg.validate
    fine_tune(
        FineTune(model.train(), v.learning_rate),
        read_jsonl(cfg.data.train),
        tokenizer,
        64,
        v.batch_size,
        v.epochs,
        0,
        {"accelerator": "cpu", "devices": 1},
    )
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def exact(model_dir: Path, train: List[Dict], queries: List[Dict]) -> Dict[str, np.ndarray]:
    """Exact per-module cosine, row cosine and inner product [Q, N] of the MLP modules' gradients."""
    cfg = load_config(None, [f"model.name_or_path={model_dir}"])
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    modules = select_modules(model, list(cfg.grads.module_filter))
    q = Captured(modules).run(model, tokenizer, queries)
    t = Captured(modules).run(model, tokenizer, train, queries=q)
    inner = t.inner  # [Q, N, M] float64
    norms = (q.self_inner[:, None, :] * t.self_inner[None, :, :]).sqrt().clamp_min(1e-300)
    row = inner.sum(2) / (q.self_inner.sum(1)[:, None] * t.self_inner.sum(1)[None, :]).sqrt()
    return {
        "exact module cosine": (inner / norms).mean(2).numpy(),
        "exact row cosine": row.numpy(),
        "exact inner": inner.sum(2).numpy(),
    }


def run_kind(kind: str, runs: Path) -> Dict:
    train, queries, sources = lds_set(kind)
    ft = finetuned(kind, runs)
    cases = {
        "pretrained": settings(kind, runs, **{"index.path": str(runs / f"{kind}-pre")}),
        "fine-tuned, base+ft": settings(
            kind, runs, **{"index.path": str(runs / f"{kind}-ft-index"), "model.checkpoints": f"[{SMOLLM2},{ft}]"}
        ),
        "fine-tuned, ft": settings(
            kind,
            runs,
            **{
                "index.path": str(runs / f"{kind}-ft-index"),
                "model.checkpoints": f"[{SMOLLM2},{ft}]",
                "query.checkpoints": "last",
            },
        ),
    }
    result: Dict = {"kind": kind, "rows": len(train), "queries": len(queries), "cases": {}}
    outputs = None
    for case, overrides in cases.items():
        cfg = load_config(None, overrides)
        if stored_meta(str(cfg.index.path)) is None:
            run_index(cfg)
        started = time.perf_counter()
        report = run_validate(cfg)  # trains the subsets on the first call; later calls reuse them
        cells = {}
        for scorer in SCORERS:
            scoring = load_config(None, overrides + [f"query.{k}={v}" for k, v in scorer.items()] + ["query.top_k=all"])
            scores = score_matrix(scoring, len(queries), len(train))
            cells[json.dumps(scorer, sort_keys=True)] = scores
        subsets, outputs = retrained(runs, kind)
        if case == "pretrained":
            cells.update(exact(SMOLLM2, train, queries))
        elif case == "fine-tuned, ft":
            cells.update(exact(ft, train, queries))
        else:  # base+ft: the sum of the two models' exact scores, as the checkpoints' sum
            base, tuned = exact(SMOLLM2, train, queries), exact(ft, train, queries)
            cells.update({k: base[k] + tuned[k] for k in base})
        table = {}
        for name, scores in cells.items():
            lds, error = mean_and_standard_error(linear_datamodeling_score(scores, subsets, outputs))
            table[name] = {"lds": lds, "lds_se": error, "mrr": mrr(scores, sources)}
        random = report["random"]
        table["random"] = {"lds": random["lds"], "lds_se": random["standard_error"], "mrr": None}
        result["cases"][case] = {"table": table, "seconds": time.perf_counter() - started}
        print(f"{kind} / {case}: done in {time.perf_counter() - started:.0f} s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{kind}.json").write_text(json.dumps(result, indent=1))
    return result


def projection_dims(kind: str, runs: Path, dims: Sequence[int]) -> Dict:
    """The pretrained case only, at the default scorer, for each grads.projection_dim in `dims`
    (each a fresh index in a temporary folder) and exact unprojected per-module cosine: LDS over the
    retrained subsets already in RUNS/<kind>-runs (none are trained here) and planted-source MRR."""
    train, queries, sources = lds_set(kind)
    subsets, outputs = retrained(runs, kind)
    table: Dict[str, Dict] = {}

    def row(scores: np.ndarray, started: float, **more) -> Dict:
        per_query = linear_datamodeling_score(scores, subsets, outputs)
        lds, error = mean_and_standard_error(per_query)
        return {
            "lds": lds,
            "lds_se": error,
            "mrr": mrr(scores, sources),
            "seconds": time.perf_counter() - started,
            **more,
            "per_query": per_query.tolist(),
        }

    with tempfile.TemporaryDirectory() as tmp:
        for k in dims:
            started = time.perf_counter()
            overrides = settings(kind, runs, **{"index.path": f"{tmp}/k{k}", "grads.projection_dim": str(k)})
            run_index(load_config(None, overrides))
            scores = score_matrix(load_config(None, overrides + ["query.top_k=all"]), len(queries), len(train))
            index = Index(f"{tmp}/k{k}")
            table[f"k = {k}"] = row(
                scores, started, resolves_to=resolve(index, "auto"), row_bytes=int(index.meta["width"]) * 2
            )
            print(kind, f"k = {k}", table[f"k = {k}"], flush=True)
    started = time.perf_counter()
    table["exact module cosine"] = row(exact(SMOLLM2, train, queries)["exact module cosine"], started)
    print(kind, "exact", table["exact module cosine"], flush=True)
    result = {"kind": kind, "case": "pretrained", "rows": len(train), "queries": len(queries), "table": table}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"dims.{kind}.json").write_text(json.dumps(result, indent=1))
    return result


def dims_report(kinds: Sequence[str]) -> str:
    """The table, with each row's LDS minus the first row's (the smallest k) and minus the last
    row's (exact), paired by query: the mean of the per-query differences ± its standard error."""
    lines = [
        "| kind | scorer | LDS ± se | minus the first row (paired) | minus exact (paired) | MRR | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        table = json.loads((RESULTS / f"dims.{kind}.json").read_text())["table"]
        rows = list(table.values())
        first, last = np.asarray(rows[0]["per_query"]), np.asarray(rows[-1]["per_query"])
        for name, r in table.items():
            label = f"{name} (defaults; auto = {r['resolves_to']})" if "resolves_to" in r else name
            here = np.asarray(r["per_query"])
            paired = [mean_and_standard_error(here - other) for other in (first, last)]
            lines.append(
                f"| {kind} | {label} | {r['lds']:+.3f} ± {r['lds_se']:.3f} | "
                + " | ".join(f"{d:+.3f} ± {e:.3f}" for d, e in paired)
                + f" | {r['mrr']:.3f} | {r['seconds']:.0f} |"
            )
    return "\n".join(lines)


def report() -> str:
    lines = []
    results = [json.loads((RESULTS / f"{k}.json").read_text()) for k in KINDS if (RESULTS / f"{k}.json").is_file()]
    for result in results:
        for case, cell in result["cases"].items():
            lines += [
                f"#### {result['kind']}, {case} ({result['rows']} rows, {result['queries']} queries, 24 subsets)",
                "",
                "| scorer | LDS ± se | MRR | worse of the two |",
                "|---|---|---|---|",
            ]
            for name, row in sorted(
                cell["table"].items(),
                key=lambda kv: -min(kv[1]["lds"], kv[1]["mrr"] if kv[1]["mrr"] is not None else 9),
            ):
                worse = min(row["lds"], row["mrr"]) if row["mrr"] is not None else row["lds"]
                mrr_text = f"{row['mrr']:.3f}" if row["mrr"] is not None else "-"
                lines.append(f"| {name} | {row['lds']:+.3f} ± {row['lds_se']:.3f} | {mrr_text} | {worse:+.3f} |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--runs", default="/tmp/gradian-lds", help="where indexes, fine-tunes and retrained subsets go")
    parser.add_argument("--report", action="store_true")
    parser.add_argument(
        "--dims",
        nargs="*",
        type=int,
        help="only the pretrained case at the default scorer, per grads.projection_dim, against exact"
        " (the retrained subsets must already be in RUNS/<kind>-runs)",
    )
    args = parser.parse_args()
    if args.dims:
        torch.set_num_threads(2)
        for kind in args.kinds:
            projection_dims(kind, Path(args.runs), args.dims)
        print(dims_report(args.kinds))
        return
    if args.report:
        print(report())
        return
    torch.set_num_threads(2)
    for kind in args.kinds:
        run_kind(kind, Path(args.runs))
    print(report())


if __name__ == "__main__":
    main()
