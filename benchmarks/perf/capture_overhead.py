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
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.common import (
    RESULTS_DIR,
    batch_clock,
    emit,
    fmt_bytes,
    load_model,
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


def _batches(model, num_batches: int, batch_size: int, seq_len: int):
    from gradian_lightning.data import collate

    examples = synthetic_examples(num_batches * batch_size, seq_len, model.config.vocab_size)
    return examples, [collate(examples[i : i + batch_size]) for i in range(0, len(examples), batch_size)]


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
    examples, batches = _batches(model, args.batches, args.batch_size, args.seq_len)
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
    parser.add_argument("--smoke", action="store_true", help="tiny model, few tokens, one repeat: seconds")
    parser.add_argument(
        "--out", default=None, help="directory for the JSON result and figure (default benchmarks/results)"
    )
    args = parser.parse_args()
    if args.projection_dim is None:
        args.projection_dim = IndexSpec().projection_dim
    if args.child:
        return child(args)
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
