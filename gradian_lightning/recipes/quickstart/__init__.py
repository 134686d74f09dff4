"""The embedded default: fine-tune a tiny Llama on bundled facts with `GradientIndexer` attached,
then ask which training row taught each bundled query.

No download: the tokenizer is a word-level one built from the bundled data, and the model is a
random-init Llama from `LlamaConfig`. `run_quickstart()` is what `gradian quickstart` runs.
Each query paraphrases one training row (its `source` column); the source labels are used only
to score the ranking afterwards (recall@k), never to make it.
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterable, List

import lightning as L
import torch
from torch.utils.data import DataLoader

from gradian_lightning.callback import GradientIndexer
from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.index.layout import stored_meta
from gradian_lightning.index.location import Location
from gradian_lightning.query.rows import query_gradients
from gradian_lightning.query.scorer import checkpoint_scorers
from gradian_lightning.query.token_scores import query_token_scores, summed_over_checkpoints
from gradian_lightning.query.topk import open_index, score_all
from gradian_lightning.recipes.query import describe_scoring, results_for, write_results
from gradian_lightning.recipes.report import report_data, write_report
from gradian_lightning.specs import QuerySpec
from gradian_lightning.validation.retrain import FineTune

HERE = Path(__file__).parent
TRAIN, QUERIES = HERE / "train.jsonl", HERE / "queries.jsonl"
# The MLP modules: over 5 training runs (seeds, threads, float64) their checkpoint sum ranked
# the planted source in the top 10 for >= 29 of 30 queries (benchmarks/RANKING.md, quickstart).
MODULE_FILTER = ["gate_proj", "up_proj", "down_proj"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def word_tokenizer(texts: Iterable[str], chat_template: str | None = None) -> Any:
    """A fast word-level tokenizer over the words and punctuation of `texts`, with <pad>, <s>, </s>, <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    words = sorted({w for text in texts for w, _ in split.pre_tokenize_str(text)} - set(SPECIALS))
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIALS + words)}, unk_token="<unk>"))
    core.pre_tokenizer = split
    core.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_llama(
    vocab_size: int, hidden: int = 64, layers: int = 2, seed: int = 0, max_positions: int = 64, tie: bool = False
) -> Any:
    """A random-init `LlamaForCausalLM` (by default hidden 64, 2 layers: ~0.1M parameters plus
    embeddings), MLP width 2 × hidden, 4 heads over 2 key-value heads; the tests and benchmarks
    build theirs here too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def write_quickstart_report(
    path, index, model, tokenizer, weights, rows, queries, train_rows, results, token_rows: int = 2
):
    """The quickstart's report (recipes/report.py): scores of every row, each checkpoint's share, and
    the first `token_rows` rows' token terms summed over the checkpoints with their weights."""
    summed = QuerySpec(score="cosine", checkpoints="all", precondition="none")
    scorers = checkpoint_scorers(index.reader, rows, summed)
    scores = score_all(scorers).numpy()
    by_checkpoint = {scorer.index.step: score_all([scorer]).numpy() for scorer in scorers}

    def explain(q, wanted, positions):
        weighted = []
        for scorer in scorers:  # precondition none: no shortcut, so these scorers give token terms too
            model.load_state_dict(weights[scorer.index.step])
            weighted.append((scorer.weight, query_token_scores(scorer, model, tokenizer, wanted, q)))
        return summed_over_checkpoints(weighted)

    note = f"Token terms (first {token_rows} rows) are summed over the {len(scorers)} checkpoints, as the score is, and add up to it."
    text = describe_scoring(scorers)
    return write_report(
        path, report_data(index, queries, train_rows, results, scores, by_checkpoint, explain, token_rows, text, note)
    )


def recall_at(results: List[Dict[str, Any]], sources: List[str], k: int) -> float:
    """Fraction of queries whose planted source id is among their first k results."""
    hits = sum(source in [r["id"] for r in result["results"][:k]] for result, source in zip(results, sources))
    return hits / len(sources)


class WeightSnapshots(L.Callback):
    """The model's weights at each validation run, by global step: a query needs each checkpoint's weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.weights = model, {}

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights[int(trainer.global_step)] = copy.deepcopy(self.model.state_dict())


def run_quickstart(
    out_dir: str | Path = "runs/quickstart",
    epochs: int = 12,
    batch_size: int = 8,
    seed: int = 0,
    top_k: int = 10,
    dtype: str = "float32",
) -> Dict[str, Any]:
    """Fine-tune on the bundled training rows, index them at every epoch, answer the queries.

    Writes `out_dir/index` (one checkpoint per epoch) and `out_dir/results.jsonl` (the `gradian
    query` schema). Each query is scored at every checkpoint with that checkpoint's weights and
    the scores are summed (TracIn-CP): the last checkpoint alone ranks well or badly depending on
    the last bits of the CPU's kernels (benchmarks/RANKING.md, quickstart), the sum does not.
    `dtype` ("float32" or "float64") is the model's, for checking exactly that. Returns the
    indexer's summary, the per-query results, the query and training rows, recall@1 and
    recall@10 of the planted sources, and the (final) model, tokenizer and index path.
    """
    out_dir = Path(out_dir)
    L.seed_everything(seed, verbose=False)
    train_rows, query_rows = read_jsonl(TRAIN), read_jsonl(QUERIES)
    max_seq_length = 64
    tokenizer = word_tokenizer(r["prompt"] + r["completion"] for r in train_rows + query_rows)
    model = tiny_llama(len(tokenizer), seed=seed).to(getattr(torch, dtype))
    dataset = JsonlDataset(train_rows, tokenizer, max_seq_length, source=str(TRAIN))
    batches = partial(collate, pad_token_id=tokenizer.pad_token_id)
    shuffled = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=batches)
    in_order = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=batches)
    # A fresh index each run: checkpoints of an earlier run at other steps must not be summed in.
    # Only an index is removed there: `--out` pointed at a folder of the user's keeps its files.
    earlier = Location(out_dir / "index")
    earlier.remove_index(holds_index=stored_meta(earlier) is not None)
    # Validation runs after every epoch: each run adds one checkpoint to the index.
    indexer = GradientIndexer(
        out_dir / "index",
        module_filter=MODULE_FILTER,
        projection_dim=16,
        storage_dtype="float16",
        seed=seed,
        overwrite=True,
        checkpoints=True,
        meta={"data": {"path": str(TRAIN), "max_seq_length": max_seq_length}},
        verbose=False,
    )
    snapshots = WeightSnapshots(model)
    trainer = L.Trainer(
        max_epochs=epochs,
        check_val_every_n_epoch=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[indexer, snapshots],
        default_root_dir=out_dir,
    )
    trainer.fit(FineTune(model), train_dataloaders=shuffled, val_dataloaders=in_order)
    index = open_index(out_dir / "index")
    # Only prompt and completion go in: the query's `source` column is the answer key.
    asked = [{"id": q["id"], "prompt": q["prompt"], "completion": q["completion"]} for q in query_rows]
    final = copy.deepcopy(model.state_dict())
    rows = {}
    for entry in index.checkpoints:
        model.load_state_dict(snapshots.weights[int(entry["step"])])
        rows[int(entry["step"])] = query_gradients(
            index.at(int(entry["step"])), model, tokenizer, asked, batch_size=batch_size, source=str(QUERIES)
        )
    # No preconditioner: on this tiny model with a checkpoint per epoch it measured best (worst MRR
    # 0.87 over five training variants, fisher 0.76: quickstart_checkpoints.py, in git history: benchmarks/RANKING.md, History).
    results = results_for(
        index, [q["id"] for q in asked], index.topk(rows, top_k, score="cosine", checkpoints="all", precondition="none")
    )
    write_results(out_dir / "results.jsonl", results)
    report = write_quickstart_report(
        out_dir / "report.html", index, model, tokenizer, snapshots.weights, rows, asked, train_rows, results
    )
    model.load_state_dict(final)
    sources = [q["source"] for q in query_rows]
    return {
        "summary": indexer.summary,
        "results": results,
        "queries": query_rows,
        "train_rows": train_rows,
        "recall@1": recall_at(results, sources, 1),
        "recall@10": recall_at(results, sources, 10),
        "model": model.eval(),
        "tokenizer": tokenizer,
        "index": out_dir / "index",
        "results_path": out_dir / "results.jsonl",
        "report_path": report,
    }
