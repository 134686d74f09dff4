"""Fine-tune a causal LM with LoRA in a plain LightningModule, index the training set at every
validation run with `GradientIndexer`, then ask which training rows drove each query's answer.

    python examples/finetune_and_attribute.py --model HuggingFaceTB/SmolLM2-135M-Instruct   # from the hub
    python examples/finetune_and_attribute.py                       # a saved copy of it (GRADIAN_SMOLLM2) if any, else a tiny Llama
    python examples/finetune_and_attribute.py --model MODEL --train my_train.jsonl --queries my_queries.jsonl
    python examples/finetune_and_attribute.py --smoke                # tiny Llama, 2 epochs: seconds (CI runs this)

Data is JSONL in any of gradian's formats (`prompt`/`completion`, `messages`, `text`, optional `id`);
the defaults are the quickstart's bundled facts and their paraphrased queries. The index is the
gradient of each training row's loss with respect to the LoRA matrices (`lora_A`, `lora_B`): what
LESS indexes. Copy this file and change the LightningModule, the data and the LoRA config.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, JsonlDataset, collate, open_index, query_gradients, read_jsonl
from gradian_lightning.data import row_snippet
from gradian_lightning.errors import MissingExtraError
from gradian_lightning.extras import require_extra
from gradian_lightning.recipes.quickstart import QUERIES, TRAIN, tiny_llama, word_tokenizer

try:
    peft = require_extra("peft", "test", "this LoRA example")
except MissingExtraError as err:
    sys.exit(f"finetune_and_attribute.py: error: {err}")
LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

SMOLLM2 = Path(os.environ.get("GRADIAN_SMOLLM2", Path.home() / ".cache" / "gradian" / "smollm2-135m-instruct"))


class LoRAFineTune(L.LightningModule):
    """A plain causal-LM fine-tune: the Hugging Face loss in training, the same loss logged in validation."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["index"]), prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        # The validation set here is the training set in order: GradientIndexer indexes it as it goes by.
        self.log("val_loss", self._loss(batch), batch_size=len(batch["index"]), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def texts(rows: list) -> list:
    """Every string of every row, for the tiny model's word-level vocabulary."""
    out = []
    for row in rows:
        out += [str(row[k]) for k in ("prompt", "completion", "text") if k in row]
        out += [str(m.get("content", "")) for m in row.get("messages", [])]
    return out


def load(model_name: str, train: list, queries: list):
    """(model, tokenizer, name): a Hugging Face model, or the quickstart's tiny Llama for `tiny`."""
    if model_name == "tiny":
        tokenizer = word_tokenizer(texts(train + queries))
        return tiny_llama(len(tokenizer)), tokenizer, "tiny Llama (random init)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_name),
        model_name,
    )


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=str(SMOLLM2) if (SMOLLM2 / "model.safetensors").is_file() else "tiny",
        help="Hugging Face name (HuggingFaceTB/SmolLM2-135M-Instruct) or directory, or 'tiny' (default: a copy of SmolLM2-135M-Instruct saved at GRADIAN_SMOLLM2 or ~/.cache/gradian/smollm2-135m-instruct, else tiny)",
    )
    parser.add_argument("--train", default=str(TRAIN), help="training JSONL (default: the quickstart's 120 facts)")
    parser.add_argument(
        "--queries", default=str(QUERIES), help="query JSONL (default: the quickstart's 30 paraphrases)"
    )
    parser.add_argument("--out", default="runs/finetune-example", help="where the indexes go")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument(
        "--lr", type=float, default=None, help="default: 2e-3 for a pretrained model, 1e-2 for the tiny one"
    )
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model, 2 epochs at batch size 16, 6 queries: a few seconds"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.epochs, args.batch_size = "tiny", 2, 16
    started = time.perf_counter()
    L.seed_everything(0, verbose=False)

    train_rows, query_rows = read_jsonl(args.train), read_jsonl(args.queries)
    if args.smoke:
        query_rows = query_rows[:6]
    base, tokenizer, model_name = load(args.model, train_rows, query_rows)
    # LoRA on the attention's query and value projections; the base weights are frozen by PEFT.
    model = get_peft_model(
        base,
        LoraConfig(
            r=args.lora_r,
            lora_alpha=2 * args.lora_r,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        ),
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = JsonlDataset(train_rows, tokenizer, args.max_seq_length, source=args.train)
    batches = partial(collate, pad_token_id=pad)
    shuffled = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, collate_fn=batches)
    in_order = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, collate_fn=batches)

    # Every validation run (here: every epoch) writes out/index-step<global step>. The rows are the
    # per-example gradients of the LoRA matrices, projected to projection_dim² values per matrix
    # (projection_dim can be at most the LoRA rank: A is r × in, B is out × r).
    indexer = GradientIndexer(
        Path(args.out) / "index-step{step}",
        module_filter=["lora_A", "lora_B"],
        projection_dim=min(8, args.lora_r),
        storage_dtype="float16",
        overwrite=True,
        meta={"data": {"path": args.train, "max_seq_length": args.max_seq_length}},
    )
    trainer = L.Trainer(
        max_epochs=args.epochs,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        callbacks=[indexer],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.smoke,
        default_root_dir=args.out,
    )
    lr = args.lr if args.lr is not None else (1e-2 if args.model == "tiny" else 2e-3)
    # from_pretrained returns the model in eval mode; training mode is what fine-tuning means (dropout, if any).
    trainer.fit(LoRAFineTune(model.train(), lr), train_dataloaders=shuffled, val_dataloaders=in_order)
    fitted = time.perf_counter()

    for run in indexer.runs:
        print(f"indexed at step {run['step']}: {run['rows']} rows -> {run['path']}")
    index = open_index(indexer.runs[-1]["path"])  # the index of the fine-tuned weights
    # Queries: only the fields gradian reads (a query row may carry an answer key, as the bundled ones do).
    asked = [{k: q[k] for k in ("id", "prompt", "completion", "messages", "text") if k in q} for q in query_rows]
    rows = query_gradients(index, model, tokenizer, asked, batch_size=args.batch_size)
    top = index.topk(rows, args.top_k, score="cosine")
    ids = index.column("id")
    print(f"\n{'query':<24} {'rank':>4} {'score':>7}  {'training row':<24} text")
    for q, query in enumerate(query_rows):
        print(f"{str(query.get('id', q))[:24]:<24} {'':>4} {'':>7}  {'':<24} {row_snippet(query, 60)}")
        for rank in range(args.top_k):
            i = int(top.indices[q, rank])
            print(
                f"{'':<24} {rank + 1:>4} {float(top.scores[q, rank]):+.4f}  {str(ids[i])[:24]:<24} {row_snippet(train_rows[i], 60)}"
            )
    done = time.perf_counter()
    print(
        f"\n{model_name}: fine-tuned {args.epochs} epochs on {len(train_rows)} rows with LoRA r={args.lora_r} and indexed {len(indexer.runs)} times "
        f"in {fitted - started:.1f} s; {len(query_rows)} queries in {done - fitted:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
