"""Issue 21's peer, side by side: Kronfluence's EK-FAC influence against gradian's defaults and exact
unprojected gradients, on the same LDS set, model and retrained subsets, in one run.

    PYTHONPATH=. python benchmarks/peer_kronfluence.py --kind fact --runs /tmp/gradian-lds

Needs the `bench` extra (kronfluence) and the retrained subsets that `benchmarks/lds_grid.py` (or
`gradian validate` with its settings) left in RUNS/<kind>-runs. Each method runs in its own fresh
process (`--method`), so that its wall time and peak RSS are its own:
  gradian   `gradian index` + `gradian query query.top_k=all` at the defaults (MLP modules, k = 16,
            precondition auto), on SmolLM2 as built;
  exact     unprojected per-module cosine of the MLP modules' gradients (lds_grid.exact);
  ekfac     Kronfluence 1.0: EK-FAC factors fitted on the 80 training rows, pairwise influence
            scores of the same MLP modules (the summed supervised-token loss as both the training
            loss and the measurement; true Fisher by sampling labels from the model), damping
            Kronfluence's default (heuristic: 0.1 × mean eigenvalue).
Each method's scores give LDS (against the subsets' measured -loss) and planted-source MRR.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.lds_grid import DATA, RESULTS, SMOLLM2, exact, lds_set, mrr, retrained, settings
from gradian_lightning.config import load_config
from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.loss import supervised_token_loss
from gradian_lightning.hub import load_model_and_tokenizer, pad_token_id
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.query import score_matrix
from gradian_lightning.validation.lds import linear_datamodeling_score, mean_and_standard_error


def gradian_scores(kind: str, runs: Path) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = settings(kind, runs, **{"index.path": f"{tmp}/ix"})
        run_index(load_config(None, overrides))
        train, queries = read_jsonl(DATA / f"{kind}.train.jsonl"), read_jsonl(DATA / f"{kind}.queries.jsonl")
        return score_matrix(load_config(None, overrides + ["query.top_k=all"]), len(queries), len(train))


def ekfac_scores(kind: str) -> np.ndarray:
    from gradian_lightning.extras import require_extra

    require_extra("kronfluence", "bench", "benchmarks/peer_kronfluence.py")
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task
    from kronfluence.utils.dataset import DataLoaderKwargs

    cfg = load_config(None, [f"model.name_or_path={SMOLLM2}"])
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    names = list(select_modules(model, list(cfg.grads.module_filter)))

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
    train, queries = (
        dataset(read_jsonl(DATA / f"{kind}.train.jsonl")),
        dataset(read_jsonl(DATA / f"{kind}.queries.jsonl")),
    )
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


def one_method(method: str, kind: str, runs: Path) -> None:
    started = time.perf_counter()
    if method == "gradian":
        scores = gradian_scores(kind, runs)
    elif method == "exact":
        scores = exact(SMOLLM2, read_jsonl(DATA / f"{kind}.train.jsonl"), read_jsonl(DATA / f"{kind}.queries.jsonl"))[
            "exact module cosine"
        ]
    else:
        scores = ekfac_scores(kind)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"scores": scores.tolist(), "seconds": seconds, "peak_rss": peak}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="fact")
    parser.add_argument("--runs", default="/tmp/gradian-lds")
    parser.add_argument("--method", choices=("gradian", "exact", "ekfac"))
    parser.add_argument(
        "--methods",
        nargs="*",
        default=["gradian", "exact", "ekfac"],
        help="re-measure these; the others are kept from the saved table",
    )
    args = parser.parse_args()
    runs = Path(args.runs)
    if args.method:
        one_method(args.method, args.kind, runs)
        return
    train, queries, sources = lds_set(args.kind)
    subsets, outputs = retrained(runs, args.kind)
    saved = RESULTS / f"peer_kronfluence.{args.kind}.json"
    table = json.loads(saved.read_text()) if saved.is_file() else {}
    for method in args.methods:
        done = subprocess.run(
            [sys.executable, __file__, "--method", method, "--kind", args.kind, "--runs", str(runs)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            sys.exit(f"{method} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        scores = np.asarray(result["scores"])
        lds, error = mean_and_standard_error(linear_datamodeling_score(scores, subsets, outputs))
        table[method] = {
            "lds": lds,
            "lds_se": error,
            "mrr": mrr(scores, sources),
            "seconds": result["seconds"],
            "peak_rss_mib": result["peak_rss"] / 2**20,
        }
        print(method, table[method], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"peer_kronfluence.{args.kind}.json").write_text(json.dumps(table, indent=1))
    print("| method | LDS ± se | MRR | wall time (s) | peak RSS (MiB) |\n|---|---|---|---|---|")
    for method, row in table.items():
        print(
            f"| {method} | {row['lds']:+.3f} ± {row['lds_se']:.3f} | {row['mrr']:.3f} | {row['seconds']:.0f} | {row['peak_rss_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
