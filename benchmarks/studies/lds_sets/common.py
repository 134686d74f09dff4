"""What every LDS set shares: its base and fine-tuned models, its indexes, `gradian validate`'s
retrained subsets and the scorers measured on them, planted-source retrieval and a BM25 baseline.

Everything goes through the product: `run_index` builds the indexes (projected in each of
FORMATS, with `grads.seed` 0, 1, 2, ...; and exact, `projection_dim=null`, the reference),
`run_validate` retrains the subsets once (kept in WORK/runs, so a killed run resumes there) and
scores each index's scorers, `reference.product_scores` gives the scores retrieval is measured
on. Each index holds the base and the fine-tuned model as `model.checkpoints=[base, ft]` (steps
0 and 1): `query.checkpoints=all` is base + ft (today's default), `last` the fine-tune alone,
`[0]` the base alone.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from benchmarks.studies.reference import product_scores
from gradian_lightning.config import load_config
from gradian_lightning.hub import load_model_and_tokenizer
from gradian_lightning.index.layout import stored_meta
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer
from gradian_lightning.recipes.validate import run_validate, scorer_name
from gradian_lightning.validation.lds import (
    linear_datamodeling_score,
    mean_and_standard_error,
    retraining_ceiling,
    shared_variance_share,
)
from gradian_lightning.validation.retrain import FineTune, fine_tune
from gradian_lightning.validation.subsets import SubsetRuns, write_json_atomically

SMOLLM2 = Path.home() / ".cache" / "gradian" / "smollm2-135m-instruct"
# On the projected index. Today's default first: precondition auto, per-module cosine, base + ft.
PROJECTED: List[Dict[str, Any]] = [
    {},  # the defaults of the code that ran (query/precondition.py: `auto` for both)
    {"checkpoints": "last"},
    {"checkpoints": [0]},
    # Each preconditioner with the per-module cosine, the defaults' normalisation before issue 29.
    *({"precondition": p, "normalize": "module"} for p in ("none", "diag", "ekfac", "fisher")),
    {"normalize": "module"},
    {"precondition": "fisher", "normalize": "module", "checkpoints": "last"},
    {"score": "inner"},
    {"score": "inner", "precondition": "none"},
    {"score": "inner", "precondition": "none", "checkpoints": "last"},
    {"normalize": "row"},
    {"normalize": "row", "precondition": "none"},
    # The candidates for issue 29's defaults: the two preconditioners `auto` chooses between, each
    # with a whole-row cosine; the fine-tune alone, whose 5-seed spread the issue asks to halve; and
    # the Fisher's inner product, the influence-style score without any normalisation.
    {"precondition": "fisher", "normalize": "row"},
    {"precondition": "ekfac", "normalize": "row"},
    {"normalize": "row", "checkpoints": "last"},
    {"precondition": "none", "normalize": "row", "checkpoints": "last"},
    {"precondition": "fisher", "score": "inner"},
]
# The projected index formats measured on the same retrained subsets: issue 29's candidates at
# up to 2x the bytes of k = 16 in float16 (benchmarks/studies/index_format).
FORMATS: Dict[str, Dict[str, str]] = {
    "k16-float16": {"grads.projection_dim": "16", "grads.storage_dtype": "float16"},
    "k32-int8": {"grads.projection_dim": "32", "grads.storage_dtype": "int8"},
}
# On the exact index (projection_dim=null): the reference, unpreconditioned.
EXACT: List[Dict[str, Any]] = [
    {"precondition": "none", **s, **c}
    for c in ({}, {"checkpoints": "last"})
    for s in ({"score": "inner"}, {"normalize": "row"}, {"normalize": "module"})
]


@dataclass
class SetSpec:
    """One LDS set's sizes and training recipe."""

    kind: str
    rows: int
    queries: int = 24
    base_rows: int = 1024  # disjoint rows the tiny base is trained on first (0: a pretrained base)
    base_epochs: int = 12
    num_subsets: int = 24
    repeats: int = 2
    epochs: int = 4
    learning_rate: float = 3e-3
    batch_size: int = 16
    max_seq_length: int = 40
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])  # projection draws
    formats: List[str] = field(default_factory=lambda: list(FORMATS))  # keys of FORMATS
    # scorers (query.* overrides) scored beside PROJECTED on each projected index: a rescoring of
    # the same indexes and retrained subsets, e.g. a query.damping sweep
    extra_scorers: List[Dict[str, Any]] = field(default_factory=list)
    base: Optional[str] = None  # a pretrained base (SmolLM2) instead of a tiny one
    exact_filter: Optional[List[str]] = None  # exact index on fewer modules (SmolLM2's MLP is 885 K values a module)
    seed: int = 0
    variant: str = ""  # a suffix of the name when the recipe differs from the kind's own

    @property
    def name(self) -> str:
        return f"{self.kind}-N{self.rows}{self.variant}"


def settings(spec: SetSpec, work: Path, base: Path, ft: Path, **more: Any) -> List[str]:
    """The `key=value` settings of this set's indexes and validation."""
    values = {
        "model.name_or_path": str(base),
        "model.checkpoints": f"[{base},{ft}]",
        "data.train": str(work / "train.jsonl"),
        "query.data": str(work / "queries.jsonl"),
        "trainer.accelerator": "cpu",
        "trainer.enable_progress_bar": "false",
        "grads.batch_size": "16",
        "grads.max_seq_length": str(spec.max_seq_length),
        "validate.num_subsets": str(spec.num_subsets),
        "validate.repeats": str(spec.repeats),
        "validate.epochs": str(spec.epochs),
        "validate.learning_rate": str(spec.learning_rate),
        "validate.batch_size": str(spec.batch_size),
        "validate.seed": str(spec.seed),
        "validate.output": str(work / "runs"),
        # The scorers here are of the stored rows (projected or exact, unprojected): query.method=auto
        # would run the full-space exact pass instead on sets this small (trajectory.py measures it).
        "query.method": "index",
        **more,
    }
    return [f"{k}={v}" for k, v in values.items()]


def write_rows(path: Path, rows: List[Dict]) -> None:
    """Rows as JSONL, only when they differ from what is there (the data's hash keys the runs)."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def train_and_save(spec: SetSpec, model: Any, tokenizer: Any, rows: List[Dict], epochs: int, out: Path) -> Path:
    """`model` trained on `rows` with validate's recipe (FineTune: AdamW at the set's rate, its
    batch size, shuffled by its seed), saved with `tokenizer` as a Hugging Face directory at `out`."""
    fine_tune(
        FineTune(model.train(), spec.learning_rate),
        rows,
        tokenizer,
        spec.max_seq_length,
        spec.batch_size,
        epochs,
        spec.seed,
        {"accelerator": "cpu", "devices": 1},
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_base(spec: SetSpec, work: Path, texts: List[str], base_rows: List[Dict]) -> Path:
    """The quickstart's model (word-level tokenizer over every text of the set, random-init small
    Llama) trained on the disjoint base rows, saved once as a Hugging Face directory."""
    out = work / "base"
    if (out / "config.json").is_file():
        return out
    tokenizer = word_tokenizer(texts)
    return train_and_save(spec, tiny_llama(len(tokenizer), seed=spec.seed), tokenizer, base_rows, spec.base_epochs, out)


def fine_tuned(spec: SetSpec, work: Path, base: Path, train: List[Dict]) -> Path:
    """The base fine-tuned on every row with validate's recipe (what the index is of), saved once."""
    out = work / "ft"
    if (out / "config.json").is_file():
        return out
    model, tokenizer = load_model_and_tokenizer(load_config(None, [f"model.name_or_path={base}"]).model)
    return train_and_save(spec, model, tokenizer, train, spec.epochs, out)


def index(args: List[str], path: Path, **more: str) -> Path:
    """The index at `path`, built once with `args` and `more` (a `.done` file beside it says it finished)."""
    done = path.with_name(path.name + ".done")
    if stored_meta(str(path)) is None or not done.exists():
        shutil.rmtree(path, ignore_errors=True)
        run_index(load_config(None, args + [f"index.path={path}"] + [f"{k}={v}" for k, v in more.items()]))
        done.touch()
    return path


def tokens(text: str) -> List[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def bm25(train: List[Dict], queries: List[Dict], k1: float = 1.5, b: float = 0.75) -> np.ndarray:
    """Okapi BM25 of each query's prompt + completion words against each row's: float64 [Q, N]."""
    docs = [Counter(tokens(r["prompt"] + r["completion"])) for r in train]
    lengths = np.array([sum(d.values()) for d in docs], dtype=np.float64)
    frequency = Counter(w for d in docs for w in d)
    n = len(docs)
    scores = np.zeros((len(queries), n))
    for q, query in enumerate(queries):
        for word in set(tokens(query["prompt"] + query["completion"])):
            if word not in frequency:
                continue
            idf = math.log(1 + (n - frequency[word] + 0.5) / (frequency[word] + 0.5))
            tf = np.array([d[word] for d in docs], dtype=np.float64)
            scores[q] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths / lengths.mean()))
    return scores


def retrieval(scores: np.ndarray, sources: List[List[int]]) -> Dict[str, float]:
    """recall@10 (the share of a query's sources in its top 10, out of min(10, its sources); for one
    source, whether it is there) and MRR of the first source, means over queries."""
    recall, reciprocal = [], []
    for q, src in enumerate(sources):
        order = np.argsort(-scores[q], kind="stable")
        top = set(order[:10].tolist())
        recall.append(len(top & set(src)) / min(10, len(src)))
        reciprocal.append(1.0 / (1 + int(np.flatnonzero(np.isin(order, src))[0])))
    return {"recall@10": float(np.mean(recall)), "mrr": float(np.mean(reciprocal))}


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Optional[Tuple[float, float]]:
    """Mean and standard error over queries of per-query LDS `a` minus `b` (queries where either is
    undefined left out), the same queries and retrained subsets on both sides; None under 2 queries."""
    mean, error = mean_and_standard_error(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    return (mean, error) if np.isfinite(error) else None


def noise_ceiling(losses: np.ndarray) -> Optional[Dict[str, float]]:
    """How well one retraining predicts the other, as gradian validate reports it (None under 2 repeats)."""
    if losses.shape[0] < 2:
        return None
    raw, centred = retraining_ceiling(losses)
    (lds, se), (c_lds, c_se) = mean_and_standard_error(raw), mean_and_standard_error(centred)
    return {"lds": lds, "standard_error": se, "centred_lds": c_lds, "centred_standard_error": c_se}


def per_query(scores: np.ndarray, subsets: np.ndarray, outputs: np.ndarray) -> Dict[str, List[float]]:
    return {
        "raw": linear_datamodeling_score(scores, subsets, outputs).tolist(),
        "centred": linear_datamodeling_score(scores, subsets, outputs, centred=True).tolist(),
    }


def subset_standard_error(
    scores: np.ndarray,
    subsets: np.ndarray,
    outputs: np.ndarray,
    minus: Optional[np.ndarray] = None,
    groups: int = 8,
) -> float:
    """The standard error that the draw of retrained subsets puts on the mean over queries of raw
    LDS (of `scores` [Q, N], or of `scores` minus `minus`'s, paired by query). Every query is
    measured on the same subsets, so this part is shared by all of them and the standard error
    over queries leaves it out: a delete-a-group jackknife over `groups` blocks of subsets."""
    blocks = np.array_split(np.arange(len(subsets)), groups)
    means = []
    for block in blocks:
        keep = np.setdiff1d(np.arange(len(subsets)), block)
        lds = linear_datamodeling_score(scores, subsets[keep], outputs[keep])
        if minus is not None:
            lds = lds - linear_datamodeling_score(minus, subsets[keep], outputs[keep])
        means.append(np.nanmean(lds))
    means = np.asarray(means)
    return float(np.sqrt((groups - 1) / groups * np.sum((means - means.mean()) ** 2)))


def lds_figures(scores: np.ndarray, subsets: np.ndarray, outputs: np.ndarray) -> Dict[str, float]:
    """Raw and centred LDS (mean, standard error over queries) of a score matrix, as validate reports them."""
    raw, centred = (linear_datamodeling_score(scores, subsets, outputs, centred=c) for c in (False, True))
    (lds, error), (c_lds, c_error) = mean_and_standard_error(raw), mean_and_standard_error(centred)
    return {"lds": lds, "standard_error": error, "centred_lds": c_lds, "centred_standard_error": c_error}


def measure(
    spec: SetSpec,
    work: Path,
    rows: List[Dict],
    queries: List[Dict],
    base_rows: List[Dict],
    command: str,
    retrain_only: bool = False,
) -> Dict[str, Any]:
    """Build, retrain and score one set; the result (also written to work/result.json). With
    `retrain_only`, only the first projected index is built and scored (validate needs an index),
    by today's defaults alone: the models and retrained subsets for trajectory.py and estimators.py."""
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    write_rows(work / "train.jsonl", rows)
    write_rows(work / "queries.jsonl", queries)
    started = time.perf_counter()
    if spec.base:
        base = Path(spec.base)
    else:
        texts = [r["prompt"] + r["completion"] for r in rows + queries + base_rows]
        base = tiny_base(spec, work, texts, base_rows)
    ft = fine_tuned(spec, work, base, rows)
    args = settings(spec, work, base, ft)
    ids = [r["id"] for r in rows]
    sources = [[ids.index(s) for s in q["sources"]] for q in queries] if all("sources" in q for q in queries) else None
    result: Dict[str, Any] = {"kind": spec.kind, "spec": spec.__dict__, "command": command, "indexes": {}}
    # The retraining happens in the first validate call; later calls find every run on disk.
    for label, scorers, more in [
        *(
            (f"projected-{f}-seed{s}", PROJECTED + spec.extra_scorers, {**FORMATS[f], "grads.seed": str(s)})
            for f in spec.formats
            for s in spec.seeds
        ),
        ("exact", EXACT, {"grads.projection_dim": "null"}),
    ][: 1 if retrain_only else None]:
        if retrain_only:
            scorers = [{}]
        if label == "exact" and spec.exact_filter:
            more = {**more, "grads.module_filter": json.dumps(spec.exact_filter)}
        path = index(args, work / f"index-{label}", **more)
        scored = [*args, f"index.path={path}", *(f"{k}={v}" for k, v in more.items())]
        report = run_validate(load_config(None, [*scored, f"validate.scorers={json.dumps(scorers)}"]))
        entries = []
        for entry, scorer in zip(report["scorers"], scorers):
            cfg = load_config(None, [*scored, *(f"query.{k}={json.dumps(v)}" for k, v in scorer.items())])
            if sources is not None:
                entry.update(retrieval(product_scores(cfg), sources))
            entries.append(entry)
        result["indexes"][label] = {"scorers": entries, "random": report["random"], "ceiling": report.get("ceiling")}
        result.update(shared_variance=report["shared_variance"], num_subsets=report["num_subsets"])
        result["repeats"] = report["repeats"]
    done = SubsetRuns.existing(work / "runs")
    outputs = -done.losses().mean(axis=0)
    lexical = bm25(rows, queries)
    result["bm25"] = {**lds_figures(lexical, done.subsets, outputs), **(retrieval(lexical, sources) if sources else {})}
    result["shared_variance"] = shared_variance_share(outputs)
    result["seconds_per_run"] = float(
        np.mean([json.loads(p.read_text())["seconds"] for p in (work / "runs" / "subsets").glob("*.json")])
    )
    result["wall_seconds"] = time.perf_counter() - started
    write_json_atomically(work / "result.json", result)
    return result


def set_name(result: Dict[str, Any]) -> str:
    """A result's set as its file is named: KIND-N{rows}{variant}."""
    return f"{result['kind']}-N{result['spec']['rows']}{result['spec'].get('variant', '')}"


def projected_formats(result: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """The projected indexes of a result by format ({format: [one per seed]}); results written
    before formats were named hold k = 16 float16 only, as "projected-seed{s}"."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for label, entry in result["indexes"].items():
        if label.startswith("projected-"):
            fmt = label[len("projected-") :].rsplit("-seed", 1)[0]
            out.setdefault("k16-float16" if fmt.startswith("seed") or not fmt else fmt, []).append(entry)
    return out


def seed_averaged(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per scorer and index format: each figure averaged over the projection seeds (exact:
    its one index), with the spread (max - min) of raw LDS over the seeds."""
    rows = []
    for fmt, projected in projected_formats(result).items():
        for i, scorer in enumerate(projected[0]["scorers"]):
            draws = [p["scorers"][i] for p in projected]
            row = {
                "scorer": scorer_name(scorer["scorer"]),
                "index": f"projected {fmt} ({len(draws)} seeds)",
                "format": fmt,
            }
            for key in ("lds", "standard_error", "centred_lds", "centred_standard_error", "recall@10", "mrr"):
                if key in scorer:
                    row[key] = float(np.mean([d[key] for d in draws]))
            row["lds_spread"] = float(max(d["lds"] for d in draws) - min(d["lds"] for d in draws))
            rows.append(row)
    for scorer in result["indexes"]["exact"]["scorers"]:
        rows.append(
            {
                "scorer": scorer_name(scorer["scorer"]),
                "index": "exact",
                **{k: v for k, v in scorer.items() if k not in ("scorer", "name")},
            }
        )
    rows.append({"scorer": "BM25", "index": "words", **result["bm25"]})
    for label in ("random", "ceiling"):
        entry = result["indexes"]["exact"][label]
        if entry:
            rows.append({"scorer": label, "index": "", **entry})
    return rows


def table(result: Dict[str, Any]) -> str:
    """A Markdown table of `seed_averaged(result)`."""

    def fmt(row: Dict[str, Any], key: str) -> str:
        error = "standard_error" if key == "lds" else "centred_standard_error"
        return f"{row[key]:+.3f} ± {row[error]:.3f}"

    lines = [
        f"{result['kind']}, N = {result['spec']['rows']}{result['spec'].get('variant', '')}: M = {result['num_subsets']} subsets × {result['repeats']} repeats, "
        f"{result['spec']['queries']} queries; {100 * result['shared_variance']:.0f}% of the loss variance is shared by all queries; "
        f"{result['seconds_per_run']:.1f} s per retraining run",
        "",
        "| scorer | index | raw LDS | centred LDS | R@10 | MRR | raw spread over seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in seed_averaged(result):
        recall = f"{row['recall@10']:.2f}" if "recall@10" in row else ""
        mrr = f"{row['mrr']:.2f}" if "mrr" in row else ""
        spread = f"{row['lds_spread']:.3f}" if "lds_spread" in row else ""
        lines.append(
            f"| {row['scorer']} | {row['index']} | {fmt(row, 'lds')} | {fmt(row, 'centred_lds')} | {recall} | {mrr} | {spread} |"
        )
    return "\n".join(lines) + "\n"


def raw_ceiling_above_zero(result: Dict[str, Any]) -> bool:
    """Whether the set's raw noise ceiling is more than 2 standard errors above 0: where it is not,
    retraining noise alone hides the raw LDS, so a raw share there says nothing about the scorer."""
    ceiling = result["indexes"]["exact"].get("ceiling")
    return bool(ceiling) and ceiling["lds"] > 2 * ceiling["standard_error"]


def across_sets(results: List[Dict[str, Any]]) -> str:
    """A Markdown table: per scorer, each set's raw LDS as a share of that set's best exact-gradient
    raw LDS (inner or cosine, whichever is higher), and the worst over the sets of: the raw share
    (only the sets whose raw ceiling is clearly above 0, `raw_ceiling_above_zero`), the centred LDS
    and its share of the best exact centred LDS, R@10 and MRR: what choosing a default by the worst
    set compares. A scorer that some results lack (measured before it was added) keeps its row,
    its worst figures taken over the sets that have it, and names the sets it is missing from."""
    rows: Dict[str, Dict[str, Dict[str, Any]]] = {}
    best: Dict[str, float] = {}
    best_centred: Dict[str, float] = {}
    informative: Dict[str, bool] = {}
    for result in results:
        name = set_name(result)
        averaged = seed_averaged(result)
        best[name] = max(r["lds"] for r in averaged if r["index"] == "exact")
        best_centred[name] = max(r["centred_lds"] for r in averaged if r["index"] == "exact")
        informative[name] = raw_ceiling_above_zero(result)
        for row in averaged:
            if row["index"] and row["index"] != "words":
                rows.setdefault(f"{row['scorer']} ({row.get('format', 'exact')})", {})[name] = row
    names = list(best)
    noisy = [n for n in names if not informative[n]]
    lines = [
        "| scorer | "
        + " | ".join(f"{n} raw / best exact{'' if informative[n] else ' (raw ceiling ~0)'}" for n in names)
        + " | worst raw share | worst centred | worst centred share | worst R@10 | worst MRR | missing from |",
        "|---|" + "---|" * (len(names) + 6),
    ]

    def worst(values: Dict[str, float], fmt: str) -> str:
        if not values:
            return ""
        n = min(values, key=values.__getitem__)
        return f"{values[n]:{fmt}} ({n})"

    for scorer, by_set in rows.items():
        have = [n for n in names if n in by_set]
        cells = [
            f"{by_set[n]['lds']:+.3f} / {best[n]:+.3f} = {by_set[n]['lds'] / best[n]:.2f}" if n in by_set else "—"
            for n in names
        ]
        shares = {n: by_set[n]["lds"] / best[n] for n in have if informative[n]}
        centred_shares = {n: by_set[n]["centred_lds"] / best_centred[n] for n in have}
        recalls = {n: by_set[n]["recall@10"] for n in have if "recall@10" in by_set[n]}
        mrrs = {n: by_set[n]["mrr"] for n in have if "mrr" in by_set[n]}
        c = min(have, key=lambda n: by_set[n]["centred_lds"])
        centred = f"{by_set[c]['centred_lds']:+.3f} ± {by_set[c]['centred_standard_error']:.3f} ({c})"
        missing = ", ".join(n for n in names if n not in by_set)
        lines.append(
            f"| {scorer} | " + " | ".join(cells) + f" | {worst(shares, '.2f')} | {centred} | "
            f"{worst(centred_shares, '.2f')} | {worst(recalls, '.2f')} | {worst(mrrs, '.2f')} | {missing} |"
        )
    note = (
        f"Worst raw share over the sets whose raw noise ceiling is more than 2 standard errors above 0"
        f" (left out: {', '.join(noisy)})."
        if noisy
        else "Every set's raw noise ceiling is clearly above 0."
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


def formats_side_by_side(
    results: List[Dict[str, Any]], scorers: Sequence[str] = ("query.* settings", "checkpoints=last")
) -> str:
    """A Markdown table: per set and scorer, each projected index format's seed-averaged raw LDS,
    centred LDS, R@10 and spread of raw LDS over the seeds, with the set's best exact scorer, all
    on the same retrained subsets: what issue 29's index-format candidates change."""
    lines = [
        "| set | scorer | format | raw LDS | centred LDS | R@10 | MRR | raw spread over seeds | best exact raw / centred |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        name = set_name(result)
        averaged = seed_averaged(result)
        exact = [r for r in averaged if r["index"] == "exact"]
        best = f"{max(r['lds'] for r in exact):+.3f} / {max(r['centred_lds'] for r in exact):+.3f}"
        for scorer in scorers:
            for row in (r for r in averaged if r["scorer"] == scorer and "format" in r):
                recall = f"{row['recall@10']:.2f}" if "recall@10" in row else ""
                mrr = f"{row['mrr']:.2f}" if "mrr" in row else ""
                lines.append(
                    f"| {name} | {scorer} | {row['format']} | {row['lds']:+.3f} ± {row['standard_error']:.3f} | "
                    f"{row['centred_lds']:+.3f} ± {row['centred_standard_error']:.3f} | {recall} | {mrr} | {row['lds_spread']:.3f} | {best} |"
                )
    return "\n".join(lines) + "\n"


SWEEP_SCORERS = (
    ("ekfac, per module", "precondition=ekfac, normalize=module"),
    ("fisher, per module", "precondition=fisher, normalize=module"),
    ("fisher, whole row", "precondition=fisher, normalize=row"),
)


def auto_sweep(results: List[Dict[str, Any]], fmt: str) -> str:
    """A Markdown table: the N sweep behind `query.precondition=auto` at one index format `fmt`
    ("k32-int8"): per set, in order of rows per dimension of F (N / k²), the seed-averaged raw LDS
    (± standard error over queries) of SWEEP_SCORERS, the best of them in bold, the set's best
    exact scorer and its raw noise ceiling."""
    k = int(fmt.split("-")[0].lstrip("k"))
    lines = [
        "| set | N (rows per k²) | "
        + " | ".join(label for label, _ in SWEEP_SCORERS)
        + " | best exact | noise ceiling |",
        "|---|---|" + "---|" * (len(SWEEP_SCORERS) + 2),
    ]
    for result in sorted(results, key=lambda r: (r["spec"]["rows"], set_name(r))):
        averaged = seed_averaged(result)
        found = {r["scorer"]: r for r in averaged if r.get("format") == fmt}
        picked = [found[name] for _, name in SWEEP_SCORERS]
        top = max(r["lds"] for r in picked)
        cells = [
            f"{'**' if r['lds'] == top else ''}{r['lds']:+.3f} ± {r['standard_error']:.3f}{'**' if r['lds'] == top else ''}"
            for r in picked
        ]
        rows = result["spec"]["rows"]
        ceiling = result["indexes"]["exact"].get("ceiling")
        best = max((r for r in averaged if r["index"] == "exact"), key=lambda r: r["lds"])
        lines.append(
            f"| {set_name(result)} | {rows:,} ({rows / k**2:.2g}) | "
            + " | ".join(cells)
            + f" | {best['lds']:+.3f} ({best['scorer'].replace('precondition=none, ', '')}) | "
            + (f"{ceiling['lds']:+.3f}" if ceiling else "")
            + " |"
        )
    return "\n".join(lines) + "\n"


def worst_sets(results: List[Dict[str, Any]], picks: Sequence[Tuple[str, str]]) -> str:
    """A Markdown table: for each (scorer, format) in `picks` ("exact" for the exact index), the
    worst over the sets of its raw LDS as a share of the set's best exact scorer's (the sets whose
    raw ceiling is clearly above 0 only, `raw_ceiling_above_zero`), its worst centred LDS, R@10
    and MRR, each naming its set: choosing a default by the worst set, in one line a scorer."""
    lines = [
        "| scorer | index | worst raw / best exact | worst centred LDS | worst R@10 | worst MRR |",
        "|---|---|---|---|---|---|",
    ]
    for scorer, fmt in picks:
        shares, centred, recalls, mrrs = {}, {}, {}, {}
        for result in results:
            name, averaged = set_name(result), seed_averaged(result)
            best = max(r["lds"] for r in averaged if r["index"] == "exact")
            row = next(
                r
                for r in averaged
                if r["scorer"] == scorer and (r["index"] == "exact" if fmt == "exact" else r.get("format") == fmt)
            )
            if raw_ceiling_above_zero(result):
                shares[name] = row["lds"] / best
            centred[name] = row["centred_lds"]
            if "mrr" in row:
                recalls[name], mrrs[name] = row["recall@10"], row["mrr"]

        def worst(values: Dict[str, float], spec: str) -> str:
            name = min(values, key=values.__getitem__)
            return f"{values[name]:{spec}} ({name})"

        lines.append(
            f"| {scorer} | {fmt} | {worst(shares, '.2f')} | {worst(centred, '+.3f')} | {worst(recalls, '.2f')} | {worst(mrrs, '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def damping_sweep(results: List[Dict[str, Any]], fmt: str) -> str:
    """A Markdown table: per set, the default scorer at format `fmt` at each query.damping that
    `--scorers` added ("damping=X" beside "query.* settings", whose damping is the default):
    raw LDS with its share of the set's best exact scorer, centred LDS and MRR; then the worst of
    each over the sets (raw share: the sets whose raw ceiling is clearly above 0 only)."""
    from gradian_lightning.specs import QuerySpec

    default = f"damping={QuerySpec().damping:g} (default)"
    columns: Dict[str, Dict[str, Dict[str, Any]]] = {}
    best: Dict[str, float] = {}
    informative: Dict[str, bool] = {}
    for result in sorted(results, key=lambda r: (r["spec"]["rows"], set_name(r))):
        name, averaged = set_name(result), seed_averaged(result)
        best[name] = max(r["lds"] for r in averaged if r["index"] == "exact")
        informative[name] = raw_ceiling_above_zero(result)
        for row in averaged:
            if row.get("format") != fmt:
                continue
            if row["scorer"] == "query.* settings":
                columns.setdefault(default, {})[name] = row
            elif row["scorer"].startswith("damping="):
                columns.setdefault(row["scorer"], {})[name] = row
    order = sorted(columns, key=lambda c: float(c.split("=")[1].split()[0]))
    lines = [
        "| set | " + " | ".join(f"{c}: raw (share) / centred / MRR" for c in order) + " |",
        "|---|" + "---|" * len(order),
    ]
    for name in best:
        cells = [
            f"{r['lds']:+.3f} ({r['lds'] / best[name]:.2f}) / {r['centred_lds']:+.3f} / {r['mrr']:.2f}"
            for r in (columns[c][name] for c in order)
        ]
        lines.append(f"| {name}{'' if informative[name] else ' (raw ceiling ~0)'} | " + " | ".join(cells) + " |")
    worst = []
    for c in order:
        share = min(columns[c][n]["lds"] / best[n] for n in best if informative[n])
        centred = min(columns[c][n]["centred_lds"] for n in best)
        mrr = min(columns[c][n]["mrr"] for n in best)
        worst.append(f"**{share:.2f} / {centred:+.3f} / {mrr:.2f}**")
    lines.append("| worst | " + " | ".join(worst) + " |")
    return "\n".join(lines) + "\n"
