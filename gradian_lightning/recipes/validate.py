"""The `gradian validate` recipe: the Linear Datamodeling Score of the scoring, on the user's own data.

    cfg = load_config("my.yaml", ["validate.num_subsets=24"])
    report = run_validate(cfg)                       # or run_validate(cfg, module_factory=..., trainer_kwargs=...)

It trains `validate.num_subsets` models on random `validate.alpha`-subsets of `data.train` (a plain
Lightning fine-tune of the base model; `validate.repeats` runs per subset), records every query's
loss under each, scores every query against every row of the index at `index.path` with each
scorer, and reports each scorer's LDS beside random scores' and, with repeats, the noise ceiling.
The protocol and its caveats: docs/validate.md.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import lightning as L
import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm.auto import tqdm

from gradian_lightning.config import check_settings, require_for
from gradian_lightning.data import Fields
from gradian_lightning.data_sources import fingerprint_of, open_rows
from gradian_lightning.errors import ConfigError, GradianError, MissingExtraError
from gradian_lightning.extras import require_extra
from gradian_lightning.hub import find_causal_lm, load_tokenizer_and_config, normalized_name
from gradian_lightning.index.layout import IndexMeta, stored_meta
from gradian_lightning.recipes.query import dense_scores
from gradian_lightning.saved_models import load_saved_model
from gradian_lightning.specs import QuerySpec
from gradian_lightning.validation.lds import (
    linear_datamodeling_score,
    mean_and_standard_error,
    retraining_ceiling,
    shared_variance_share,
)
from gradian_lightning.validation.retrain import FineTune, fine_tune, query_losses, run_seed
from gradian_lightning.validation.subsets import SubsetRuns, write_json_atomically


def scorer_name(scorer: Dict[str, Any]) -> str:
    """A scorer's label: its query.* settings, or "query.* settings" for none."""
    return ", ".join(f"{k}={v}" for k, v in scorer.items()) or "query.* settings"


def _scoring_config(cfg: DictConfig, scorer: Dict[str, Any]) -> DictConfig:
    """`cfg` with the scorer's query.* settings, asking for every row's score."""
    try:
        merged = OmegaConf.merge(cfg, {"query": {**scorer, "top_k": "all", "bottom_k": 0, "output": None}})
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"setting 'validate.scorers' entry {scorer!r}: {str(getattr(err, 'msg', err)).splitlines()[0]}; each entry is a dict of query.* settings"
        ) from None
    check_settings(merged)
    return merged


def _default_factory(cfg: DictConfig, base: str) -> Callable[[], L.LightningModule]:
    return lambda: FineTune(load_saved_model(cfg.model, base)[0].train(), cfg.validate.learning_rate)


def run_validate(
    cfg: DictConfig,
    module_factory: Optional[Callable[[], L.LightningModule]] = None,
    trainer_kwargs: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Measure the LDS of each `validate.scorers` entry on `data.train` and `query.data`; write the
    report to `validate.output` (lds.json, lds_per_query.jsonl, lds.png with matplotlib) and return it.

    `module_factory()` makes a fresh LightningModule to fine-tune on each subset (default: a plain
    AdamW fine-tune of the base model: `model.checkpoints[0]`, or `model.name_or_path`); the
    Hugging Face model inside it gives the query losses. `trainer_kwargs` go to each subset's
    `lightning.Trainer` (default: `trainer.accelerator` and `trainer.precision`, one device).
    Finished training runs are kept on disk; a rerun with the same settings resumes.
    """
    require_for(cfg, "validate")
    v, g = cfg.validate, cfg.grads
    fields = Fields.from_config(cfg.data)
    # Rows by position from the memory-mapped source; the queries, a small set, as dicts.
    train, query_set = open_rows(cfg.data.train, fields), open_rows(cfg.query.data, fields, "query.data")
    queries = [fields.row(r) for r in query_set]
    scorers = [
        dict(s) for s in (OmegaConf.to_object(v.scorers) if OmegaConf.is_config(v.scorers) else v.scorers) or []
    ] or [{}]
    scoring = [_scoring_config(cfg, s) for s in scorers]  # bad scorers fail before any training
    stored = stored_meta(str(cfg.index.path))
    if stored is None:
        raise ConfigError(
            f"setting 'index.path'={str(cfg.index.path)!r} holds no Gradian index; gradian validate scores with the index of data.train: build it first with gradian index and the same settings"
        )
    indexed = IndexMeta.from_attrs(stored, repr(str(cfg.index.path))).data.get("fingerprint")
    data_fingerprint = fingerprint_of(cfg.data.train, train)
    if indexed is not None and indexed != data_fingerprint:
        raise ConfigError(
            f"setting 'data.train'={str(cfg.data.train)!r} is not the file the index at {str(cfg.index.path)!r} was built from; validate with the indexed data, or re-index"
        )
    base = (list(cfg.model.checkpoints or []) or [cfg.model.name_or_path])[0]
    plan = {
        "data_sha256": data_fingerprint,  # a file's fingerprint is its SHA-256, as these keys say
        "queries_sha256": fingerprint_of(cfg.query.data, query_set),
        "base": normalized_name(str(base)),
        "max_seq_length": g.max_seq_length,
        "custom_module": module_factory is not None,
        **{k: v[k] for k in ("num_subsets", "alpha", "seed", "repeats", "epochs", "learning_rate", "batch_size")},
    }
    runs = SubsetRuns(v.output, plan, len(train))
    make_module = module_factory or _default_factory(cfg, str(base))
    if trainer_kwargs is None:
        trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
        trainer_kwargs = {k: trainer[k] for k in ("accelerator", "precision") if trainer.get(k) is not None}
        trainer_kwargs["devices"] = 1
    todo = runs.todo()
    total = len(runs.subsets) * runs.repeats
    tokenizer = load_tokenizer_and_config(cfg.model)[0] if todo else None  # a fine-tune keeps its base's tokenizer
    with tqdm(total=total, initial=total - len(todo), desc="gradian validate: training runs", unit="run") as bar:
        for m, r in todo:
            seed = run_seed(v.seed, m, r)
            started = time.perf_counter()
            module = make_module()
            model = find_causal_lm(module)
            rows = [fields.row(train[int(i)]) for i in np.flatnonzero(runs.subsets[m])]
            fine_tune(module, rows, tokenizer, g.max_seq_length, v.batch_size, v.epochs, seed, trainer_kwargs)
            losses = query_losses(model, tokenizer, queries, g.max_seq_length, v.batch_size)
            if not np.isfinite(losses).all():
                raise GradianError(
                    f"training run {r} of subset {m} gave non-finite query losses; lower validate.learning_rate (now {v.learning_rate})"
                )
            runs.save(m, r, seed, losses, time.perf_counter() - started)
            # Lightning's trainer and module refer to each other: without a collection each run's
            # model and optimizer state would stay until the cycle collector happened to run.
            del module, model
            gc.collect()
            bar.update(1)
    losses = runs.losses()  # [repeats, M, Q]
    outputs = -losses.mean(axis=0)  # [M, Q]: the measured output, averaged over repeats
    report: Dict[str, Any] = {
        "num_subsets": len(runs.subsets),
        "repeats": runs.repeats,
        "queries": len(queries),
        "shared_variance": shared_variance_share(outputs),
        "scorers": [],
    }
    per_query: List[Dict[str, Any]] = []
    # Every scorer's [Q, N] scores from one set of query rows (`dense_scores`); rows never ranked score 0.
    matrices = dense_scores(cfg, [QuerySpec.from_config(c.query) for c in scoring])
    for scorer, matrix in zip(scorers, matrices):
        scores = np.nan_to_num(matrix.astype(np.float64), nan=0.0)
        raw, centred = (linear_datamodeling_score(scores, runs.subsets, outputs, centred=c) for c in (False, True))
        report["scorers"].append({"scorer": scorer, "name": scorer_name(scorer), **_lds_entry(raw, centred)})
        per_query += [
            {"scorer": scorer_name(scorer), "query": q, "lds": _finite(x), "centred_lds": _finite(y)}
            for q, (x, y) in enumerate(zip(raw, centred))
        ]
    noise = np.random.default_rng(v.seed).standard_normal((len(queries), len(train)))
    report["random"] = _lds_entry(
        *(linear_datamodeling_score(noise, runs.subsets, outputs, centred=c) for c in (False, True))
    )
    if runs.repeats >= 2:  # how well one retraining predicts another: what no scorer can beat
        report["ceiling"] = _lds_entry(*retraining_ceiling(losses))
    output = Path(v.output)
    write_json_atomically(output / "lds.json", report)
    (output / "lds_per_query.jsonl").write_text("".join(json.dumps(row) + "\n" for row in per_query))
    report["chart"] = _chart(report, output / "lds.png")
    report["output"] = str(output)
    return report


def _lds_entry(raw: np.ndarray, centred: np.ndarray) -> Dict[str, float]:
    """The report's figures for per-query raw and centred LDS [Q]: each one's mean and standard error."""
    (lds, error), (centred_lds, centred_error) = mean_and_standard_error(raw), mean_and_standard_error(centred)
    return {"lds": lds, "standard_error": error, "centred_lds": centred_lds, "centred_standard_error": centred_error}


def _finite(x: float) -> Optional[float]:
    return float(x) if np.isfinite(x) else None


def _chart(report: Dict[str, Any], path: Path) -> str:
    """A bar chart of each scorer's raw and centred LDS (± standard error), random's and the ceiling; the path, or why none was drawn."""
    try:
        matplotlib = require_extra("matplotlib", "bench", "the LDS bar chart")
    except MissingExtraError as err:
        return f"not drawn: {err}"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = [(s["name"], s) for s in report["scorers"]] + [("random scores", report["random"])]
    if "ceiling" in report:
        named.append(("retraining noise ceiling", report["ceiling"]))
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.6 * len(named)))
    place = np.arange(len(named))
    for shift, key, colour, label in ((-0.2, "", "#4878a8", "raw"), (0.2, "centred_", "#d08c3c", "centred")):
        values = [entry[f"{key}lds"] for _, entry in named]
        errors = [entry[f"{key}standard_error"] for _, entry in named]
        errors = [e if np.isfinite(e) else 0 for e in errors]
        ax.barh(place + shift, values, height=0.4, xerr=errors, color=colour, label=label)
    ax.set_yticks(place, [name for name, _ in named])
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel(f"LDS (Spearman over {report['num_subsets']} subsets, mean over {report['queries']} queries)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
