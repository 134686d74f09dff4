"""Capture overhead: indexing against a plain forward+backward of the same model on the same batches.

Each variant runs in its own fresh process (so its peak RSS is its own), and the variants are
interleaved, with the order rotated every repeat, so that drift on a shared machine hits all alike:
  - plain:  full logits, fp32 cross-entropy summed over supervised tokens, `loss.backward()`
            (parameter .grad filled, as a training step would), no optimizer step;
  - index:  `trainer.validate` with a `GradientIndexer` (the default projection_dim and storage dtype) writing
            a zarr index, for module_filter down_proj / all MLP / all Linear at the default
            `recompute="mlp"` (each MLP block run again in the backward), and with `_keep`
            (recompute="none": every activation kept) or `_layers` (every decoder layer run again).
Three time ratios, index / plain (below 1: indexing is cheaper):
  - steady step: the time per batch between the second batch and the last, in either loop: what
    capture costs against a training step, and what a long index pays per batch;
  - loop: `trainer.validate` whole (Lightning's set-up, every batch, the index's close) against the
    plain loop;
  - process: whole-process wall time. Both processes import the same packages and load the model the
    same way, seconds that both pay once and that dilute this ratio towards 1 on a short run.

    PYTHONPATH=. python -m benchmarks.perf.capture_overhead --models smollm2 --variants down_proj,mlp --repeats 3
    PYTHONPATH=. python -m benchmarks.perf.capture_overhead --smoke --out /tmp/x

With `--cli` (SmolLM2 only; results/capture_overhead_cli.json): the whole `gradian index` process at
its defaults (its own command line: int8, k = 32, the MLP filter, the close's statistics) against
the plain process over the same `--rows` quickstart train rows, tokenized by the same code, in
batches of `--batch-size` cut at `--seq-len` tokens; each under a fresh watcher
(`benchmarks.common.measure_command`: wall time and peak RSS of the whole process), alternating.
After each index, a fresh process reopens it and times its close again (the statistics), and the
statistics' bytes are set against the rows'. `--baseline DIR` adds `gradian index` run from
another checkout (PYTHONPATH=DIR), e.g. main before a change.

    PYTHONPATH=. python -m benchmarks.perf.capture_overhead --cli --rows 64 --batch-size 8 --seq-len 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.common import (
    RESULTS_DIR,
    ROOT,
    SMOLLM2,
    batch_clock,
    bytes_on_disk,
    emit,
    fmt_bytes,
    load_model,
    measure_command,
    peak_rss_bytes,
    pyplot,
    run_child,
    steady_step_s,
    synthetic_examples,
    write_result,
)
from gradian_lightning.specs import IndexSpec

FILTERS = {
    "down_proj": "down_proj",
    "mlp": "gate_proj,up_proj,down_proj",
    "all_linear": "*.layers.*",
}  # every decoder Linear; lm_head left out
RECOMPUTE_SUFFIXES = {
    "_keep": "none",
    "_layers": "layers",
}  # variant suffix -> GradientIndexer(recompute=...); none: the default, mlp


def _variant(name: str, projection_dim: int) -> tuple:
    """(module filter patterns, recompute, projection_dim, storage_dtype) of an index variant such as
    `down_proj_keep`, or `mlp@k16-float16` for another index format (issue 29's candidates) than k =
    `projection_dim` in the default storage dtype."""
    name, _, fmt = name.partition("@")
    storage = IndexSpec().storage_dtype
    if fmt:
        dim, storage = fmt.split("-")
        projection_dim = int(dim.lstrip("k"))
    for suffix, recompute in RECOMPUTE_SUFFIXES.items():
        if name.endswith(suffix):
            return FILTERS[name[: -len(suffix)]], recompute, projection_dim, storage
    return FILTERS[name], "mlp", projection_dim, storage


SETTINGS = {  # model -> (batches, batch size, sequence length)
    "tiny": (24, 8, 128),
    "smollm2": (12, 2, 128),
}
SMOKE = {"tiny": (2, 2, 16)}


def _batches(model, num_batches: int, batch_size: int, seq_len: int, data: str | None = None):
    """(examples, batches): synthetic tokens, or with `data` the rows of that JSONL file tokenized
    and padded as `gradian index` does them (SmolLM2's tokenizer)."""
    from gradian_lightning.data import collate

    if data is None:
        examples, pad = synthetic_examples(num_batches * batch_size, seq_len, model.config.vocab_size), 0
    else:
        from transformers import AutoTokenizer

        from gradian_lightning.data import TokenizedRows, read_jsonl
        from gradian_lightning.hub import pad_token_id

        tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2))
        rows = TokenizedRows(read_jsonl(data), tokenizer, seq_len)
        examples, pad = [rows[i] for i in range(len(rows))], pad_token_id(tokenizer)
    batches = [collate(examples[i : i + batch_size], pad_token_id=pad) for i in range(0, len(examples), batch_size)]
    return examples, batches


def child(args: argparse.Namespace) -> None:
    # Both variants import the same things, so process start-up costs the same.
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from gradian_lightning.callback import GradientIndexer
    from gradian_lightning.data import collate
    from gradian_lightning.recipes.index import CausalLMModule

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(args.model)
    examples, batches = _batches(model, args.batches, args.batch_size, args.seq_len, args.data)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    starts: List[float] = []  # when each batch began: the steady step time is taken between them
    start = time.perf_counter()
    if args.variant == "plain":
        for batch in batches:
            starts.append(time.perf_counter())
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1),
                batch["labels"][:, 1:].flatten(),
                ignore_index=-100,
                reduction="sum",
            )
            loss.backward()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            patterns, recompute, projection_dim, storage_dtype = _variant(args.variant, args.projection_dim)
            # rows_per_chunk: chunks are flushed (and the row statistics summed) during the run, as in
            # an index of thousands of rows, not once at its close.
            indexer = GradientIndexer(
                f"{tmp}/index",
                patterns.split(","),
                projection_dim=projection_dim,
                storage_dtype=storage_dtype,
                recompute=recompute,
                rows_per_chunk=2 * args.batch_size,
            )

            trainer = L.Trainer(
                callbacks=[batch_clock(starts), indexer],
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_checkpointing=False,
                enable_model_summary=False,
                enable_progress_bar=False,
            )
            loader = DataLoader(
                examples, batch_size=args.batch_size, shuffle=False, collate_fn=partial(collate, pad_token_id=0)
            )
            trainer.validate(CausalLMModule(model), dataloaders=loader, verbose=False)
            assert indexer.summary and indexer.summary["complete"], indexer.summary
    loop = time.perf_counter() - start
    steady = steady_step_s(starts, loop, len(batches))
    emit({"variant": args.variant, "loop_s": loop, "step_s": steady, "tokens": tokens, "peak_rss": peak_rss_bytes()})


# Reopen the complete index at argv[1] as its writer would resume it and time `close()`: the statistics
# (and whitened norms) written again from the stored rows, by the gradian on PYTHONPATH (a baseline's own).
_CLOSE_AGAIN = """
import json, sys, time
import zarr
from gradian_lightning.index.layout import ATTRIBUTE
from gradian_lightning.index.writer import IndexWriter
meta = dict(zarr.open_group(sys.argv[1], mode="r").attrs[ATTRIBUTE])
width = sum(int(b["size"]) for b in meta["modules"])  # format 2 stores the width as the blocks' sum only
writer = IndexWriter(sys.argv[1], meta["num_rows"], width, meta["spec"]["storage_dtype"], meta)
start = time.perf_counter()
assert writer.close()
print(json.dumps({"close_s": time.perf_counter() - start, "width": width, "storage_dtype": meta["spec"]["storage_dtype"]}))
"""


def cli_comparison(args: argparse.Namespace) -> None:
    """The whole `gradian index` process against the plain process (module docstring, `--cli`)."""
    import numpy as np

    from gradian_lightning.data import read_jsonl
    from gradian_lightning.index.layout import NUMPY_DTYPE
    from gradian_lightning.recipes.quickstart import __file__ as quickstart

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    sides = ["plain", "gradian index"] + (["gradian index (baseline)"] if args.baseline else [])
    runs: Dict[str, List[Dict[str, Any]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        lines = (Path(quickstart).parent / "train.jsonl").read_text().splitlines()[: args.rows]
        data.write_text("\n".join(lines) + "\n")
        assert len(read_jsonl(data)) == args.rows
        for r in range(args.repeats):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                out = Path(tmp) / "index"
                if side == "plain":
                    cmd = [sys.executable, "-m", "benchmarks.perf.capture_overhead", "--child", "--model", "smollm2"]
                    cmd += ["--data", str(data), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
                    cmd += ["--threads", str(args.threads)]
                else:
                    cmd = [sys.executable, "-m", "gradian_lightning.cli", "index", f"model.name_or_path={SMOLLM2}"]
                    cmd += [f"data.train={data}", f"index.path={out}", f"grads.batch_size={args.batch_size}"]
                    cmd += [f"grads.max_seq_length={args.seq_len}"]
                # The baseline runs in its own folder: `python -m` and `-c` put the working folder first on sys.path.
                baseline = side.endswith("(baseline)")
                side_env, cwd = ({**env, "PYTHONPATH": args.baseline}, args.baseline) if baseline else (env, ROOT)
                load = os.getloadavg()[0]
                result = measure_command(cmd, env=side_env, cwd=cwd)
                if result["rc"] != 0:
                    raise SystemExit(f"{side} failed (exit {result['rc']}):\n{result['stderr']}")
                result["load"] = (load + os.getloadavg()[0]) / 2
                if side != "plain":
                    done = subprocess.run(
                        [sys.executable, "-c", _CLOSE_AGAIN, str(out)],
                        env=side_env,
                        cwd=cwd,
                        capture_output=True,
                        text=True,
                    )
                    if done.returncode != 0:
                        raise SystemExit(f"closing {side}'s index again failed:\n{done.stderr[-3000:]}")
                    closed = json.loads(done.stdout.strip().splitlines()[-1])
                    itemsize = np.dtype(NUMPY_DTYPE[closed["storage_dtype"]]).itemsize
                    result.update(
                        close_s=closed["close_s"],
                        statistics_bytes=bytes_on_disk(out / "statistics"),
                        row_bytes=args.rows * closed["width"] * itemsize,
                    )
                    shutil.rmtree(out)
                print(
                    f"repeat {r} {side}: process {result['wall_s']:.1f} s ({result['cpu_s']:.1f} s CPU), peak RSS {fmt_bytes(result['peak_rss'])}, load {result['load']:.1f}"
                    + (f", close again {result['close_s']:.1f} s" if "close_s" in result else ""),
                    flush=True,
                )
                runs[side].append(result)
    med = {
        side: {
            k: statistics.median(x[k] for x in runs[side])
            for k in runs[side][0]
            if not isinstance(runs[side][0][k], str)
        }
        for side in sides
    }
    plain = med["plain"]
    rows = [
        [
            side,
            f"{m['wall_s']:.1f}",
            f"{m['cpu_s']:.1f}",
            fmt_bytes(m["peak_rss"]),
            f"{m['wall_s'] / plain['wall_s']:.2f}",
            f"{m['cpu_s'] / plain['cpu_s']:.2f}",
            f"{m['peak_rss'] / plain['peak_rss']:.2f}",
            f"{m['close_s']:.1f}" if "close_s" in m else "",
            fmt_bytes(m["statistics_bytes"]) if "statistics_bytes" in m else "",
            f"{m['statistics_bytes'] / m['row_bytes']:.1f}" if "statistics_bytes" in m else "",
        ]
        for side, m in med.items()
    ]
    loads = sorted(x["load"] for side in sides for x in runs[side])
    text = (
        f"SmolLM2-135M-Instruct, the first {args.rows} quickstart train rows, batches of {args.batch_size}, at most {args.seq_len} tokens; "
        f"`gradian index` at its defaults (int8, k = 32, MLP filter); OMP_NUM_THREADS={args.threads} in both; "
        f"medians of {args.repeats} alternating fresh-process runs per side, whole process under a watcher. "
        f"Load average (1 min) while they ran: {loads[0]:.1f} to {loads[-1]:.1f}, median {statistics.median(loads):.1f} on 2 cores. "
        "CPU: user + system seconds of the whole process (what the load takes least away from). Close: a fresh process reopening the index and closing it again. Statistics / rows: bytes on disk of the statistics group over the rows' raw bytes."
        + (f" Baseline: the same command run in and from {args.baseline}." if args.baseline else "")
    )
    header = [
        "process",
        "wall s",
        "CPU s",
        "peak RSS",
        "wall ratio",
        "CPU ratio",
        "peak RSS ratio",
        "close s",
        "statistics on disk",
        "statistics / rows",
    ]
    write_result("capture_overhead_cli", text, [{"header": header, "rows": rows}], args.out, runs=runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="plain")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--projection-dim", type=int, default=None, help="k (default: grads.projection_dim's default)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1: the machine is shared, and oversubscribed OpenMP threads distort ratios)",
    )
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated index variants (default: all): down_proj, mlp, all_linear at the default recompute=mlp, with _keep (none) or _layers appended for the others, and @kK-DTYPE (e.g. mlp@k32-int8) for another index format",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cli", action="store_true", help="the whole `gradian index` process against the plain one")
    parser.add_argument("--rows", type=int, default=64, help="--cli: quickstart train rows")
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)  # a child's JSONL rows
    parser.add_argument("--baseline", default=None, help="--cli: also run `gradian index` from this checkout")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few tokens, one repeat: seconds")
    parser.add_argument(
        "--out", default=None, help="directory for the JSON result and figure (default benchmarks/results)"
    )
    args = parser.parse_args()
    if args.projection_dim is None:
        args.projection_dim = IndexSpec().projection_dim
    if args.child:
        return child(args)
    if args.cli:
        return cli_comparison(args)
    pyplot()  # without the bench extra, stop before measuring

    settings = SMOKE if args.smoke else {m: SETTINGS[m] for m in args.models.split(",")}
    repeats = 1 if args.smoke else args.repeats
    filters = (
        ["down_proj"]
        if args.smoke
        else (
            args.variants.split(",")
            if args.variants
            else ["down_proj", "down_proj_keep", "down_proj_layers", "mlp", "mlp_keep", "all_linear"]
        )
    )
    variants = ["plain", *filters]
    rows: List[List[Any]] = []
    ratios: List[Dict[str, Any]] = []  # for the figure
    for model, (batches, batch_size, seq_len) in settings.items():
        common = [
            "--model",
            model,
            "--batches",
            str(batches),
            "--batch-size",
            str(batch_size),
            "--seq-len",
            str(seq_len),
            "--projection-dim",
            str(args.projection_dim),
            "--threads",
            str(args.threads),
        ]
        runs: Dict[str, List[Dict[str, Any]]] = {v: [] for v in variants}
        for r in range(repeats):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                result = run_child("benchmarks.perf.capture_overhead", [*common, "--variant", variant])
                print(
                    f"{model} repeat {r} {variant}: step {result['step_s']:.2f} s, loop {result['loop_s']:.2f} s, process {result['process_wall_s']:.2f} s, peak RSS {fmt_bytes(result['peak_rss'])}",
                    flush=True,
                )
                runs[variant].append(result)
        plain = runs["plain"]
        p_proc = statistics.median(x["process_wall_s"] for x in plain)
        p_loop = statistics.median(x["loop_s"] for x in plain)
        p_step = statistics.median(x["step_s"] for x in plain)
        p_rss = statistics.median(x["peak_rss"] for x in plain)
        tokens = plain[0]["tokens"]
        rows.append(
            [
                model,
                "plain fwd+bwd",
                f"{tokens / p_loop:.0f}",
                f"{p_proc:.1f}",
                fmt_bytes(p_rss),
                "1.00",
                "1.00",
                "1.00",
                "1.00",
            ]
        )
        for variant in filters:
            i_proc = statistics.median(x["process_wall_s"] for x in runs[variant])
            i_loop = statistics.median(x["loop_s"] for x in runs[variant])
            i_step = statistics.median(x["step_s"] for x in runs[variant])
            i_rss = statistics.median(x["peak_rss"] for x in runs[variant])
            rows.append(
                [
                    model,
                    f"index {variant}",
                    f"{tokens / i_loop:.0f}",
                    f"{i_proc:.1f}",
                    fmt_bytes(i_rss),
                    f"{i_proc / p_proc:.3f}",
                    f"{i_loop / p_loop:.3f}",
                    f"{i_step / p_step:.3f}",
                    f"{i_rss / p_rss:.3f}",
                ]
            )
            ratios.append(
                {
                    "label": f"{model}\n{variant}",
                    "process": i_proc / p_proc,
                    "loop": i_loop / p_loop,
                    "step": i_step / p_step,
                    "rss": i_rss / p_rss,
                }
            )
    header = [
        "model",
        "variant",
        "tokens/s (loop)",
        "process wall s",
        "peak RSS",
        "wall ratio (process)",
        "time ratio (loop)",
        "time ratio (steady step)",
        "peak RSS ratio",
    ]
    text = (
        f"projection_dim {args.projection_dim}, storage {IndexSpec().storage_dtype} (a variant's @kK-DTYPE: k = K in DTYPE), {args.threads} torch thread(s) per process; medians of {repeats} interleaved fresh-process runs per variant; "
        + "; ".join(f"{k}: {b} batches × {bs} rows × {s} tokens" for k, (b, bs, s) in settings.items())
        + "."
    )
    write_result("capture_overhead", text, [{"header": header, "rows": rows}], args.out, ratios=ratios)
    plot(ratios, args.out)


def plot(ratios: List[Dict[str, Any]], out: str | None) -> None:
    """Grouped bars: wall time (process, loop) and peak RSS of indexing over the plain step, with the targets."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(ratios) + 2), 3.6))
    width = 0.2
    bars = (
        ("process", "wall time, whole process"),
        ("loop", "time, validate vs loop"),
        ("step", "time per batch, steady"),
        ("rss", "peak RSS"),
    )
    for i, (key, label) in enumerate(bars):
        xs = [j + (i - 1.5) * width for j in range(len(ratios))]
        ax.bar(xs, [r[key] for r in ratios], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.7, color="tab:red", linestyle="--", linewidth=0.8, label="time target 0.7×")
    ax.axhline(0.6, color="tab:purple", linestyle=":", linewidth=0.8, label="SmolLM2 peak RSS goal 0.6×")
    ax.set_xticks(range(len(ratios)), [r["label"] for r in ratios], fontsize=8)
    ax.set_ylabel("indexing / plain fwd+bwd")
    ax.set_title("Capture overhead against the plain step (below 1: cheaper)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = Path(out or RESULTS_DIR) / "capture_overhead.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
