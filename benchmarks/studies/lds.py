"""The default score by counterfactual LDS and planted-source MRR together, against exact
unprojected gradients, over projection seeds: on the LDS sets (benchmarks/lds_data/: 80 rows, 24
queries each, every query naming its planted sources), SmolLM2-135M pretrained and fine-tuned.

    PYTHONPATH=. python -m benchmarks.studies.lds --seeds 0 1 2 3 4                       # -> lds_results/seeds.<kind>.json
    PYTHONPATH=. python -m benchmarks.studies.lds --seeds 0 1 2 3 4 --projection-dim 32   # -> lds_results/seeds.k32-<kind>.json
    PYTHONPATH=. python -m benchmarks.studies.lds --smoke --out /tmp/x                    # a tiny model, seconds

Through the product: `gradian index` builds each index, `gradian validate` retrains the half-subsets
once per set (RUNS/<kind>-runs, shared by every case and seed), `gradian query` scores. Cases:
  pretrained           the index of the model as built (what the subsets are fine-tuned from);
  fine-tuned, base+ft  the model fine-tuned on all rows with validate's recipe, indexed as
                       model.checkpoints=[base, ft] and summed over both (the default query.checkpoints);
  fine-tuned, ft       the same index scored at the newest checkpoint alone.
Each seed (`grads.seed`, the Kronecker projection's draw, nothing else) gets its own indexes. Exact:
unprojected per-module cosine of the MLP modules' gradients (reference.py), which has no seed.
Resumable: a (seed, case, scorer) already in the result file is not scored again.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import torch

from benchmarks.studies.reference import (
    DATA,
    KINDS,
    RESULTS,
    SMOLLM2,
    exact_scores,
    lds,
    lds_set,
    mean_and_se,
    mrr,
    product_scores,
    retrained,
)
from gradian_lightning.config import load_config
from gradian_lightning.data import read_jsonl
from gradian_lightning.index.layout import stored_meta
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.validate import run_validate
from gradian_lightning.validation.retrain import FineTune, fine_tune

SCORERS: Dict[str, List[str]] = {  # name -> query.* overrides
    "defaults (auto)": [],
    "none": ["query.precondition=none"],
    "diag": ["query.precondition=diag"],
    "fisher": ["query.precondition=fisher"],
    "ekfac": ["query.precondition=ekfac"],
    "row cosine": ["query.normalize=row"],
    "inner": ["query.score=inner"],
}
CASES = ("pretrained", "fine-tuned, base+ft", "fine-tuned, ft")
MLP = ("gate_proj", "up_proj", "down_proj")


def settings(kind: str, where: Dict[str, Path], **more: str) -> List[str]:
    """The overrides every command of a set shares: model, data, validate's subsets."""
    base = {
        "model.name_or_path": str(where["model"]),
        "data.train": str(where["data"] / f"{kind}.train.jsonl"),
        "query.data": str(where["data"] / f"{kind}.queries.jsonl"),
        "trainer.accelerator": "cpu",
        "trainer.enable_progress_bar": "false",
        "query.method": "index",  # this study is of the stored rows, not the exact pass auto runs on small sets
        "grads.batch_size": "8",
        "grads.max_seq_length": "64",
        "validate.num_subsets": str(where["subsets"]),
        "validate.epochs": str(where["epochs"]),
        "validate.output": str(where["runs"] / f"{kind}-runs"),
        **more,
    }
    return [f"{k}={v}" for k, v in base.items()]


def finetuned(kind: str, where: Dict[str, Path]) -> Path:
    """The model fine-tuned on all of the set's rows with validate's recipe (saved once)."""
    out = where["runs"] / f"{kind}-ft"
    if not (out / "config.json").is_file():
        from gradian_lightning.hub import load_model_and_tokenizer

        cfg = load_config(None, settings(kind, where))
        model, tokenizer = load_model_and_tokenizer(cfg.model)
        v = cfg.validate
        task = FineTune(model.train(), v.learning_rate)
        fine_tune(task, read_jsonl(cfg.data.train), tokenizer, 64, v.batch_size, v.epochs, 0, {"accelerator": "cpu"})
        model.eval().save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


def case_settings(kind: str, where: Dict[str, Path], seed: int, dim: int) -> Dict[str, List[str]]:
    """Each case's overrides at projection seed `seed` and k = `dim`, building its indexes if missing."""
    index = lambda name: where["runs"] / f"k{dim}-s{seed}-{name}"  # noqa: E731
    more = {"grads.seed": str(seed), "grads.projection_dim": str(dim)}
    pre = settings(kind, where, **{"index.path": str(index(f"{kind}-pre")), **more})
    checkpoints = f"[{where['model']},{finetuned(kind, where)}]"
    tuned = settings(kind, where, **{"index.path": str(index(f"{kind}-ft")), "model.checkpoints": checkpoints, **more})
    for overrides in (pre, tuned):
        cfg = load_config(None, overrides)
        if stored_meta(str(cfg.index.path)) is None:
            run_index(cfg)
    return {CASES[0]: pre, CASES[1]: tuned, CASES[2]: tuned + ["query.checkpoints=last"]}


def exact_cells(kind: str, where: Dict[str, Path]) -> Dict[str, np.ndarray]:
    """Exact per-module cosine [Q, N] per case (base+ft: the sum of the two models' scores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, queries, _ = lds_set(kind, where["data"])
    scores = {}
    for which, path in (("base", where["model"]), ("ft", finetuned(kind, where))):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        scores[which] = exact_scores(model, tokenizer, train, queries, MLP)["exact module cosine"]
    return {CASES[0]: scores["base"], CASES[1]: scores["base"] + scores["ft"], CASES[2]: scores["ft"]}


def subsets(kind: str, where: Dict[str, Path]):
    """(subsets bool [M, N], outputs [M, Q]) of the set's retrained half-subsets, which `gradian
    validate` trains into RUNS/<kind>-runs the first time."""
    if not (where["runs"] / f"{kind}-runs" / "plan.json").is_file():
        cfg = load_config(None, settings(kind, where, **{"index.path": str(where["runs"] / f"{kind}-validate")}))
        if stored_meta(str(cfg.index.path)) is None:
            run_index(cfg)  # validate scores the defaults on their own index
        run_validate(cfg)
    return retrained(where["runs"] / f"{kind}-runs")


def study_set(smoke: bool, runs: Path, tmp: str) -> Dict:
    """Where a study's model, data and runs are: SmolLM2 on the LDS sets, or with `smoke` a tiny
    random Llama on 16 rows of the fact set, 5 subsets of 1 epoch, all in `tmp`."""
    if not smoke:
        return {"model": SMOLLM2, "data": DATA, "runs": runs, "subsets": 24, "epochs": 2}
    where = {"model": Path(tmp) / "model", "data": Path(tmp) / "data", "runs": Path(tmp), "subsets": 5, "epochs": 1}
    smoke_set(where)
    return where


def run_kind(kind: str, where: Dict[str, Path], seeds: Sequence[int], dim: int, scorers: Sequence[str], path: Path):
    train, queries, sources = lds_set(kind, where["data"])
    result: Dict = json.loads(path.read_text()) if path.is_file() else {"kind": kind, "seeds": {}}
    chosen, outputs = subsets(kind, where)
    result.update(rows=len(train), queries=len(queries), subsets=int(chosen.shape[0]), projection_dim=dim)
    result["exact"] = {
        case: {"per_query": lds(scores, chosen, outputs).tolist(), "mrr": mrr(scores, sources)}
        for case, scores in exact_cells(kind, where).items()
    }
    for seed in seeds:
        done = result["seeds"].setdefault(str(seed), {})
        for case, overrides in case_settings(kind, where, seed, dim).items():
            for name in scorers:
                if name in done.get(case, {}):
                    continue
                started = time.perf_counter()
                scores = product_scores(load_config(None, overrides + SCORERS[name]))
                per_query = lds(scores, chosen, outputs)
                done.setdefault(case, {})[name] = {"per_query": per_query.tolist(), "mrr": mrr(scores, sources)}
                print(kind, f"seed {seed}", case, name, f"LDS {per_query.mean():+.3f}", f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=1) + "\n")  # after each cell: a killed run keeps the rest
    return result


def report(results: Sequence[Dict]) -> str:
    """Per set and case: exact's LDS, and per k and scorer the LDS at each seed, their mean, and the
    seed-averaged per-query LDS minus exact's, paired by query (mean ± standard error)."""
    lines = [
        "| set, case | scorer | LDS per seed | mean over seeds | minus exact (paired, seed-averaged) | MRR (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for kind in dict.fromkeys(r["kind"] for r in results):
        mine = [r for r in results if r["kind"] == kind]
        for case in CASES:
            ex = mine[0]["exact"][case]
            exact_lds = np.asarray(ex["per_query"])
            lines.append(
                f"| {kind}, {case} | exact per-module cosine | | {exact_lds.mean():+.3f} | | {ex['mrr']:.3f} |"
            )
            for result in mine:
                for name in SCORERS:
                    cells = [c[case][name] for c in result["seeds"].values() if name in c.get(case, {})]
                    if not cells:
                        continue
                    per_seed = [float(np.mean(c["per_query"])) for c in cells]
                    diff, error = mean_and_se(np.mean([c["per_query"] for c in cells], axis=0) - exact_lds)
                    lines.append(
                        f"| {kind}, {case} | k = {result.get('projection_dim', 16)}, {name} "
                        f"| {' '.join(f'{x:.3f}' for x in per_seed)} | {np.mean(per_seed):+.3f} "
                        f"| {diff:+.3f} ± {error:.3f} | {np.mean([c['mrr'] for c in cells]):.3f} |"
                    )
    return "\n".join(lines)


def saved_results(dims: Sequence[int] = (16, 32)) -> List[Dict]:
    """The result files RANKING.md's table is rendered from, k = 16 before k = 32 within each set."""
    paths = [RESULTS / (f"seeds.{k}.json" if d == 16 else f"seeds.k{d}-{k}.json") for k in KINDS for d in dims]
    return [json.loads(p.read_text()) for p in paths if p.is_file()]


def smoke_set(where: Dict[str, Path]) -> None:
    """A tiny random Llama with a word tokenizer and 16 rows / 3 queries of the fact set, in `where`."""
    from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer

    train, queries, _ = lds_set("fact")
    queries = queries[:3]
    wanted = {s for q in queries for s in q["sources"]}
    train = [r for r in train if r["id"] in wanted] + [r for r in train if r["id"] not in wanted][: 16 - len(wanted)]
    where["data"].mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("queries", queries)):
        (where["data"] / f"fact.{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = word_tokenizer(json.dumps(r) for r in train + queries)
    model = tiny_llama(len(tokenizer), hidden=32, seed=0)
    model.save_pretrained(where["model"])
    tokenizer.save_pretrained(where["model"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--runs", type=Path, default=Path("/tmp/gradian-lds"), help="indexes, fine-tunes, subsets")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--projection-dim", type=int, default=16)
    parser.add_argument("--scorers", nargs="+", default=list(SCORERS), choices=list(SCORERS))
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on 16 rows, 4 subsets: seconds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON results go")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        where = {"model": SMOLLM2, "data": DATA, "runs": args.runs, "subsets": 24, "epochs": 2}
        kinds = args.kinds
        if args.smoke:
            where = {
                "model": Path(tmp) / "model",
                "data": Path(tmp) / "data",
                "runs": Path(tmp),
                "subsets": 5,
                "epochs": 1,
            }
            smoke_set(where)
            kinds = ["fact"]
        results = []
        for kind in kinds:
            name = f"seeds.{kind}.json" if args.projection_dim == 16 else f"seeds.k{args.projection_dim}-{kind}.json"
            results.append(run_kind(kind, where, args.seeds, args.projection_dim, args.scorers, args.out / name))
    print(report(results))


if __name__ == "__main__":
    main()
