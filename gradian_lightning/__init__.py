"""Gradian: training-data attribution for causal language models by gradient indexing."""

from gradian_lightning.callback import GradientIndexer
from gradian_lightning.capture import LinearCapture, select_modules
from gradian_lightning.config import load_config
from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.errors import GradianError
from gradian_lightning.loss import supervised_token_loss
from gradian_lightning.projection import KroneckerProjector
from gradian_lightning.query import Ranking, query_gradients, streaming_topk
from gradian_lightning.store import IndexReader, IndexWriter, open_index

__all__ = [
    "GradientIndexer",
    "GradianError",
    "IndexReader",
    "IndexWriter",
    "JsonlDataset",
    "KroneckerProjector",
    "LinearCapture",
    "Ranking",
    "collate",
    "load_config",
    "open_index",
    "query_gradients",
    "read_jsonl",
    "select_modules",
    "streaming_topk",
    "supervised_token_loss",
]
