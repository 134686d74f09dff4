"""GPU check: gradian on one (or more) CUDA devices against the CPU, `gradian plan` and a training step.

One command, sized to finish in under 8 minutes on one GPU, four measurements, each through Lightning's accelerator
(`trainer.accelerator=gpu`: the library never places a tensor itself):
  - rows: the LDS fact set (80 rows, 24 queries) indexed and queried on the GPU in fp32
    (32-true), bf16-mixed and bf16-true, against the same on the CPU in fp32: the relative
    difference ‖row − cpu‖ / ‖cpu‖ per module block and per whole row, and the top-10 rankings'
    overlap with the CPU's (rows stored in float32, so that the storage's rounding hides nothing);
  - plan: `gradian plan`'s predicted peak (recipes/plan.py) against `torch.cuda.max_memory_allocated`
    of the same `gradian index` run (above what was allocated before it), at three batch sizes and
    two precisions, on rows of about 440 tokens at grads.max_seq_length=512;
  - speed: capture (`trainer.validate` with a `GradientIndexer` at the defaults) against a plain
    training step (`trainer.fit`: forward, backward and an AdamW step) on the same batches, in
    tokens per second per steady batch (the second batch to the last, the device synchronised);
  - ddp: with two or more GPUs, `gradian index` under trainer.strategy=ddp on every GPU against the
    one-GPU index (rows equal); skipped, with the reason, on one.

    bash ../shared/models/make-smollm2.sh /tmp/smollm2      # once, where pip reaches PyPI
    PYTHONPATH=. python -m benchmarks.gpu_check --model /tmp/smollm2 --out /tmp/gpu_check
    PYTHONPATH=. python -m benchmarks.gpu_check --smoke --out /tmp/gpu_check_smoke

`--out` receives gpu_check.json and gpu_check.md (the block for benchmarks/RESULTS.md, with the
device's name and the torch and CUDA versions). `--random-weights` builds the model from the
folder's config and tokenizer alone, with random weights (seed 0): for a GPU machine that the
weights file cannot reach; memory and speed are the model's, the rows' numerics are not a trained
model's. `--only rows,plan` runs some sections. The files are rewritten after every section, so a
run stopped by a time limit keeps what it measured. Without a CUDA device the full run stops at
once with one line; `--smoke` runs every part that needs no CUDA on the CPU with a tiny local model
(about 30 s of CPU time: the rows compare the CPU's bf16 with its fp32, DDP runs two CPU processes)
and names the CUDA-only parts as skipped (tests/test_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks.common import (
    ROOT,
    SMOLLM2,
    batch_clock,
    fmt_bytes,
    render_result,
    steady_step_s,
    synthetic_examples,
    write_result,
)

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
LDS_DATA = Path(__file__).resolve().parent / "lds_data"
SECTIONS = ("rows", "plan", "speed", "ddp")
ROW_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")  # against the CPU's 32-true
PLAN_PRECISIONS = ("32-true", "bf16-mixed")
SPEED_PRECISIONS = ("32-true", "bf16-mixed")
TOP = 10


@dataclass(frozen=True)
class Sizes:
    """How much each measurement runs: the full run's on SmolLM2, the smoke run's on a tiny model."""

    train_rows: int  # of benchmarks/lds_data/fact.train.jsonl
    queries: int  # of fact.queries.jsonl
    batch_size: int  # rows: grads.batch_size
    long_rows: int  # plan: rows of about `long_parts` fact completions each
    long_parts: int
    max_seq_length: int  # plan
    plan_batch_sizes: tuple
    speed_batches: int
    speed_batch_size: int
    speed_seq_len: int


FULL = Sizes(80, 24, 8, 32, 55, 512, (2, 8, 32), 16, 8, 512)
SMOKE = Sizes(24, 4, 4, 8, 3, 64, (1, 2, 4), 4, 2, 16)


@dataclass
class Run:
    """One invocation: what to run it on, where to put things, and the indexes made so far."""

    model: str  # a from_pretrained folder
    accelerator: str  # "gpu", or "cpu" under --smoke
    sizes: Sizes
    work: Path
    train: Path
    queries: Path
    long: Path
    indexes: Dict[tuple, Path]  # (accelerator, precision, devices) -> index folder

    def overrides(self, *extra: str) -> List[str]:
        """The `key=value` settings of a quiet run of this model on the rows data, plus `extra`."""
        return [
            f"model.name_or_path={self.model}",
            f"data.train={self.train}",
            f"grads.batch_size={self.sizes.batch_size}",
            "trainer.enable_progress_bar=false",
            "index.overwrite=true",
            *extra,
        ]

    def settings(self, *extra: str) -> Any:
        """`load_config` of `overrides(*extra)`: what `gradian` reads from the same command line."""
        from gradian_lightning.config import load_config

        return load_config(None, self.overrides(*extra))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_info() -> Dict[str, Any]:
    """The CUDA devices (name, memory in bytes) and the torch, CUDA and Lightning versions."""
    import lightning
    import torch

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"name": props.name, "memory_bytes": int(props.total_memory)})
    return {
        "devices": devices,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        # "highest" keeps fp32 matmuls in fp32 on the GPU; "high" would allow TF32 and widen the fp32 rows' differences.
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def device_line(info: Dict[str, Any]) -> str:
    devices = info["devices"]
    where = (
        f"{len(devices)} × {devices[0]['name']} ({fmt_bytes(devices[0]['memory_bytes'])})"
        if devices
        else "no CUDA device (smoke run on the CPU)"
    )
    return (
        f"Device: {where}; torch {info['torch']}, CUDA {info['cuda']}, Lightning {info['lightning']}, "
        f"float32 matmul precision {info['float32_matmul_precision']!r}."
    )


# --- data and models ---------------------------------------------------------------------------


def read_rows(path: Path, n: int) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def write_jsonl(path: Path, rows: Sequence[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def long_rows(facts: Sequence[Dict[str, Any]], n: int, parts: int) -> List[Dict[str, Any]]:
    """`n` rows, each a fact's prompt and a completion of `parts` fact completions in a row (about
    10 SmolLM2 tokens each): long supervised rows, so that activations and logits set the peak."""
    out = []
    for i in range(n):
        completion = " ".join(facts[(i + j) % len(facts)]["completion"].strip() for j in range(parts))
        out.append({"id": f"long{i}", "prompt": facts[i % len(facts)]["prompt"], "completion": " " + completion})
    return out


def tiny_model_folder(folder: Path, texts: Sequence[str]) -> str:
    """A word-level tokenizer over `texts` and a tiny random-init Llama, saved as a from_pretrained folder."""
    from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer

    tokenizer = word_tokenizer(texts)
    tiny_llama(len(tokenizer), hidden=32, layers=2, seed=0, max_positions=128).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def random_weights_folder(source: str, folder: Path) -> str:
    """`source`'s config and tokenizer with random weights (seed 0), saved as a from_pretrained folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


def load_model(folder: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def free_device_memory() -> None:
    """Drop what earlier runs left behind, so that the next run's peak is its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- rows: device against CPU -----------------------------------------------------------------


def index_and_query(run: Run, accelerator: str, precision: str) -> Dict[str, Any]:
    """Index run.train and query run.queries on `accelerator` under `precision` (rows stored in
    float32); the index folder and each query's top-10 results."""
    from gradian_lightning.config import load_config
    from gradian_lightning.recipes.index import run_index
    from gradian_lightning.recipes.query import run_query

    path = run.work / f"rows-{accelerator}-{precision}"
    overrides = run.overrides(
        f"index.path={path}",
        "grads.storage_dtype=float32",
        f"trainer.accelerator={accelerator}",
        f"trainer.precision={precision}",
        f"query.data={run.queries}",
        f"query.top_k={TOP}",
    )
    cfg = load_config(None, overrides)
    run_index(cfg)
    run.indexes[(accelerator, precision, 1)] = path
    # Under *-true Lightning converts the weights for indexing, and the index records that dtype;
    # a query checks the model it loads against it before Fabric runs, so it loads the same dtype.
    weights = {"bf16-true": "bfloat16", "16-true": "float16"}.get(precision)
    answer = run_query(cfg if weights is None else load_config(None, [*overrides, f"model.dtype={weights}"]))
    free_device_memory()
    return {"path": path, "results": answer["results"], "device": answer["device"]}


def relative_differences(rows: Any, reference: Any, blocks: Sequence[Any]) -> Dict[str, Any]:
    """‖rows − reference‖ / ‖reference‖ per row, over each module block and over the whole row.

    `rows`, `reference`: float32 [N, D] tensors of the same rows; `blocks`: the index's module
    blocks (`ModuleBlock`s: name, offset, size). Returns {"blocks": [{"name", "median", "max"}] (over rows),
    "row_median", "row_max"}; a reference part of norm 0 counts its absolute difference.
    """
    import torch

    def rel(a: Any, b: Any) -> Any:  # [N]
        return torch.linalg.vector_norm(a - b, dim=1) / torch.linalg.vector_norm(b, dim=1).clamp_min(1e-30)

    per_block = []
    for block in blocks:
        part = slice(block.offset, block.offset + block.size)
        r = rel(rows[:, part], reference[:, part])
        per_block.append({"name": block.name, "median": float(r.median()), "max": float(r.max())})
    whole = rel(rows, reference)
    return {"blocks": per_block, "row_median": float(whole.median()), "row_max": float(whole.max())}


def ranking_agreement(results: Sequence[Dict[str, Any]], reference: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Per query, the share of the reference's top-10 rows that the results' top 10 also hold
    (mean and min over queries), and the share of queries with the same first row."""
    overlaps, same_first = [], 0
    for mine, theirs in zip(results, reference, strict=True):
        a = [r["index"] for r in mine["results"][:TOP]]
        b = [r["index"] for r in theirs["results"][:TOP]]
        overlaps.append(len(set(a) & set(b)) / max(len(b), 1))
        same_first += bool(a and b and a[0] == b[0])
    return {
        "top10_overlap_mean": sum(overlaps) / len(overlaps),
        "top10_overlap_min": min(overlaps),
        "same_top1": same_first / len(overlaps),
    }


def source_recall(results: Sequence[Dict[str, Any]], queries: Sequence[Dict[str, Any]]) -> float:
    """Share of queries whose planted source is among their top 10."""
    from gradian_lightning.recipes.quickstart import recall_at

    return recall_at(list(results), [q["sources"][0] for q in queries], TOP)


def check_rows(run: Run) -> Dict[str, Any]:
    from gradian_lightning.index.reader import IndexReader

    queries = read_rows(run.queries, run.sizes.queries)  # as make_run wrote them
    reference = index_and_query(run, "cpu", "32-true")
    ref_reader = IndexReader(reference["path"])
    ref_rows = ref_reader.rows(slice(None))
    out = [
        {
            "accelerator": "cpu",
            "precision": "32-true",
            "reference": True,
            "source_recall_at_10": source_recall(reference["results"], queries),
        }
    ]
    for precision in ROW_PRECISIONS:
        if run.accelerator == "cpu" and precision == "32-true":
            continue  # the reference itself
        made = index_and_query(run, run.accelerator, precision)
        rows = IndexReader(made["path"]).rows(slice(None))
        out.append(
            {
                "accelerator": run.accelerator,
                "precision": precision,
                "query_device": made["device"],
                "rows": int(rows.shape[0]),
                **relative_differences(rows, ref_rows, ref_reader.module_blocks),
                **ranking_agreement(made["results"], reference["results"]),
                "source_recall_at_10": source_recall(made["results"], queries),
            }
        )
    return {"runs": out}


# --- plan: predicted against measured peak ----------------------------------------------------


def check_plan(run: Run) -> Dict[str, Any]:
    import torch

    from gradian_lightning.recipes.index import run_index
    from gradian_lightning.recipes.plan import make_plan

    out = []
    for precision in PLAN_PRECISIONS:
        for batch_size in run.sizes.plan_batch_sizes:
            cfg = run.settings(
                f"data.train={run.long}",
                f"index.path={run.work / f'plan-{precision}-{batch_size}'}",
                f"grads.batch_size={batch_size}",
                f"grads.max_seq_length={run.sizes.max_seq_length}",
                f"trainer.accelerator={run.accelerator}",
                f"trainer.precision={precision}",
            )
            plan = make_plan(cfg)
            point: Dict[str, Any] = {
                "precision": precision,
                "batch_size": batch_size,
                "predicted_bytes": plan["peak_bytes"]["largest_batch_in_index_order"],
                "predicted_worst_case_bytes": plan["peak_bytes"]["worst_case"],
                "activation_bytes_per_token": plan["activation_bytes_per_token"],
                "supervised_tokens_max": plan["supervised_tokens"]["max"],
            }
            if run.accelerator != "gpu":
                point["skipped"] = "torch.cuda.max_memory_allocated needs a CUDA device"
            else:
                free_device_memory()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                try:
                    run_index(cfg)
                    point["measured_bytes"] = torch.cuda.max_memory_allocated() - before
                except torch.cuda.OutOfMemoryError as err:  # a finding, not a crash: the plan said it fits
                    point["out_of_memory"] = str(err).splitlines()[0]
                free_device_memory()
            out.append(point)
    return {"points": out}


# --- speed: capture against a training step ---------------------------------------------------


def train_step_module(model: Any) -> Any:
    """A LightningModule whose training step is the plain one: the model's own mean cross-entropy
    over the supervised tokens, backward into every weight, an AdamW step."""
    import lightning as L
    import torch

    class TrainStep(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Dict[str, Any], batch_idx: int) -> Any:
            return self.model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
                use_cache=False,
            ).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    return TrainStep()


def timed_loop(run: Run, precision: str, loader: Any, what: str) -> float:
    """Seconds per steady batch of `what` ("capture" or "train") over `loader` on a fresh model."""
    import lightning as L

    from gradian_lightning.callback import GradientIndexer
    from gradian_lightning.recipes.index import CausalLMModule

    starts: List[float] = []
    callbacks = [batch_clock(starts)]
    if what == "capture":
        callbacks.append(GradientIndexer(run.work / f"speed-{precision}", overwrite=True, verbose=False))
    trainer = L.Trainer(
        accelerator=run.accelerator,
        devices=1,
        precision=precision,
        callbacks=callbacks,
        max_steps=len(loader),
        limit_val_batches=len(loader) if what == "capture" else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    model = load_model(run.model)
    start = time.perf_counter()
    if what == "capture":
        trainer.validate(CausalLMModule(model), dataloaders=loader, verbose=False)
    else:
        trainer.fit(train_step_module(model.train()), train_dataloaders=loader)
    seconds = steady_step_s(starts, time.perf_counter() - start, len(loader))
    del trainer, model
    free_device_memory()
    return seconds


def check_speed(run: Run) -> Dict[str, Any]:
    from torch.utils.data import DataLoader
    from transformers import AutoConfig

    from gradian_lightning.data import collate

    s = run.sizes
    vocab = AutoConfig.from_pretrained(run.model).vocab_size
    examples = synthetic_examples(s.speed_batches * s.speed_batch_size, s.speed_seq_len, vocab)
    loader = DataLoader(examples, batch_size=s.speed_batch_size, shuffle=False, collate_fn=partial(collate))
    tokens = s.speed_batch_size * s.speed_seq_len  # per batch: every row is exactly speed_seq_len tokens
    out = []
    for precision in SPEED_PRECISIONS:
        capture = timed_loop(run, precision, loader, "capture")
        train = timed_loop(run, precision, loader, "train")
        out.append(
            {
                "precision": precision,
                "capture_tokens_per_s": tokens / capture,
                "train_tokens_per_s": tokens / train,
                "ratio": train / capture,  # capture tokens/s over training tokens/s
            }
        )
    return {"tokens_per_batch": tokens, "batches": s.speed_batches, "points": out}


# --- ddp: several devices against one ---------------------------------------------------------


def ddp_devices(run: Run) -> tuple:
    """(devices, None) to run DDP on, or (0, the reason it is skipped)."""
    import torch

    if run.accelerator == "cpu":
        return 2, None  # the smoke run: two CPU processes (gloo), the same code path
    count = torch.cuda.device_count()
    if count < 2:
        return 0, f"{count} CUDA device visible; DDP against one GPU needs 2 or more"
    return count, None


def check_ddp(run: Run) -> Dict[str, Any]:
    from gradian_lightning.index.reader import IndexReader
    from gradian_lightning.recipes.index import run_index

    devices, reason = ddp_devices(run)
    if reason:
        return {"skipped": reason}
    one = run.indexes.get((run.accelerator, "32-true", 1))
    overrides = [
        "grads.storage_dtype=float32",
        f"trainer.accelerator={run.accelerator}",
        "trainer.precision=32-true",
    ]
    if one is None:  # the rows section did not run: index on one device here
        one = run.work / "ddp-one"
        run_index(run.settings(f"index.path={one}", *overrides))
        free_device_memory()
    several = run.work / "ddp-several"
    # A child process: Lightning's ddp launcher starts the other ranks by running its command again.
    command = [sys.executable, "-m", "gradian_lightning.cli", "index"]
    command += run.overrides(f"index.path={several}", *overrides, f"trainer.devices={devices}", "trainer.strategy=ddp")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"gradian index under DDP failed ({done.returncode}): {done.stderr[-2000:]}")
    a, b = IndexReader(one).rows(slice(None)), IndexReader(several).rows(slice(None))
    diff = relative_differences(b, a, IndexReader(one).module_blocks)
    return {
        "devices": devices,
        "rows": int(a.shape[0]),
        "identical": bool((a == b).all()),
        "row_max": diff["row_max"],
        "block_max": max(x["max"] for x in diff["blocks"]),
    }


# --- the report -------------------------------------------------------------------------------


def rows_tables(rows: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The rows section: one line per device run against the CPU, then its five worst blocks."""
    header = [
        "accelerator",
        "precision",
        "per-block rel. diff: median of medians",
        "worst block: max",
        "whole row: median / max",
        "top-10 overlap with CPU: mean / min",
        "same top-1",
        "planted source in top 10",
    ]
    lines, worst = [], []
    for r in rows["runs"]:
        if r.get("reference"):
            lines.append(["cpu", "32-true", "reference", "", "", "", "", f"{r['source_recall_at_10']:.2f}"])
            continue
        medians = sorted(b["median"] for b in r["blocks"])
        top = max(r["blocks"], key=lambda b: b["max"])
        lines.append(
            [
                r["accelerator"],
                r["precision"],
                f"{medians[len(medians) // 2]:.2e}",
                f"{top['max']:.2e} ({top['name']})",
                f"{r['row_median']:.2e} / {r['row_max']:.2e}",
                f"{r['top10_overlap_mean']:.2f} / {r['top10_overlap_min']:.2f}",
                f"{r['same_top1']:.2f}",
                f"{r['source_recall_at_10']:.2f}",
            ]
        )
        for b in sorted(r["blocks"], key=lambda b: -b["max"])[:5]:
            worst.append([r["precision"], b["name"], f"{b['median']:.2e}", f"{b['max']:.2e}"])
    return [
        {"title": "Rows and rankings against the CPU's fp32 ones", "header": header, "rows": lines},
        {
            "title": "The five blocks farthest from the CPU's, per precision",
            "header": ["precision", "module block", "rel. diff: median", "max"],
            "rows": worst,
        },
    ]


def plan_table(plan: Dict[str, Any]) -> Dict[str, Any]:
    lines = []
    for p in plan["points"]:
        if "measured_bytes" in p:
            measured, ratio = fmt_bytes(p["measured_bytes"]), f"{p['measured_bytes'] / p['predicted_bytes']:.2f}"
        else:
            measured, ratio = (f"out of memory: {p['out_of_memory']}", "") if "out_of_memory" in p else ("skipped", "")
        lines.append(
            [
                p["precision"],
                p["batch_size"],
                fmt_bytes(p["predicted_bytes"]),
                fmt_bytes(p["predicted_worst_case_bytes"]),
                measured,
                ratio,
            ]
        )
    header = [
        "precision",
        "grads.batch_size",
        "plan: predicted peak (batches in index order)",
        "plan: worst case",
        "measured: max_memory_allocated",
        "measured / predicted",
    ]
    return {"title": "`gradian plan` against the measured peak", "header": header, "rows": lines}


def speed_table(speed: Dict[str, Any]) -> Dict[str, Any]:
    lines = [
        [
            p["precision"],
            f"{p['capture_tokens_per_s']:,.0f}",
            f"{p['train_tokens_per_s']:,.0f}",
            f"{p['ratio']:.2f}",
        ]
        for p in speed["points"]
    ]
    header = ["precision", "capture tokens/s", "training step tokens/s", "capture / training step"]
    return {"title": "Capture against a training step (steady batches)", "header": header, "rows": lines}


def ddp_table(ddp: Dict[str, Any]) -> Dict[str, Any]:
    header = ["devices", "rows", "identical to one device", "whole row: max rel. diff", "worst block: max"]
    line = [ddp["devices"], ddp["rows"], ddp["identical"], f"{ddp['row_max']:.2e}", f"{ddp['block_max']:.2e}"]
    return {"title": "DDP against one device", "header": header, "rows": [line]}


TABLES: Dict[str, Callable[[Dict[str, Any]], List[Dict[str, Any]]]] = {
    "rows": rows_tables,
    "plan": lambda r: [plan_table(r)],
    "speed": lambda r: [speed_table(r)],
    "ddp": lambda r: [ddp_table(r)],
}


def caption(
    run: Run, info: Dict[str, Any], measured: Dict[str, Any], random_weights: bool, wall: float, pending: Sequence[str]
) -> str:
    s = run.sizes
    weights = (
        "a tiny random-init Llama and a word-level tokenizer (--smoke)"
        if run.accelerator == "cpu"
        else "random weights from its config (--random-weights)"
        if random_weights
        else "its trained weights"
    )
    lines = [
        device_line(info),
        f"Model: {run.model}, {weights}. Wall time of the check: {wall:.0f} s.",
        f"Rows: {s.train_rows} fact rows and {s.queries} queries (benchmarks/lds_data), grads.batch_size={s.batch_size}, "
        "the default module filter and projection, rows stored in float32; relative difference ‖row − cpu‖ / ‖cpu‖.",
        f"Plan: {s.long_rows} rows of {s.long_parts} fact completions at grads.max_seq_length={s.max_seq_length}; "
        "measured is torch.cuda.max_memory_allocated above what was allocated before the run.",
        f"Speed: {s.speed_batches} batches of {s.speed_batch_size} × {s.speed_seq_len} random tokens, the seconds "
        "per batch from the second to the last; training step = forward, backward, AdamW step.",
    ]
    if run.accelerator == "cpu":
        lines.append(
            "Smoke run, no CUDA device: rows compares the CPU's bf16 with its fp32 (no GPU rows), the plan's measured "
            "peaks are skipped (torch.cuda.max_memory_allocated needs a CUDA device), DDP runs two CPU processes."
        )
    for name in SECTIONS:
        part = measured.get(name)
        if part is None:
            lines.append(
                f"{name}: not run yet (the run is under way or was stopped)."
                if name in pending
                else f"{name}: not run (--only)."
            )
        elif "skipped" in part:
            lines.append(f"{name}: skipped: {part['skipped']}.")
        elif "error" in part:
            lines.append(f"{name}: FAILED: {part['error']}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help=f"a from_pretrained folder (make-smollm2.sh builds one) or hub id (default: {SMOLLM2} if it holds the weights, else {HUB_ID})",
    )
    parser.add_argument(
        "--random-weights", action="store_true", help="the model's config and tokenizer with random weights (seed 0)"
    )
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated sections (default: {','.join(SECTIONS)})"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny local model on the CPU: seconds, no CUDA needed")
    parser.add_argument(
        "--out", default=None, help="folder for gpu_check.json and gpu_check.md (default benchmarks/results)"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(SECTIONS))
    if unknown:
        parser.error(f"--only {unknown[0]!r} is not a section; use any of {', '.join(SECTIONS)}")
    return args


def make_run(args: argparse.Namespace, work: Path) -> Run:
    """The data files under `work`, and the model folder: a tiny one under --smoke."""
    sizes = SMOKE if args.smoke else FULL
    facts = read_rows(LDS_DATA / "fact.train.jsonl", sizes.train_rows)
    ids = {r["id"] for r in facts}  # queries whose planted source is among the rows
    queries = [q for q in read_rows(LDS_DATA / "fact.queries.jsonl", 10**6) if q["sources"][0] in ids][: sizes.queries]
    long = long_rows(facts, sizes.long_rows, sizes.long_parts)
    if args.smoke:
        texts = [r["prompt"] + r["completion"] for r in facts + queries]
        model = tiny_model_folder(work / "model", texts)
    else:
        model = args.model or (str(SMOLLM2) if (SMOLLM2 / "model.safetensors").is_file() else HUB_ID)
        if args.random_weights:
            model = random_weights_folder(model, work / "model")
        from transformers import AutoConfig

        AutoConfig.from_pretrained(model)  # a model that cannot be found fails here, once, not in every section
    return Run(
        model=model,
        accelerator="cpu" if args.smoke else "gpu",
        sizes=sizes,
        work=work,
        train=write_jsonl(work / "train.jsonl", facts),
        queries=write_jsonl(work / "queries.jsonl", queries),
        long=write_jsonl(work / "long.jsonl", long),
        indexes={},
    )


CHECKS: Dict[str, Callable[[Run], Dict[str, Any]]] = {
    "rows": check_rows,
    "plan": check_plan,
    "speed": check_speed,
    "ddp": check_ddp,
}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if not args.smoke and not cuda_available():
        raise SystemExit(
            "gpu_check: error: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU machine, or pass --smoke for the CPU check"
        )
    start = time.perf_counter()
    info = device_info()
    measured: Dict[str, Any] = {}
    failed = []
    chosen = args.only.split(",")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        try:
            run = make_run(args, Path(tmp))
        except OSError as err:  # no such folder, or a hub id that cannot be reached: before any section runs
            first = str(err).strip().splitlines()[0]
            raise SystemExit(
                f"gpu_check: error: --model {args.model or HUB_ID!r} cannot be loaded ({first}); build a folder with bash ../shared/models/make-smollm2.sh DIR and pass --model DIR"
            ) from None
        for i, name in enumerate(chosen):
            began = time.perf_counter()
            print(f"gpu_check: {name} ...", flush=True)
            try:
                measured[name] = CHECKS[name](run)
            except Exception as err:  # the other sections' figures still count: record, go on, exit 1
                traceback.print_exc()
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                measured[name] = {"error": f"{type(err).__name__}: {first}"}
                failed.append(name)
            measured[name]["wall_s"] = time.perf_counter() - began
            print(f"gpu_check: {name} done in {measured[name]['wall_s']:.0f} s", flush=True)
            # Written after every section: a run stopped by a time limit keeps what it measured.
            last = i == len(chosen) - 1
            with contextlib.nullcontext() if last else contextlib.redirect_stdout(io.StringIO()):
                path = save(run, info, measured, args, time.perf_counter() - start, pending=chosen[i + 1 :])
    if failed:
        raise SystemExit(
            f"gpu_check: error: section(s) {', '.join(failed)} failed (the traceback is above); the others' figures are in {path}"
        )


def save(
    run: Run, info: Dict[str, Any], measured: Dict[str, Any], args: argparse.Namespace, wall: float, pending: List[str]
) -> Path:
    """Write gpu_check.json and gpu_check.md to `args.out` (default benchmarks/results); print the Markdown."""
    tables = [t for name in SECTIONS if _has_figures(measured.get(name)) for t in TABLES[name](measured[name])]
    text = caption(run, info, measured, args.random_weights, wall, pending)
    path = write_result("gpu_check", text, tables, args.out, device=info, sections=measured, wall_s=wall)
    path.with_suffix(".md").write_text(render_result(json.loads(path.read_text())) + "\n")
    return path


def _has_figures(part: Optional[Dict[str, Any]]) -> bool:
    return part is not None and "skipped" not in part and "error" not in part


if __name__ == "__main__":
    main()
