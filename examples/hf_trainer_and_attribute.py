"""Fine-tune a causal LM with LoRA in the Hugging Face `Trainer`, index the training set at every
checkpoint save with `HFGradientIndexer`, then ask which training rows drove each query's answer,
scores summed over the checkpoints by learning rate (TracIn-CP).

    python examples/hf_trainer_and_attribute.py                       # SmolLM2-135M-Instruct if built, else a tiny Llama
    python examples/hf_trainer_and_attribute.py --model MODEL --train my_train.jsonl --queries my_queries.jsonl
    python examples/hf_trainer_and_attribute.py --smoke                # tiny Llama, 2 epochs: seconds (CI runs this)

Data is JSONL in any of gradian's formats (`prompt`/`completion`, `messages`, `text`, optional `id`);
the defaults are the quickstart's bundled facts and their paraphrased queries. Every epoch the
Trainer saves a checkpoint (`output_dir/checkpoint-<step>`: the LoRA adapter) and the callback
indexes the training rows with the weights just saved, as one checkpoint of one index: the
gradients of each row's loss with respect to the LoRA matrices (`lora_A`, `lora_B`), what LESS
indexes. A query's rows are then made with each saved adapter. The Lightning version of this
script is examples/finetune_and_attribute.py. Copy this file and change the model, the data, the
LoRA config and the TrainingArguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from gradian_lightning import HFGradientIndexer, JsonlDataset, collate, open_index, query_gradients, read_jsonl
from gradian_lightning.data import row_snippet
from gradian_lightning.errors import MissingExtraError
from gradian_lightning.extras import require_extra
from gradian_lightning.hf_callback import trainer_collate
from gradian_lightning.recipes.quickstart import QUERIES, TRAIN, tiny_llama, word_tokenizer

try:
    peft = require_extra("peft", "test", "this LoRA example")
except MissingExtraError as err:
    sys.exit(f"hf_trainer_and_attribute.py: error: {err}")

SMOLLM2 = Path(os.environ.get("GRADIAN_SMOLLM2", Path.home() / ".cache" / "gradian" / "smollm2-135m-instruct"))


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
    from transformers import AutoTokenizer

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
        help="Hugging Face name or directory, or 'tiny' (default: SmolLM2-135M-Instruct when built, else tiny)",
    )
    parser.add_argument("--train", default=str(TRAIN), help="training JSONL (default: the quickstart's 120 facts)")
    parser.add_argument(
        "--queries", default=str(QUERIES), help="query JSONL (default: the quickstart's 30 paraphrases)"
    )
    parser.add_argument("--out", default="runs/hf-trainer-example", help="where the checkpoints and the index go")
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
    out = Path(args.out)

    train_rows, query_rows = read_jsonl(args.train), read_jsonl(args.queries)
    if args.smoke:
        query_rows = query_rows[:6]
    base, tokenizer, model_name = load(args.model, train_rows, query_rows)
    # LoRA on the attention's query and value projections; the base weights are frozen by PEFT.
    lora = peft.LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, lora)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = JsonlDataset(train_rows, tokenizer, args.max_seq_length, source=args.train)

    # At every save (here: every epoch) the training rows are indexed with the weights just saved,
    # as checkpoint <global step> of one index, with the mean learning rate of the steps that made them.
    # The rows are the per-example gradients of the LoRA matrices, projected to projection_dim²
    # values per matrix (projection_dim can be at most the LoRA rank: A is r × in, B is out × r).
    indexer = HFGradientIndexer(
        out / "index",
        dataset,
        module_filter=["lora_A", "lora_B"],
        projection_dim=min(8, args.lora_r),
        storage_dtype="float16",
        at="save",
        checkpoints=True,
        batch_size=args.batch_size,
        collate_fn=partial(collate, pad_token_id=pad),  # batches with dataset positions ("index")
        overwrite=True,
        meta={"data": {"path": args.train, "max_seq_length": args.max_seq_length}},
    )
    lr = args.lr if args.lr is not None else (1e-2 if args.model == "tiny" else 2e-3)
    training = TrainingArguments(
        output_dir=str(out / "trainer"),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        learning_rate=lr,
        lr_scheduler_type="linear",
        save_strategy="epoch",
        save_only_model=True,  # the adapter only: what the queries need
        eval_strategy="no",
        logging_steps=5,
        report_to=[],
        disable_tqdm=args.smoke,
        seed=0,
    )
    trainer = Trainer(
        model=model.train(),  # from_pretrained returns eval mode; fine-tuning means training mode
        args=training,
        train_dataset=dataset,
        data_collator=partial(trainer_collate, pad_token_id=pad),  # the model's inputs only
        callbacks=[indexer],
    )
    trainer.train()
    fitted = time.perf_counter()

    index = open_index(out / "index")
    for entry, run in zip(index.checkpoints, indexer.runs):
        print(
            f"indexed at step {entry['step']} (lr {entry['lr']:.3g}): {len(index)} rows -> {index.path} in {run['seconds']:.1f} s"
        )
    indexing = sum(run["seconds"] for run in indexer.runs)
    training = trainer.state.log_history[-1]["train_runtime"] - indexing  # the Trainer's clock includes the callbacks
    print(
        f"training {training:.1f} s (with its saves), indexing {indexing:.1f} s: {indexing / training:.0%} on top of training"
    )
    # Queries: only the fields gradian reads (a query row may carry an answer key, as the bundled ones do).
    asked = [{k: q[k] for k in ("id", "prompt", "completion", "messages", "text") if k in q} for q in query_rows]
    # A query's rows at each checkpoint, made with the adapter the Trainer saved there on a fresh base.
    rows = {}
    for entry in index.checkpoints:
        fresh, _, _ = load(args.model, train_rows, query_rows)
        saved = peft.PeftModel.from_pretrained(fresh, out / "trainer" / f"checkpoint-{entry['step']}")
        rows[entry["step"]] = query_gradients(index.at(entry["step"]), saved, tokenizer, asked, args.batch_size)
    top = index.topk(rows, args.top_k, score="cosine", checkpoints="all")
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
        f"\n{model_name}: fine-tuned {args.epochs} epochs on {len(train_rows)} rows with LoRA r={args.lora_r} in the Trainer and indexed {len(indexer.runs)} checkpoints "
        f"in {fitted - started:.1f} s; {len(query_rows)} queries summed over them in {done - fitted:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
