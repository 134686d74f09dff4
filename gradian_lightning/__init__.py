"""Gradian: training-data attribution for causal language models by gradient indexing.

This docstring is the one description of the package layout. Imports point one way, down this
stack (tests/test_layout.py fails on any import circle and names it):

    cli.py                     the `gradian` command: parses arguments, calls one recipe
    recipes/                   plain functions, config -> result
      index.py  query.py  plan.py  doctor.py  validate.py  report.py  quickstart/
    report/html.py             the static HTML page of a query run (gradian report)
    validation/                LDS: random subsets and their losses on disk, one retraining run, the score
    callback.py                GradientIndexer: Lightning's validation loop and ranks mapped onto an IndexSession
    hf_callback.py             HFGradientIndexer: the Hugging Face Trainer's evaluations or saves and ranks mapped onto
                               the same IndexSession (no Lightning import)
    data_sources.py            data.train / query.data (any file, save_to_disk folder, hub name) -> a checked
                               datasets.Dataset; an index's rows read back from the sources its metadata names
    query/                     scoring: knows the store, never writes it
      rows.py                  query_gradients: data rows -> rows made like the index's
      precondition.py          Diagonal, Fisher, EKFAC (one class each) from the index's row statistics; auto's rule
      scorer.py                Scorer: one checkpoint's scoring, "auto" resolved once; prepare, score, describe
      topk.py                  streaming_topk, score_all (every row, dense) over scorers, Ranking, open_index -> Index
      exact.py                 ExactPass: queries' full gradients (K-FAC / EK-FAC preconditioned) scored against every training row, no row stored
      exact_scoring.py         query.method=exact: the estimator "auto" resolves to (exact_estimator), the training rows as
                               batches, the factor cache's key, every row's scores a memory budget of queries at a time
      dask_engine.py           dask_topk: a Scorer's scores as Dask reductions on a cluster (query.engine=dask)
      ann.py                   ann_topk: FAISS shards of the rows as a Scorer compares them propose candidates, scored exactly (query.search=ann)
      token_scores.py          each token's term of a row's score, one backward per row (Scorer.token_terms)
    index/                     writing and reading the zarr store: knows nothing of scoring or Lightning
      session.py               IndexSession: bind a model, begin -> add batches -> finish (or abort): one index
      layout.py                the one description of the on-disk layout, encoding, chunking
      location.py              index.path -> zarr store: a local directory or an fsspec URL (s3://, gs://, ...)
      writer.py  reader.py     IndexWriter (resumable, one writer per chunk), IndexReader
      statistics.py            per-coordinate sums of squares and the eigendecomposition of each module's RᵀR, read back at close
      checkpoints.py           several checkpoints (step, learning rate) of one model in one index
      factor_cache.py          the exact pass's fitted factors kept under factors/, keyed, "complete" written last
    gradients/                 the gradient path, plain torch: no Lightning, no zarr
      capture.py               select_modules, LinearCapture (hooks on the selected nn.Linear and Conv1D modules)
      peft.py                  PEFT LoRA models: the model to hook, the names lora_A/lora_B/base layers answer to
      loss.py                  supervised_token_loss: fp32 gather-then-upcast
      memory.py                the byte arithmetic of that loss's fp32 peak
      projection.py            KroneckerProjector
      recompute.py             MLP blocks (default) or decoder layers re-run in the indexing backward instead of keeping their activations
      batch.py                 GradientRows: (model, batch) -> rows, the one place rows are made
      factors.py               TokenPass (each module's inputs and output-gradients, GradientRows' safety); full-space K-FAC / EK-FAC factors, fitted in sums that add across ranks
      weights.py               weights_digest: which weights an index was built with
    saved_models.py            model.checkpoints entries (Hugging Face directories, Lightning .ckpt) -> step, lr, model
    bottom                     errors.py, specs.py (IndexSpec, QuerySpec: every grads.* and query.* setting,
                               checked once), config.py (omegaconf), data.py (rows -> batches; ids),
                               hub.py (from_pretrained, pad token, file hash), versions.py,
                               extras.py (optional packages: import, or one line naming the extra),
                               interrupts.py (Ctrl-C inside a Lightning Trainer call stays KeyboardInterrupt)

One batch, indexing:
    JSONL rows --data.JsonlDataset--> examples (input_ids, labels: prompt = -100)
      --data.collate--> padded batch + "index" (dataset positions)
      --Lightning validation loop--> GradientIndexer.on_validation_batch_end   (callback.py)
      --index.session.IndexSession.compute--> gradients.batch.GradientRows (eval mode, RNG forked, all restored):
            LinearCapture hooks on   ->  supervised_token_loss [B] fp32  ->  autograd.grad to the
            module outputs (no parameter .grad)  ->  KroneckerProjector  ->  rows [B, D] float32
      --IndexSession.write--> index.writer.IndexWriter--> zarr `grads` rows and their per-module `norms` at their dataset positions, flags last
      --IndexWriter.close--> index.statistics.write_statistics: the rows read back, a slab of modules a pass --> `statistics/`

One query:
    JSONL rows --query.rows.query_gradients (the same GradientRows, with the modules and
      spec read back from the index)--> query rows [Q, D]
      --query.scorer.Scorer (one per checkpoint: preconditioner and normalisation resolved once)--> prepared queries
      --query.topk.streaming_topk: index chunks decoded into one buffer, each scored by Scorer.score as [Q, c] matmuls,
      summed over checkpoints, merged into a running top-k--> Ranking --recipes.query--> JSONL results
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it, imported on first use (PEP 562): `gradian
# --help` and a settings error then cost no torch, Lightning or transformers import (under 1 s).
_WHERE = {
    "GradientIndexer": "callback",
    "HFGradientIndexer": "hf_callback",
    "load_config": "config",
    "JsonlDataset": "data",
    "TokenizedRows": "data",
    "collate": "data",
    "read_jsonl": "data",
    "GradianError": "errors",
    "LinearCapture": "gradients.capture",
    "select_modules": "gradients.capture",
    "supervised_token_loss": "gradients.loss",
    "KroneckerProjector": "gradients.projection",
    "IndexReader": "index.reader",
    "IndexSession": "index.session",
    "IndexWriter": "index.writer",
    "query_gradients": "query.rows",
    "query_token_scores": "query.token_scores",
    "Index": "query.topk",
    "Ranking": "query.topk",
    "open_index": "query.topk",
    "Scorer": "query.scorer",
    "score_all": "query.topk",
    "streaming_topk": "query.topk",
    "run_validate": "recipes.validate",
    "run_query": "recipes.query",
    "dense_scores": "recipes.query",
    "IndexSpec": "specs",
    "QuerySpec": "specs",
}

if TYPE_CHECKING:
    from gradian_lightning.callback import GradientIndexer
    from gradian_lightning.config import load_config
    from gradian_lightning.data import JsonlDataset, TokenizedRows, collate, read_jsonl
    from gradian_lightning.errors import GradianError
    from gradian_lightning.gradients.capture import LinearCapture, select_modules
    from gradian_lightning.gradients.loss import supervised_token_loss
    from gradian_lightning.gradients.projection import KroneckerProjector
    from gradian_lightning.hf_callback import HFGradientIndexer
    from gradian_lightning.index.reader import IndexReader
    from gradian_lightning.index.session import IndexSession
    from gradian_lightning.index.writer import IndexWriter
    from gradian_lightning.query.rows import query_gradients
    from gradian_lightning.query.scorer import Scorer
    from gradian_lightning.query.token_scores import query_token_scores
    from gradian_lightning.query.topk import Index, Ranking, open_index, score_all, streaming_topk
    from gradian_lightning.recipes.query import dense_scores, run_query
    from gradian_lightning.recipes.validate import run_validate
    from gradian_lightning.specs import IndexSpec, QuerySpec

__all__ = [
    "GradianError",
    "GradientIndexer",
    "HFGradientIndexer",
    "Index",
    "IndexReader",
    "IndexSession",
    "IndexSpec",
    "IndexWriter",
    "JsonlDataset",
    "KroneckerProjector",
    "LinearCapture",
    "QuerySpec",
    "Ranking",
    "Scorer",
    "TokenizedRows",
    "collate",
    "dense_scores",
    "load_config",
    "open_index",
    "query_gradients",
    "query_token_scores",
    "read_jsonl",
    "score_all",
    "select_modules",
    "run_query",
    "run_validate",
    "streaming_topk",
    "supervised_token_loss",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:  # the ordinary lookup, and its AttributeError (what hasattr expects)
        return object.__getattribute__(sys.modules[__name__], name)
    value = getattr(importlib.import_module(f"gradian_lightning.{_WHERE[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list:
    return sorted([*globals(), *_WHERE])
