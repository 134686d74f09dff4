"""The `gradian query` recipe as plain functions: config -> model, query rows -> ranking -> JSONL.

cfg = load_config("configs/smollm2.yaml", ["query.data=my_queries.jsonl", "index.path=runs/ix"])
answer = run_query(cfg)
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from gradian_lightning.config import is_given, require_for
from gradian_lightning.data import Fields, TokenizedRows
from gradian_lightning.data_sources import indexed_rows, open_rows
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.factors import Factors, fit_factors
from gradian_lightning.hub import pad_token_id
from gradian_lightning.index.checkpoints import checkpoint_weights
from gradian_lightning.index.factor_cache import read_factor_set, write_factor_set
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.ann import ann_topk, require_faiss, uses_ann
from gradian_lightning.query.dask_engine import check_workers_can_open, dask_client, dask_topk
from gradian_lightning.query.exact_scoring import (
    TrainBatches,
    exact_estimator,
    exact_modules,
    exact_scores,
    factor_arrays,
    factor_set_key,
    factor_set_name,
    factors_from_arrays,
    resolve_method,
    return_freed_memory,
    run_settings_against_exact,
)
from gradian_lightning.query.rows import check_matches_index, query_gradients, tokenized_queries
from gradian_lightning.query.scorer import Scorer, checkpoint_scorers
from gradian_lightning.query.token_scores import for_query, row_token_terms, summed_over_checkpoints
from gradian_lightning.query.topk import Index, Ranking, dense_topk, score_all, streaming_topk
from gradian_lightning.saved_models import load_saved_model, saved_models
from gradian_lightning.specs import IndexSpec, QuerySpec, field_names


def results_for(
    index: IndexReader, query_ids: Sequence[str], top: Ranking, bottom: Optional[Ranking] = None
) -> List[Dict[str, Any]]:
    """One JSON-ready dict per query: {"query_id", "results": [{"rank", "id", "index", "score"}], "opponents"?}
    (`gradian query` adds "scoring": how the scores were made, in words).

    `id` is the training row's stored id (its `id` column, or its position).
    """
    rankings = {"results": top, **({"opponents": bottom} if bottom is not None else {})}
    positions = sorted({int(i) for r in rankings.values() for i in r.indices.flatten().tolist()})
    ids = dict(zip(positions, index.column("id", positions))) if positions else {}
    out = []
    for q, query_id in enumerate(query_ids):
        entry: Dict[str, Any] = {"query_id": query_id}
        for key, ranking in rankings.items():
            entry[key] = [
                {"rank": r + 1, "id": str(ids[int(i)]), "index": int(i), "score": float(s)}
                for r, (i, s) in enumerate(zip(ranking.indices[q].tolist(), ranking.scores[q].tolist()))
            ]
        out.append(entry)
    return out


def write_results(path: str | Path, results: Sequence[Dict[str, Any]]) -> None:
    """Write `results_for` output as JSONL, one line per query."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in results))


def _checkpoint_models(cfg: Any, index: Index, which: Any) -> List[tuple]:
    """(checkpoint step, model name_or_path) for each checkpoint the query scores with."""

    chosen = [int(e["step"]) for e, _ in checkpoint_weights(index.checkpoints, which)]
    if chosen == [index.checkpoints[-1]["step"]] and not cfg.model.checkpoints:
        return [(chosen[0], cfg.model.name_or_path)]
    names = list(cfg.model.checkpoints or [])
    if len(names) != len(index.checkpoints):
        raise ConfigError(
            f"setting 'query.checkpoints'={which!r} needs one saved model per checkpoint of the index at {str(index.path)!r} (steps {[e['step'] for e in index.checkpoints]}) in model.checkpoints, oldest first; it lists {len(names)}"
        )
    # Matched by position, oldest first; a .ckpt knows its global step, so a misordered list fails here.
    for e, saved in zip(index.checkpoints, saved_models(names)):
        if saved.is_lightning and saved.step != int(e["step"]):
            raise ConfigError(
                f"setting 'model.checkpoints' lists {saved.entry!r} (global step {saved.step}) where the index at {str(index.path)!r} holds step {e['step']}; list the saved models of the index's checkpoints {[c['step'] for c in index.checkpoints]}, oldest first"
            )
    by_step = {int(e["step"]): name for e, name in zip(index.checkpoints, names)}
    return [(step, by_step[step]) for step in chosen]


def check_writable(path: str | Path, key: str = "query.output") -> None:
    """`ConfigError` now, before any query is computed, when the results file cannot be written."""
    path = Path(path)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):  # "a": an existing file is not truncated by the check
            pass
    except OSError as err:
        raise ConfigError(
            f"setting '{key}'={str(path)!r} cannot be written ({type(err).__name__}: {err.strerror or err}); choose a path in a writable folder"
        ) from None
    if not existed:
        path.unlink()


def written_rows(index: IndexReader) -> int:
    """How many rows of `index` are written (complete); all of them once the index is complete."""
    return len(index) if index.meta.complete else int(index.column("complete").sum())


# (query number, shown rows, their positions) -> each row's {"tokens", "terms", ...}: `token_explainer`.
Explain = Callable[[int, List[Dict[str, Any]], List[int]], List[Dict[str, Any]]]


@dataclass
class QueryRows:
    """The query rows of `gradian query`, made once per scored checkpoint with its saved model.

    rows: {checkpoint step: [Q, D] float32 on `device`}; readers: {step: the index read at that
    checkpoint}; models: {step: (model, tokenizer)}, kept only when asked (for token terms).
    `scorers(spec)` scores them, each checkpoint with its weight in the sum.
    """

    rows: Dict[int, torch.Tensor]
    readers: Dict[int, IndexReader]
    models: Dict[int, tuple]
    device: torch.device
    index: IndexReader

    def scorers(self, spec: QuerySpec, shortcut: bool = True) -> List[Scorer]:
        """One prepared `Scorer` per checkpoint that `spec.checkpoints` sums (`checkpoint_scorers`)."""
        return checkpoint_scorers(self.index, self.rows, spec, self.device, shortcut)


def token_explainer(
    results: Sequence[Dict[str, Any]],
    token_rows: int,
    train_rows: Sequence[Dict[str, Any]],
    made: QueryRows,
    scorers: List[Scorer],
    label: str = "gradian report: token terms",
) -> Explain:
    """The `explain` of `report_data` for the page's shaded rows: the first `token_rows` top rows
    and opponents of each query in `results`. Each distinct row is explained once per checkpoint
    for every query at once (one forward/backward: query/token_scores.py), under a progress bar
    with an ETA, before the page is built; `explain(q, rows, positions)` then reads query q's terms,
    summed over the `scorers` (one per checkpoint, `shortcut=False`) with their weights, as
    `gradian query` sums scores. `made` must have kept its models."""
    wanted = sorted(
        {
            int(e["index"])
            for entry in results
            for e in list(entry.get("results", []))[:token_rows] + list(entry.get("opponents", []))[:token_rows]
        }
    )
    rows = [train_rows[i] for i in wanted]
    by_checkpoint = []
    with tqdm(total=len(wanted) * len(scorers), desc=label, unit="row") as bar:
        for scorer in scorers:
            model, tokenizer = made.models[scorer.index.step]
            terms = row_token_terms(scorer, model, tokenizer, rows, done=bar.update)
            by_checkpoint.append((scorer.weight, dict(zip(wanted, terms))))

    def explain(q: int, shown: List[Dict[str, Any]], positions: List[int]) -> List[Dict[str, Any]]:
        return summed_over_checkpoints([(w, for_query([terms[p] for p in positions], q)) for w, terms in by_checkpoint])

    return explain


def open_for_query(cfg: Any) -> Tuple[Index, IndexSpec, List[str]]:
    """The index at `cfg.index.path`, the `grads.*` settings and which of them the user gave
    (`config.is_given`), checked against the index's stored spec before any model loads."""
    index = Index(cfg.index.path)
    written = written_rows(index)
    if written < len(index):
        warnings.warn(
            f"the index at {str(index.path)!r} is unfinished: {written} of {len(index)} rows are written, and only those are ranked; rerun gradian index with its settings to finish it",
            stacklevel=3,
        )
    # The rows are made as the index's stored spec says; a grads.* setting is checked against it
    # only where the YAML file or the command line gave it.
    spec, given = IndexSpec.from_config(cfg.grads), [k for k in field_names(IndexSpec) if is_given(cfg, f"grads.{k}")]
    check_matches_index(index, spec=spec, given=given)  # the module filter needs the model: checked with it
    return index, spec, given


def make_query_rows(
    cfg: Any,
    index: Index,
    queries: List[Dict[str, Any]],
    spec: IndexSpec,
    given: List[str],
    which: Any,
    keep_models: bool = False,
) -> QueryRows:
    """The rows of `queries` at each checkpoint `which` (query.checkpoints) chooses, each made with
    that checkpoint's saved model on the device `cfg.trainer` asks for (Fabric)."""
    fabric = fabric_of(cfg)
    rows, readers, kept = {}, {}, {}
    for step, name in _checkpoint_models(cfg, index, which):
        reader = readers[step] = index if step == index.step else index.at(step)
        model, tokenizer = load_saved_model(cfg.model, name)
        if keep_models:
            kept[step] = (model, tokenizer)
        # Cast as the Trainer cast the indexed model (bf16-true: bf16 weights), then placed; the
        # wrapper setup_module returns is not used: the rows come from the module itself.
        fabric.setup_module(model)
        rows[step] = query_gradients(
            reader,
            model,
            tokenizer,
            queries,
            cfg.grads.batch_size,
            device=fabric.device,
            forward_context=fabric.autocast(),
            source=str(cfg.query.data),
            settings=spec,
            given=given,
        )
    return QueryRows(rows, readers, kept, fabric.device, index.reader)


def fabric_of(cfg: Any) -> L.Fabric:
    """The one-device `lightning.Fabric` of `cfg.trainer`'s accelerator and precision: where and
    in what precision the query's models run."""
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    fabric_kwargs = {k: trainer[k] for k in ("accelerator", "precision") if trainer.get(k) is not None}
    return L.Fabric(**fabric_kwargs, devices=1)


@dataclass
class ExactScores:
    """The exact pass's scores (query.method=exact): `scores` float32 [Q, N], NaN for rows never
    ranked; `by_checkpoint` {step: that checkpoint's weighted share [Q, N]}, summing to `scores`;
    `scoring` in words; `device` where it ran."""

    scores: np.ndarray
    by_checkpoint: Dict[int, np.ndarray]
    scoring: str
    device: torch.device


def exact_dense_scores(
    cfg: Any,
    index: Index,
    queries: List[Dict[str, Any]],
    spec: IndexSpec,
    given: List[str],
    q: QuerySpec,
    train: Any = None,
) -> ExactScores:
    """Every query against every training row of the index, by the exact pass (query/exact.py): the
    rows re-read from the data the index was built from (`indexed_rows`), tokenised with its
    max_seq_length and batched by grads.batch_size; at each checkpoint `q.checkpoints` sums, that
    checkpoint's saved model, its factors fitted there (or read from the index's factors/ cache),
    the scores weighted as the index path weights them. Rows the index never ranks are NaN."""
    estimator = exact_estimator(q, len(checkpoint_weights(index.checkpoints, q.checkpoints)))
    fields = Fields.from_config(cfg.data)
    train_rows, why = indexed_rows(index.meta.data_segments(), fields, train)
    if train_rows is None:
        raise ConfigError(
            f"setting 'query.method'='exact' re-reads every training row of the index at {str(index.path)!r} from data.train, and {why}; restore that data, or set query.method=index to score the stored rows"
        )
    weights = {int(e["step"]): w for e, w in checkpoint_weights(index.checkpoints, q.checkpoints)}
    chosen = _checkpoint_models(cfg, index, q.checkpoints)
    readers = {step: index.reader if step == index.step else index.reader.at(step) for step, _ in chosen}
    rankable = np.logical_and.reduce([r.rankable(0, len(index)) for r in readers.values()])
    positions = np.flatnonzero(rankable)
    max_seq_length = int(index.meta.max_seq_length or cfg.grads.max_seq_length)
    fabric = fabric_of(cfg)
    # What the model ran in, for the factor cache's key: the trainer's precision and the model's dtype.
    precision = f"{OmegaConf.to_container(cfg.trainer, resolve=True).get('precision')}/{cfg.model.dtype}"
    total, by_checkpoint = None, {}
    for step, name in chosen:
        reader = readers[step]
        model, tokenizer = load_saved_model(cfg.model, name)
        fabric.setup_module(model)  # cast and placed as make_query_rows places it
        chosen_modules = exact_modules(reader, model, spec, given, head=estimator.head)
        modules, run_spec = chosen_modules.modules, chosen_modules.spec
        pad = pad_token_id(tokenizer)
        rows = TokenizedRows(train_rows, tokenizer, max_seq_length, source="data.train")
        batches = TrainBatches(rows, positions, int(cfg.grads.batch_size), pad, fabric.device)
        examples = tokenized_queries(reader, queries, tokenizer, max_seq_length, str(cfg.query.data)).examples
        # No autocast, unlike make_query_rows: the factor sums, their eigenbases, the preconditioning
        # and the contractions run outside the hooks that keep the index path's projection in
        # float32, and in bf16 they would lose the small eigenvalues the inverse weighs most. The
        # forward runs in the weights' own dtype (a *-true precision's, cast by setup_module).
        factors = None
        if estimator.factors is not None:
            diagonal = chosen_modules.diagonal_g
            key = factor_set_key(
                reader, estimator.factors, positions, max_seq_length, precision, list(modules), diagonal
            )
            factors = _factors(index, model, run_spec, modules, batches, step, estimator.factors, key, fabric, diagonal)
        part = exact_scores(
            model, run_spec, modules, examples, pad, batches, len(index), estimator, factors, chosen_modules.parts
        )
        head_note = chosen_modules.head_note
        part = part.numpy() * np.float32(weights[step])
        by_checkpoint[step] = part
        total = part.copy() if total is None else total + part
        del model, factors
    total[:, ~rankable] = np.nan
    # A head the estimator asked for but this model or these settings cannot score as a part of its
    # own is said, not dropped silently.
    scoring = replace(estimator, head=estimator.head and not head_note).describe()
    if head_note:
        scoring += f" ({head_note})"
    if len(chosen) > 1:
        scoring += f", summed over {len(chosen)} checkpoints weighted by learning rate"
    return ExactScores(total, by_checkpoint, scoring, fabric.device)


def _factors(
    index: Index,
    model: Any,
    spec: IndexSpec,
    modules: Dict[str, Any],
    batches: TrainBatches,
    step: int,
    kind: str,
    key: Dict[str, Any],
    fabric: L.Fabric,
    diagonal_g: Sequence[str] = (),
) -> Factors:
    """Checkpoint `step`'s factors: read from the index's factors/ cache when a complete set was
    fitted under `key`, else fitted over `batches` and written there (a read-only index is warned
    of, and the factors are used unstored)."""
    name = factor_set_name(step, kind)
    stored = read_factor_set(str(index.path), name, key)
    if stored is not None:
        return factors_from_arrays(stored, kind, fabric.device)
    factors = fit_factors(model, spec, batches, ekfac=kind == "ekfac", modules=modules, diagonal_g=diagonal_g)
    return_freed_memory()  # the sums and the eigendecompositions' temporaries
    try:
        write_factor_set(str(index.path), name, key, factor_arrays(factors))
    except OSError as err:
        warnings.warn(
            f"the fitted factors could not be kept in the index at {str(index.path)!r} ({type(err).__name__}: {err}); the next exact query fits them again",
            stacklevel=3,
        )
    return factors


def resolve_scoring(cfg: Any, index: Index, q: QuerySpec, train: Any = None) -> Tuple[QuerySpec, str]:
    """`q` with query.method=auto made concrete for this index (`resolve_method`), and the line
    saying what auto chose and why ("" for an explicit method)."""
    if q.method != "auto":
        return q, ""

    def why_not_exact() -> Optional[str]:
        refused = run_settings_against_exact(cfg.query.engine, bool(cfg.query.token_scores))
        if refused:
            return refused
        rows, reason = indexed_rows(index.meta.data_segments(), Fields.from_config(cfg.data), train)
        return reason if rows is None else None

    return resolve_method(q, index.reader, len(checkpoint_weights(index.checkpoints, q.checkpoints)), why_not_exact)


def dense_scores(cfg: Any, scorings: Sequence[QuerySpec]) -> List[np.ndarray]:
    """Float32 [Q, N] per entry of `scorings`: every query of `cfg.query.data` against every row of
    the index (`score_all`; NaN for rows never ranked). The query rows are made once, at every
    checkpoint any of the index-path scorings sums, and each such scoring is one streamed pass over
    the index; a query.method=exact scoring is its own exact pass (`exact_dense_scores`)."""
    require_for(cfg, "query")
    index, spec, given = open_for_query(cfg)
    queries = read_queries(cfg)
    scorings = [resolve_scoring(cfg, index, q)[0] for q in scorings]
    stored = [q for q in scorings if q.method == "index"]
    made = None
    if stored:
        steps = sorted(
            {int(e["step"]) for q in stored for e, _ in checkpoint_weights(index.checkpoints, q.checkpoints)}
        )
        which = "last" if steps == [index.step] else steps
        made = make_query_rows(cfg, index, queries, spec, given, which)
    return [
        exact_dense_scores(cfg, index, queries, spec, given, q).scores
        if q.method == "exact"
        else score_all(made.scorers(q)).numpy()
        for q in scorings
    ]


def read_queries(cfg: Any, queries: Any = None) -> List[Dict[str, Any]]:
    """The query rows of `cfg.query.data` (or `queries`, a `datasets.Dataset` or list of dicts,
    from Python), under gradian's names (the `data.*_field` mapping): a query set is small."""
    fields = Fields.from_config(cfg.data)
    if isinstance(queries, list):
        return [dict(r) for r in queries]
    dataset = open_rows(queries if queries is not None else cfg.query.data, fields, "query.data")
    return [fields.row(r) for r in dataset]


def run_query(cfg: Any, queries: Any = None, train: Any = None) -> Dict[str, Any]:
    """Answer `cfg.query.data` (or `queries`, from Python) against the index at `cfg.index.path`; write `cfg.query.output` if set.

    Returns {"results": per-query dicts (see `results_for`), "queries": the query rows,
    "train_rows": the index's training rows by position when its data is still there and unchanged
    (`data_sources.IndexedRows`; else None, with a warning saying why), "index": the reader,
    "device": where scoring ran}. `train`: the Python `datasets.Dataset` an index was built from,
    for its row texts.
    """
    require_for(cfg, "query", supplied=("query.data",) if queries is not None else ())
    if cfg.query.output:
        check_writable(cfg.query.output)
    queries = read_queries(cfg, queries)
    index, spec, given = open_for_query(cfg)
    with contextlib.ExitStack() as stack:
        # The cluster first: a scheduler that does not answer fails before the model loads.
        client = None
        if cfg.query.engine == "dask":
            if cfg.query.search == "ann":
                raise ConfigError(
                    "setting 'query.search'='ann' runs on the local engine, and query.engine=dask scans every row exactly; set query.engine=local to search the ANN index, or query.search=exact"
                )
            check_workers_can_open(index)
            client = stack.enter_context(dask_client(cfg.query.dask_scheduler))
        return _answer(cfg, queries, index, spec, given, client, train)


def _answer(
    cfg: Any,
    queries: List[Dict[str, Any]],
    index: Index,
    spec: IndexSpec,
    given: List[str],
    client: Optional[Any],
    train: Any = None,
) -> Dict[str, Any]:
    q, chosen_by_auto = resolve_scoring(cfg, index, QuerySpec.from_config(cfg.query), train)
    which = q.checkpoints
    chosen = len(checkpoint_weights(index.checkpoints, which))
    if client is not None and chosen > 1:
        raise ConfigError(
            f"setting 'query.engine'='dask' scores one checkpoint, but query.checkpoints={which!r} chooses {chosen} of the index at {str(index.path)!r}; set query.checkpoints=last (or one step), or use query.engine=local to sum checkpoints"
        )
    searched = client is None and q.method == "index" and uses_ann(q, len(index))
    if searched:
        require_faiss()  # before the model loads
    if q.method == "exact":  # query.engine=dask and query.token_scores are refused with it (config.check_settings)
        exact = exact_dense_scores(cfg, index, queries, spec, given, q, train)
        top, bottom = dense_topk(torch.from_numpy(exact.scores), q)
        made, scoring, where = None, exact.scoring, str(exact.device)
    else:
        made = make_query_rows(cfg, index, queries, spec, given, which, keep_models=cfg.query.token_scores)
        if client is not None:
            ((step, rows),) = made.rows.items()
            scorers = [Scorer(made.readers[step], q).prepare(rows.cpu())]
            top, bottom = dask_topk(scorers[0], client=client)
        elif searched:  # two-stage: ANN candidates (the ANN index built on first use), re-scored exactly
            scorers = made.scorers(q, shortcut=False)
            top, bottom = ann_topk(scorers)
        else:
            scorers = made.scorers(q)
            top, bottom = streaming_topk(scorers)
        scoring = describe_scoring(scorers)
        if searched:
            scoring += (
                f"; exact scores of {q.ann_candidates} ANN candidates per shard and query (query.search={q.search})"
            )
        where = f"Dask scheduler {client.scheduler.address}" if client is not None else str(made.device)
    if chosen_by_auto:
        scoring += f" ({chosen_by_auto})"
    query_ids = [str(row.get("id", i)) for i, row in enumerate(queries)]
    results = results_for(index, query_ids, top, bottom)
    for entry in results:
        entry["scoring"] = scoring
    # Row texts only from the very data that was indexed: edited data no longer lines up.
    train_rows, why = indexed_rows(index.meta.data_segments(), Fields.from_config(cfg.data), train)
    if cfg.query.token_scores:
        if train_rows is None:
            raise ConfigError(
                f"setting 'query.token_scores'=true needs the training rows the index at {str(index.path)!r} was built from, and {why}; restore that data or set query.token_scores=false"
            )
        shown = max(len(entry.get(key, [])) for entry in results for key in ("results", "opponents"))
        explain = token_explainer(
            results, shown, train_rows, made, made.scorers(q, shortcut=False), "gradian query: token terms"
        )
        for q_index, entry in enumerate(results):
            for key in ("results", "opponents"):
                rows = entry.get(key, [])
                for result, e in zip(rows, explain(q_index, rows, [r["index"] for r in rows])):
                    result["tokens"], result["terms"] = e["tokens"], e["terms"]
    if train_rows is None:
        warnings.warn(f"row texts are not shown: {why}; the ranking is of the indexed rows", stacklevel=3)
    if cfg.query.output:
        write_results(cfg.query.output, results)
    return {
        "results": results,
        "queries": queries,
        "train_rows": train_rows,
        "index": index,
        "ranked_rows": written_rows(index),
        "device": where,
        "scoring": scoring,
    }


def describe_scoring(scorers: Sequence[Scorer]) -> str:
    """How `scorers` (one per checkpoint) score, in words, and how many checkpoints are summed:
    e.g. "whole-row cosine, preconditioner fisher (damping 1.0), summed over 2 checkpoints weighted
    by learning rate"."""
    words = scorers[0].describe()
    return words if len(scorers) == 1 else f"{words}, summed over {len(scorers)} checkpoints weighted by learning rate"
