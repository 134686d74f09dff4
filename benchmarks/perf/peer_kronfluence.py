"""Issue 21's peer, side by side: Kronfluence's EK-FAC influence against gradian's defaults and exact
unprojected gradients, on the same LDS set, model and retrained subsets, in one run.

    PYTHONPATH=. python -m benchmarks.perf.peer_kronfluence --kind fact --runs /tmp/gradian-lds
    PYTHONPATH=. python -m benchmarks.perf.peer_kronfluence --smoke --out /tmp/x   # tiny model; ekfac only with kronfluence

Needs kronfluence (installed without its dependencies: see RESULTS.md) and the retrained subsets of
benchmarks/studies/lds.py in RUNS/<kind>-runs (trained there if missing). Each method runs in its own fresh
process (`--method`), so that its wall time and peak RSS are its own:
  gradian   `gradian index` + `gradian query query.top_k=all` at the defaults (MLP modules, k = 16,
            precondition auto), on SmolLM2 as built;
  exact     unprojected per-module cosine of the MLP modules' gradients (studies/reference.py);
  ekfac     Kronfluence 1.0: EK-FAC factors fitted on the 80 training rows, pairwise influence
            scores of the same MLP modules (the summed supervised-token loss as both the training
            loss and the measurement; true Fisher by sampling labels from the model), damping
            Kronfluence's default (heuristic: 0.1 × mean eigenvalue).
Each method's scores give LDS (against the subsets' measured -loss) and planted-source MRR.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Dict

import numpy as np
import torch

from benchmarks.studies.lds import MLP, settings, study_set, subsets
from benchmarks.studies.reference import RESULTS, exact_scores, lds, lds_set, mean_and_se, mrr, product_scores
from gradian_lightning.config import load_config
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.gradients.loss import supervised_token_loss
from gradian_lightning.hub import load_model_and_tokenizer, pad_token_id
from gradian_lightning.recipes.index import run_index

METHODS = ("gradian", "exact", "ekfac")


def gradian_scores(kind: str, where: Dict) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = settings(kind, where, **{"index.path": f"{tmp}/ix"})
        run_index(load_config(None, overrides))
        train, queries, _ = lds_set(kind, where["data"])
        return product_scores(load_config(None, overrides))


def ekfac_scores(kind: str, where: Dict) -> np.ndarray:
    from gradian_lightning.extras import require_extra

    require_extra("kronfluence", "bench", "benchmarks/peer_kronfluence.py")
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task
    from kronfluence.utils.dataset import DataLoaderKwargs

    cfg = load_config(None, [f"model.name_or_path={where['model']}"])
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(MLP)]

    class SupervisedTokens(Task):
        def compute_train_loss(self, batch, model, sample=False):
            if not sample:
                return supervised_token_loss(model, batch).sum()
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
            keep = batch["labels"][:, 1:] != -100
            with torch.no_grad():
                sampled = torch.distributions.Categorical(logits=logits[keep]).sample()
            return torch.nn.functional.cross_entropy(logits[keep], sampled, reduction="sum")

        def compute_measurement(self, batch, model):
            return supervised_token_loss(model, batch).sum()

        def get_influence_tracked_modules(self):
            return names

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    def dataset(rows):
        examples = JsonlDataset(rows, tokenizer, 64).examples
        return examples

    task = SupervisedTokens()
    model = prepare_model(model, task)
    train_rows, query_rows, _ = lds_set(kind, where["data"])
    train, queries = dataset(train_rows), dataset(query_rows)
    batches = partial(collate, pad_token_id=pad_token_id(tokenizer))

    def tensors_only(examples):
        return {k: v for k, v in batches(examples).items() if isinstance(v, torch.Tensor)}

    with tempfile.TemporaryDirectory() as tmp:
        analyzer = Analyzer(analysis_name=kind, model=model, task=task, cpu=True, output_dir=tmp, disable_tqdm=True)
        analyzer.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=tensors_only))
        analyzer.fit_all_factors(
            "ekfac",
            dataset=train,
            per_device_batch_size=8,
            factor_args=FactorArguments(strategy="ekfac"),
            overwrite_output_dir=True,
        )
        analyzer.compute_pairwise_scores(
            "scores",
            "ekfac",
            query_dataset=queries,
            train_dataset=train,
            per_device_query_batch_size=8,
            per_device_train_batch_size=8,
            overwrite_output_dir=True,
        )
        # Kronfluence's pairwise score is the query gradient times the preconditioned training
        # gradient: positive where up-weighting the row lowers the query's loss, as gradian's.
        return analyzer.load_pairwise_scores("scores")["all_modules"].double().numpy()


def one_method(method: str, kind: str, where: Dict) -> None:
    started = time.perf_counter()
    if method == "gradian":
        scores = gradian_scores(kind, where)
    elif method == "exact":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(where["model"]), dtype=torch.float32).eval()
        train, queries, _ = lds_set(kind, where["data"])
        tokenizer = AutoTokenizer.from_pretrained(str(where["model"]))
        scores = exact_scores(model, tokenizer, train, queries, MLP)["exact module cosine"]
    else:
        scores = ekfac_scores(kind, where)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"scores": scores.tolist(), "seconds": seconds, "peak_rss": peak}))


def report(table: Dict[str, Dict]) -> str:
    """The side-by-side table of one set's result file."""
    lines = ["| method | LDS ± se | MRR | wall time (s) | peak RSS (MiB) |", "|---|---|---|---|---|"]
    for method, row in table.items():
        lines.append(
            f"| {method} | {row['lds']:+.3f} ± {row['lds_se']:.3f} | {row['mrr']:.3f} | {row['seconds']:.0f} | {row['peak_rss_mib']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="fact")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/gradian-lds"))
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)  # the parent's model, data and runs, as JSON
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help="re-measure these; the others are kept")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny model on 16 rows; ekfac only if kronfluence is installed"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.method:
        where = {k: Path(v) if k in ("model", "data", "runs") else v for k, v in json.loads(args.where).items()}
        return one_method(args.method, args.kind, where)
    with tempfile.TemporaryDirectory() as tmp:
        where = study_set(args.smoke, args.runs, tmp)
        kind = "fact" if args.smoke else args.kind
        methods = args.methods
        if args.smoke and importlib.util.find_spec("kronfluence") is None:
            print("kronfluence is not installed: the smoke run measures gradian and exact only")
            methods = [m for m in methods if m != "ekfac"]
        _, _, sources = lds_set(kind, where["data"])
        chosen, outputs = subsets(kind, where)
        saved = args.out / f"peer_kronfluence.{kind}.json"
        table = json.loads(saved.read_text()) if saved.is_file() else {}
        for method in methods:
            child = [sys.executable, "-m", "benchmarks.perf.peer_kronfluence", "--method", method, "--kind", kind]
            done = subprocess.run(
                [*child, "--where", json.dumps({k: str(v) for k, v in where.items()})], capture_output=True, text=True
            )
            if done.returncode != 0:
                sys.exit(f"{method} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            scores = np.asarray(result["scores"])
            mean, error = mean_and_se(lds(scores, chosen, outputs))
            table[method] = {
                "lds": mean,
                "lds_se": error,
                "mrr": mrr(scores, sources),
                "seconds": result["seconds"],
                "peak_rss_mib": result["peak_rss"] / 2**20,
            }
            print(method, table[method], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(table, indent=1) + "\n")
    print(report(table))


if __name__ == "__main__":
    main()
