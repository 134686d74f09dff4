"""Bergson 2.5.1's EK-FAC and TrackStar beside gradian on the LDS sets (issue 43 item 3, quality).

For each LDS set (benchmarks/studies/lds_sets: its fine-tuned model `ft/`, `train.jsonl`,
`queries.jsonl` with planted sources, gradian validate's retrained half-subsets in `runs/`, and
gradian's own figures in `result.json`), bergson scores every query against every training row on
the fine-tuned model, and the [Q, N] scores are measured with gradian's own functions
(`common.lds_figures`, `common.retrieval`) on the same retrained subsets, beside gradian's figures.

The same tokens on both sides: the rows and queries go to bergson pre-tokenized, each as gradian
tokenizes it (`gradian_lightning.data.tokenize_row`: prompt + completion, the completion's tokens
and an EOS supervised, truncated to the set's `grads.max_seq_length`), as `input_ids` and `labels`
(-100 where unsupervised), which bergson then uses as they are (it tokenizes only rows without
`input_ids`, and the sets' word-level tokenizers have no chat template for it to apply). Before
running, the script loads both files through bergson's own data pipeline
(`bergson.utils.worker_utils.setup_data_pipeline`) and checks every row's ids and labels equal
gradian's.

The bergson runs, each its CLI in its own virtualenv (peer_bergson.py makes it), at its defaults
but for what must match:

- EK-FAC: `bergson ekfac --method kfac --hessian_cfg.ev_correction true`: K-FAC factors with the
  eigenvalue correction fitted on the training rows, the inverse applied to each query's
  full-space (unprojected) gradient, scored by inner product against the full-space training
  gradients (`projection_dim` 0, the ekfac path's default);
- TrackStar: `bergson trackstar` at its defaults (projection 16 a side, the query and training
  autocorrelation Hessians mixed, target_downweight_components 1000, the preconditioned inner
  product: bergson's `unit_normalize` is off by default), and again with `--unit_normalize true`,
  the unit-normalised score of the TrackStar paper;
- both with `--query.aggregation none` (one score column a query), on the modules gradian's index
  holds (every layer's MLP: `--filter_modules "*self_attn*,lm_head"`), loss summed over the
  supervised tokens (bergson's default), float32, one process.

Bergson's EK-FAC and TrackStar take one model: they cannot sum scores over checkpoints as
gradian's `query.checkpoints=all` sums base + ft (only `bergson trak --checkpoints` ensembles
models, with its own loss and projection). So each method runs on `ft` (beside gradian's
`checkpoints=last`) and on `base`, and the "base + ft" rows are the two runs' raw scores summed
here (beside gradian's default). bergson fits its Fisher with labels sampled from the model,
unseeded, so each method and model runs `--repeats` times (3) in fresh processes and the figures
are the means, with the spread (max - min) over the runs.

    PYTHONPATH=. python -m benchmarks.perf.peer_bergson_quality       # the four sets, 7-10 minutes a set
    PYTHONPATH=. python -m benchmarks.perf.peer_bergson_quality --sets facts-N256 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from benchmarks.common import ROOT, write_result
from benchmarks.perf.peer_bergson import VENV, ensure_venv

LDS_ROOT = Path("/tmp/gradian-lds-sets")
WORK = Path("/tmp/bergsonq")
# The sets of the comparison; `shared` is measured by centred LDS only: its raw noise ceiling is ~0.
SETS = ["facts-N256", "format-N512", "facts-N1024", "shared-N512"]
CENTRED_ONLY = {"shared-N512"}
MODULES_EXCLUDED = "*self_attn*,lm_head"  # bergson excludes by glob: what is left is every layer's MLP
# trackstar-cosine: TrackStar with `--unit_normalize true`, the paper's unit-normalised score
# (Chang et al. 2024); bergson's own default scores the preconditioned inner product.
METHODS = ("ekfac", "trackstar", "trackstar-cosine")
# gradian's rows from result.json: (label, index kind, scorer as validate names it in result.json)
GRADIAN_ROWS = [
    ("gradian defaults (base + ft)", "projected", {}),
    ("gradian defaults, ft alone", "projected", {"checkpoints": "last"}),
    ("exact inner product (base + ft)", "exact", {"precondition": "none", "score": "inner"}),
    ("exact inner product, ft alone", "exact", {"precondition": "none", "score": "inner", "checkpoints": "last"}),
]


def gradian_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def tokenized_rows(model_dir: Path, rows: List[Dict[str, Any]], max_seq_length: int) -> List[Dict[str, Any]]:
    """Each row as gradian tokenizes it: {input_ids, labels (-100 unsupervised), length}."""
    from gradian_lightning.config import load_config
    from gradian_lightning.data import tokenize_row
    from gradian_lightning.hub import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer(load_config(None, [f"model.name_or_path={model_dir}"]).model)
    out = []
    for i, row in enumerate(rows):
        example = tokenize_row(tokenizer, row, i, max_seq_length)
        out.append({"input_ids": example.input_ids, "labels": example.labels, "length": len(example.input_ids)})
    return out


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: List[Dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# Run in bergson's virtualenv: load a pre-tokenized file through bergson's data pipeline and print
# what it will score, as JSON [{input_ids, labels}] in row order.
BERGSON_VIEW = """
import json, sys, types
from bergson.config.config import DataConfig
from bergson.utils.worker_utils import setup_data_pipeline
model, path, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = types.SimpleNamespace(tokenizer="", model=model, revision=None, model_kwargs="", token_batch_size=budget,
                            drop_columns=True, max_tokens=None, data=DataConfig(dataset=path))
ds, _ = setup_data_pipeline(cfg)
print(json.dumps([{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in ds]))
"""

# Run in bergson's virtualenv: a score store as a float64 [N, Q] .npy.
BERGSON_SCORES = """
import sys, numpy as np
from pathlib import Path
from bergson.data import load_scores
scores = load_scores(Path(sys.argv[1]))
assert scores.is_written(), "not every score was written"
np.save(sys.argv[2], np.asarray(scores[:], dtype=np.float64))
"""


def check_same_tokens(venv: Path, model_dir: Path, path: Path, expected: List[Dict[str, Any]], env: Dict) -> int:
    """bergson's view of `path` equals gradian's tokens and labels row for row; returns the tokens checked."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", BERGSON_VIEW, str(model_dir), str(path), str(token_budget(model_dir))],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"peer_bergson_quality: error: bergson could not load {path}:\n{out.stderr[-3000:]}")
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if len(seen) != len(expected):
        raise SystemExit(
            f"peer_bergson_quality: error: bergson sees {len(seen)} rows of {path}, gradian {len(expected)}"
        )
    for i, (b, g) in enumerate(zip(seen, expected)):
        if b["input_ids"] != g["input_ids"] or b["labels"] != g["labels"]:
            raise SystemExit(
                f"peer_bergson_quality: error: row {i} of {path}: bergson's tokens or labels differ from gradian's"
            )
    return sum(len(g["input_ids"]) for g in expected)


def token_budget(model_dir: Path) -> int:
    """bergson's --token_batch_size: its default 2,048, or the model's context where shorter (bergson
    refuses a budget above it; the tiny sets' models have 64 positions, their rows at most 40 tokens)."""
    config = json.loads((model_dir / "config.json").read_text())
    return min(2048, int(config.get("max_position_embeddings", 2048)))


def bergson_command(venv: Path, method: str, run: Path, model_dir: Path, train: Path, queries: Path) -> List[str]:
    common = [
        str(run),
        "--model",
        str(model_dir),
        "--data.dataset",
        str(train),
        "--query.dataset",
        str(queries),
        "--query.aggregation",
        "none",
        "--filter_modules",
        MODULES_EXCLUDED,
        "--token_batch_size",
        str(token_budget(model_dir)),
        "--nproc_per_node",
        "1",
        "--overwrite",
        "true",
    ]
    if method == "ekfac":
        return [
            str(venv / "bin" / "bergson"),
            "ekfac",
            *common,
            "--method",
            "kfac",
            "--hessian_cfg.ev_correction",
            "true",
        ]
    cosine = ["--unit_normalize", "true"] if method == "trackstar-cosine" else []
    return [str(venv / "bin" / "bergson"), "trackstar", *common, *cosine]


def run_bergson(venv: Path, method: str, work: Path, model_dir: Path, env: Dict, repeat: int) -> Dict[str, Any]:
    """One bergson pipeline on the model at `model_dir` (a fresh process: bergson seeds nothing, so
    each repeat draws its own sampled labels); its scores as float64 [Q, N] and its wall time."""
    tag = f"{model_dir.name}-{method}-{repeat}"
    run = work / tag
    scores_npy = work / f"{tag}-scores.npy"
    cmd = bergson_command(venv, method, run, model_dir, work / "train.jsonl", work / "queries.jsonl")
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    wall = time.perf_counter() - started
    (work / f"{tag}.log").write_text(out.stdout + "\n--- stderr ---\n" + out.stderr)
    if out.returncode != 0:
        raise SystemExit(
            f"bergson {tag} failed (exit {out.returncode}); log {work / f'{tag}.log'}:\n{out.stderr[-3000:]}"
        )
    dumped = subprocess.run(
        [str(venv / "bin" / "python"), "-c", BERGSON_SCORES, str(run / "scores"), str(scores_npy)],
        capture_output=True,
        text=True,
        env=env,
    )
    if dumped.returncode != 0:
        raise SystemExit(f"peer_bergson_quality: error: reading bergson's {tag} scores:\n{dumped.stderr[-3000:]}")
    return {"scores": np.load(scores_npy).T, "wall_s": wall, "command": " ".join(cmd)}


def gradian_figures(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """gradian's rows of GRADIAN_ROWS from a set's result.json: projected k32-int8 seed-averaged
    (common.seed_averaged), exact as is; then BM25 and the noise ceiling."""
    from benchmarks.studies.lds_sets.common import seed_averaged
    from gradian_lightning.recipes.validate import scorer_name

    averaged = seed_averaged(result)
    rows = []
    for label, kind, scorer in GRADIAN_ROWS:
        name = scorer_name(scorer)
        match = [
            r
            for r in averaged
            if r["scorer"] == name and (r.get("format") == "k32-int8" if kind == "projected" else r["index"] == "exact")
        ]
        if len(match) != 1:
            raise SystemExit(f"peer_bergson_quality: error: {label}: {len(match)} rows named {name!r} in result.json")
        rows.append({"label": label, "index": match[0]["index"], **match[0]})
    rows.append({"label": "BM25", "index": "words", **result["bm25"]})
    ceiling = result["indexes"]["exact"]["ceiling"]
    rows.append({"label": "noise ceiling", "index": "", **ceiling})
    return rows


def measure_set(name: str, args: argparse.Namespace, env: Dict[str, str]) -> Dict[str, Any]:
    """Tokenize, check, run each bergson method and measure it beside gradian's figures for one set."""
    from benchmarks.studies.lds_sets.common import lds_figures, retrieval
    from gradian_lightning.validation.subsets import SubsetRuns

    source = Path(args.lds_root) / name
    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)
    result = json.loads((source / "result.json").read_text())
    max_seq_length = int(result["spec"]["max_seq_length"])
    model_dir = source / "ft"
    train, queries = read_jsonl(source / "train.jsonl"), read_jsonl(source / "queries.jsonl")
    ids = [r["id"] for r in train]
    sources = [[ids.index(s) for s in q["sources"]] for q in queries]
    checked = 0
    for label, rows in (("train", train), ("queries", queries)):
        tokens = tokenized_rows(model_dir, rows, max_seq_length)
        if tokenized_rows(source / "base", rows, max_seq_length) != tokens:
            raise SystemExit(f"peer_bergson_quality: error: {name}: base and ft tokenize the {label} rows differently")
        write_jsonl(work / f"{label}.jsonl", tokens)
        checked += check_same_tokens(Path(args.venv), model_dir, work / f"{label}.jsonl", tokens, env)
    print(
        f"{name}: bergson reads the same {checked:,} tokens and labels as gradian ({len(train)} rows, {len(queries)} queries)",
        flush=True,
    )
    done = SubsetRuns.existing(source / "runs")
    outputs = -done.losses().mean(axis=0)
    measured: Dict[str, Any] = {"rows": len(train), "queries": len(queries), "tokens_checked": checked, "methods": {}}
    for method in args.methods:
        # bergson's EK-FAC and TrackStar take one model: base + ft is two runs, their raw scores summed here.
        ran = [
            {c: run_bergson(Path(args.venv), method, work, source / c, env, r) for c in ("ft", "base")}
            for r in range(args.repeats)
        ]
        for checkpoints in ("ft", "base+ft"):
            runs = ["ft"] if checkpoints == "ft" else ["base", "ft"]
            draws = []
            for r in ran:
                scores = sum(r[c]["scores"] for c in runs)
                if scores.shape != (len(queries), len(train)):
                    raise SystemExit(
                        f"peer_bergson_quality: error: bergson {method} scored {scores.shape}, expected {(len(queries), len(train))}"
                    )
                draws.append({**lds_figures(scores, done.subsets, outputs), **retrieval(scores, sources)})
            figures = {k: float(np.mean([d[k] for d in draws])) for k in draws[0]}
            measured["methods"][f"{method}@{checkpoints}"] = {
                "label": bergson_label(method, checkpoints),
                "index": BERGSON_INDEX[method],
                "method": method,
                "checkpoints": checkpoints,
                **figures,
                "lds_spread": spread(draws, "lds"),
                "centred_lds_spread": spread(draws, "centred_lds"),
                "draws": draws,
                "wall_s": [sum(r[c]["wall_s"] for c in runs) for r in ran],
                "commands": [ran[0][c]["command"] for c in runs],
            }
            print(
                f"{name}: bergson {method} ({checkpoints}), {args.repeats} runs: {json.dumps({k: round(v, 3) for k, v in figures.items()})}",
                flush=True,
            )
    measured["gradian"] = gradian_figures(result)
    measured["gradian_result_command"] = result["command"]
    return measured


def spread(draws: List[Dict[str, float]], key: str) -> float:
    """max - min of `key` over the repeats."""
    return float(max(d[key] for d in draws) - min(d[key] for d in draws))


def spread_cell(entry: Dict[str, Any], centred: bool) -> str:
    """The spread of the LDS the set is read by, over bergson's runs or gradian's projection seeds."""
    value = entry.get("centred_lds_spread" if centred else "lds_spread")
    return "" if value is None else f"{value:.3f}"


def fmt(value: Optional[float], error: Optional[float] = None) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "n/a"
    return f"{value:+.3f}" + (f" ± {error:.3f}" if error is not None else "")


METHOD_NAMES = {"ekfac": "EK-FAC", "trackstar": "TrackStar", "trackstar-cosine": "TrackStar, unit_normalize"}
BERGSON_INDEX = {"ekfac": "full-space", "trackstar": "projected 16 a side", "trackstar-cosine": "projected 16 a side"}
# Which gradian row each bergson checkpoint choice is set beside in the ratios.
PAIRS = (("ft", "gradian defaults, ft alone"), ("base+ft", "gradian defaults (base + ft)"))


def bergson_label(method: str, checkpoints: str) -> str:
    which = "ft" if checkpoints == "ft" else "base + ft: two runs, scores summed"
    return f"bergson {METHOD_NAMES[method]} ({which})"


def tables(per_set: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One table of every set's rows, then the gradian / bergson ratios of raw (centred for `shared`) LDS."""
    header = ["set", "scorer", "index", "raw LDS", "centred LDS", "R@10", "MRR", "LDS spread (runs / seeds)"]
    rows = []
    for name, m in per_set.items():
        entries = [
            *m["methods"].values(),
            *m["gradian"],
        ]
        for e in entries:
            raw = "(ceiling ~0)" if name in CENTRED_ONLY else fmt(e.get("lds"), e.get("standard_error"))
            rows.append(
                [
                    name,
                    e["label"],
                    e["index"],
                    raw,
                    fmt(e.get("centred_lds"), e.get("centred_standard_error")),
                    f"{e['recall@10']:.2f}" if "recall@10" in e else "",
                    f"{e['mrr']:.2f}" if "mrr" in e else "",
                    spread_cell(e, name in CENTRED_ONLY),
                ]
            )
    out = [{"header": header, "rows": rows}]
    ratio_rows = []
    methods = sorted({v["method"] for m in per_set.values() for v in m["methods"].values()}, key=METHODS.index)
    for name, m in per_set.items():
        key = "centred_lds" if name in CENTRED_ONLY else "lds"
        gradian = {g["label"]: g[key] for g in m["gradian"]}
        for checkpoints, label in PAIRS:
            ratio_rows.append(
                [
                    name,
                    "centred" if name in CENTRED_ONLY else "raw",
                    label,
                    *(ratio(gradian[label], m["methods"][f"{k}@{checkpoints}"][key]) for k in methods),
                ]
            )
    out.append(
        {
            "title": "gradian / bergson, LDS (raw; centred on `shared`), each gradian row over bergson on the same checkpoints:",
            "header": ["set", "LDS", "gradian row", *(f"/ bergson {METHOD_NAMES[k]}" for k in methods)],
            "rows": ratio_rows,
        }
    )
    return out


def ratio(a: float, b: float) -> str:
    """a / b, or why not: a ratio of a figure over one at or below 0 says nothing."""
    if b <= 0:
        return f"n/a (bergson {b:+.3f})"
    return f"{a / b:.2f}"


def caption(version: str, commit: str, repeats: int) -> str:
    """What the result file's tables measured."""
    return (
        f"bergson {version} (its own virtualenv, CLI at its defaults but for the matched settings below) against gradian at commit {commit}, "
        "on the LDS sets of benchmarks/studies/lds_sets, every figure measured with gradian's own functions (common.lds_figures, common.retrieval) "
        "on the same retrained half-subsets (M = 24 × 2 repeats) and planted sources. bergson's EK-FAC and TrackStar take one model: "
        'each ran on the fine-tuned model (`ft`) and on the base, and its "base + ft" rows are the two runs\' raw scores summed by this script '
        "(beside gradian's default query.checkpoints=all). Both tools score the same tokens with the same supervised positions "
        "(completion + EOS; checked row by row through bergson's own data pipeline) on the same modules (every layer's MLP), loss summed over them. "
        "EK-FAC: `bergson ekfac --method kfac --hessian_cfg.ev_correction true` (full-space query and training gradients); TrackStar: `bergson trackstar` "
        "at its defaults (projection 16 a side, mixed Hessians, inner product) and with `--unit_normalize true` (the paper's cosine). "
        f"bergson's figures are means over {repeats} fresh runs (its Fisher samples labels, unseeded), the spread max - min over them; "
        "gradian's rows are from each set's result.json (projected k32-int8, 3 projection seeds averaged, spread over the seeds; "
        "exact = projection_dim null). ± is the standard error over queries. `shared` is read by centred LDS only (its raw noise ceiling is ~0)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=SETS)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="fresh bergson runs a method and model, figures averaged (its Fisher samples labels unseeded; default 3)",
    )
    parser.add_argument("--lds-root", default=str(LDS_ROOT), help="where the LDS sets' work folders are (read only)")
    parser.add_argument("--work", default=str(WORK), help="bergson's work folders (one a set)")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS for bergson (default 1: the machine is shared)"
    )
    parser.add_argument("--venv", default=str(VENV))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    version = ensure_venv(Path(args.venv))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": str(args.threads),
    }
    env.pop("PYTHONPATH", None)  # bergson's interpreter must not see this checkout
    import torch

    torch.set_num_threads(args.threads)
    commit = gradian_commit()
    per_set = {name: measure_set(name, args, env) for name in args.sets}
    text = caption(version, commit, args.repeats)
    write_result(
        "peer_bergson_quality",
        text,
        tables(per_set),
        args.out,
        bergson=version,
        gradian_commit=commit,
        sets=per_set,
    )


if __name__ == "__main__":
    main()
