"""The `gradian report` recipe: the results of `gradian query` and the index -> one static HTML page.

    cfg = load_config("my.yaml", ["query.output=runs/results.jsonl"])
    path = run_report(cfg)            # runs/results.html

For each query it shows the top rows and opponents of the results file with their percentile among
every row's score and a histogram of those scores, each checkpoint's share when several were
summed, the flags of each row, and, for the first `report.token_rows` rows, each token's share of
the score (query/token_scores.py), computed once per shown row under a progress bar. docs/report.md explains every number.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from gradian_lightning.config import require_for
from gradian_lightning.data import Fields, row_snippet
from gradian_lightning.data_sources import indexed_rows
from gradian_lightning.errors import ConfigError
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.topk import score_all
from gradian_lightning.recipes.query import (
    Explain,
    check_writable,
    describe_scoring,
    exact_dense_scores,
    make_query_rows,
    open_for_query,
    read_queries,
    token_explainer,
)
from gradian_lightning.report.html import render
from gradian_lightning.specs import QuerySpec


def _shown(
    entries: Sequence[Dict[str, Any]],
    index: IndexReader,
    train_rows: Sequence[Dict[str, Any]],
    scores: np.ndarray,
    by_checkpoint: Dict[int, np.ndarray],
    explained: Dict[int, Dict[str, Any]],
) -> List[Dict[str, Any]]:
    ranked = scores[np.isfinite(scores)]
    truncated, finite = index.column("truncated_tokens"), index.column("finite")
    out = []
    for e in entries:
        i = int(e["index"])
        flags = (["truncated"] if truncated[i] > 0 else []) + ([] if finite[i] else ["not finite"])
        row = {
            "rank": e["rank"],
            "id": e["id"],
            "index": i,
            "score": float(e["score"]),
            "percentile": 100.0 * float((ranked < e["score"]).mean()) if len(ranked) else 0.0,
            "flags": flags,
            "checkpoints": {str(step): float(s[i]) for step, s in by_checkpoint.items()},
            "text": row_snippet(train_rows[i], 400),
        }
        if i in explained:
            row.update(tokens=explained[i]["tokens"], terms=explained[i]["terms"])
            if "supervised" in explained[i]:
                row["supervised"] = explained[i]["supervised"]
        out.append(row)
    return out


def report_data(
    index: IndexReader,
    queries: Sequence[Dict[str, Any]],
    train_rows: Sequence[Dict[str, Any]],
    results: Sequence[Dict[str, Any]],
    scores: np.ndarray,
    by_checkpoint: Dict[int, np.ndarray],
    explain: Optional[Explain],
    token_rows: int,
    scoring: str,
    token_note: str,
) -> Dict[str, Any]:
    """The page's numbers as plain data. `scores` [Q, N]: every row's score per query (NaN where a
    row is never ranked); `by_checkpoint`: each summed checkpoint's weighted share [Q, N] (empty for
    one); `explain(q, rows, positions)`: token terms of those rows for query q."""
    pages = []
    for q, (query, entry) in enumerate(zip(queries, results)):
        top, bottom = list(entry.get("results", [])), list(entry.get("opponents", []))
        wanted = [int(e["index"]) for e in top[:token_rows] + bottom[:token_rows]]
        explained = {}
        if explain is not None and wanted:
            explained = dict(zip(wanted, explain(q, [train_rows[i] for i in wanted], wanted)))
        pages.append(
            {
                "id": entry["query_id"],
                "text": row_snippet(query, 2000),
                "all_scores": [float(s) for s in scores[q] if np.isfinite(s)],
                "top": _shown(
                    top, index, train_rows, scores[q], {k: v[q] for k, v in by_checkpoint.items()}, explained
                ),
                "bottom": _shown(
                    bottom, index, train_rows, scores[q], {k: v[q] for k, v in by_checkpoint.items()}, explained
                ),
            }
        )
    return {
        "index": str(index.path),
        "title": page_title(index.meta.model.get("name_or_path"), str(index.path)),
        "rows": len(index),
        "scoring": scoring,
        "token_note": token_note,
        "checkpoint_steps": sorted(by_checkpoint),
        "queries": pages,
    }


def page_title(model: Optional[str], index_path: str) -> str:
    """The page's title: the model by its hub name, or a local model by its folder's name, then the
    index by its folder's (or URL's) last part. The stored paths are absolute and name this machine's
    folders, which mean nothing to whoever the page is sent to."""
    name = str(model or "")
    local = name.startswith(("/", "~", ".")) or Path(os.path.expanduser(name)).exists()
    shown = Path(name.rstrip("/")).name if local else name
    where = index_path.rstrip("/").rsplit("/", 1)[-1]
    return f"{shown or 'model'}, index {where}"


def write_report(path: str | Path, data: Dict[str, Any]) -> Path:
    """Render `report_data` output to `path` (one self-contained HTML file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(data), encoding="utf-8")
    return path


def run_report(cfg: Any) -> Path:
    """Write the report of the `gradian query` results at `query.output`; returns the page's path.

    The query rows are made once per checkpoint; every row's score (`score_all`), each summed
    checkpoint's weighted share and the token terms of the shown rows all come from them."""
    require_for(cfg, "report")
    results_path = Path(cfg.query.output)
    if not results_path.is_file():
        raise ConfigError(
            f"setting 'query.output'={str(results_path)!r} holds no query results; run gradian query with the same settings first, then gradian report"
        )
    out = Path(cfg.report.output) if cfg.report.output else results_path.with_suffix(".html")
    check_writable(out, "report.output")
    results = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
    queries = read_queries(cfg)
    if [str(q.get("id", i)) for i, q in enumerate(queries)] != [r["query_id"] for r in results]:
        raise ConfigError(
            f"setting 'query.output'={str(results_path)!r} holds results of other queries than query.data={str(cfg.query.data)!r}; rerun gradian query, or point query.data at the queries it answered"
        )
    index, spec, given = open_for_query(cfg)
    # Row texts only from the very data that was indexed, by position, read as gradian query reads them.
    train_rows, why = indexed_rows(index.meta.data_segments(), Fields.from_config(cfg.data))
    if train_rows is None:
        raise ConfigError(
            f"gradian report shows the training rows the index at {str(index.path)!r} was built from, and {why}; restore that data, then rerun gradian report"
        )
    q = QuerySpec.from_config(cfg.query)
    if q.method == "auto":  # as the query that wrote these results chose: its scoring line says which
        q = replace(q, method="exact" if str(results[0].get("scoring", "")).startswith("exact pass") else "index")
    if q.method == "exact":  # every row's score by the exact pass; token terms are the index path's
        exact = exact_dense_scores(cfg, index, queries, spec, given, q)
        scores, scoring = exact.scores, exact.scoring
        by_checkpoint = exact.by_checkpoint if len(exact.by_checkpoint) > 1 else {}
        note = "Scored by the exact pass (query.method=exact): every training row's full-space gradient, read again from the indexed data. Tokens are not shaded: token terms are of the stored rows' scores (query.method=index)."
        return write_report(
            out,
            report_data(index, queries, train_rows, results, scores, by_checkpoint, None, 0, scoring, note),
        )
    made = make_query_rows(cfg, index, queries, spec, given, q.checkpoints, keep_models=cfg.report.token_rows > 0)
    scorers = made.scorers(q)
    scores = score_all(scorers).numpy()
    by_checkpoint = {}
    if len(scorers) > 1:  # each checkpoint scored alone, weighted as in the sum
        for scorer in scorers:
            by_checkpoint[scorer.index.step] = score_all([scorer]).numpy()
    explain = None
    if cfg.report.token_rows:
        explain = token_explainer(results, cfg.report.token_rows, train_rows, made, made.scorers(q, shortcut=False))

    steps = len(made.rows)
    note = "A token's term is the share of the score carried at its position (its activations, and the gradient the row's loss sends back to them: a token's includes the loss of predicting the next token). Token terms sum to the row's score from its unrounded gradient (the ranked score uses the rows as stored, rounded to grads.storage_dtype)."
    if steps > 1:
        note += f" They are summed over the {steps} checkpoints, as the score is."
    data_ = report_data(
        index,
        queries,
        train_rows,
        results,
        scores,
        by_checkpoint,
        explain,
        cfg.report.token_rows,
        describe_scoring(scorers),
        note,
    )
    return write_report(out, data_)
