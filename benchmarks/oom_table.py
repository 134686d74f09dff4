"""Peak CPU memory of one indexing batch against batch size and supervised tokens per row.

    PYTHONPATH=. python benchmarks/oom_table.py [--model DIR] [--out benchmarks/oom_table.md]

For each (batch_size, supervised tokens per row) cell a fresh process loads SmolLM2-135M-Instruct
(fp32, vocab 49152), builds one batch of rows with that many prompt tokens and exactly that many
supervised completion tokens (random token ids: the cost does not depend on which), and runs the indexing step (`projected_gradients`: forward, fp32
loss, output-grads, projection on down_proj, k=16). It reports the rise of the process's peak
resident memory (VmHWM, reset through /proc/self/clear_refs just before the step) above its
resident memory just before the step (after a warm-up step on one short row), next to the fp32 logit tensor that `gradian plan` predicts
(`n_supervised × vocab × 4` bytes). glibc is told to serve every allocation over 64 KiB with mmap
(MALLOC_MMAP_THRESHOLD_) so freed tensors leave the resident set at once and the peak is the peak
of live tensors, not of the allocator's cache. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# (batch_size, prompt tokens, supervised tokens per row). The last two rows have the same length
# as the (4, 16, 496) row but put the tokens in the prompt: same sequence length, other supervised.
CELLS = [(b, 16, s) for s in (64, 256, 496) for b in (1, 2, 4, 8)] + [(4, 256, 256), (4, 496, 16)]
MiB = 2**20


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(model_dir: str, batch_size: int, prompt: int, supervised: int) -> dict:
    """One cell, in this process: bytes of peak rise and the predicted fp32 logit bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    from gradian_lightning.gradients.batch import projected_gradients
    from gradian_lightning.gradients.capture import LinearCapture, select_modules
    from gradian_lightning.gradients.loss import supervised_targets
    from gradian_lightning.gradients.memory import fp32_logit_bytes
    from gradian_lightning.gradients.projection import KroneckerProjector

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.get_output_embeddings().out_features
    length = prompt + supervised
    input_ids = torch.randint(10, vocab, (batch_size, length))
    labels = input_ids.clone()
    labels[:, :prompt] = -100
    labels = torch.cat([labels, torch.full((batch_size, 1), -100)], dim=1)
    input_ids = torch.cat([input_ids, torch.zeros(batch_size, 1, dtype=torch.long)], dim=1)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    n_supervised = int(supervised_targets(labels).sum())
    modules = select_modules(model, ["down_proj"])
    capture, projector = LinearCapture(modules), KroneckerProjector(modules, 16, 0)
    with torch.enable_grad():  # warm-up: pages the weights in and lets the allocator settle
        projected_gradients(model, {k: v[:1, :8] for k, v in batch.items()}, capture, projector)
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    with torch.enable_grad():
        projected_gradients(model, batch, capture, projector)
    peak = _rss_kib("VmHWM")
    return {
        "batch_size": batch_size,
        "prompt_tokens": prompt,
        "supervised_per_row": n_supervised // batch_size,
        "n_supervised": n_supervised,
        "vocab": vocab,
        "predicted_fp32_logits_bytes": fp32_logit_bytes(n_supervised, vocab),
        "measured_peak_rise_bytes": (peak - before) * 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(Path.home() / ".cache/gradian/smollm2-135m-instruct"))
    parser.add_argument("--out", default="benchmarks/oom_table.md")
    parser.add_argument("--from-json", help="rebuild the table from a results file instead of measuring")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # "B,S": run one cell in this process
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(measure(args.model, *map(int, args.cell.split(",")))))
        return
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        env = {
            **os.environ,
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        }
        results = []
        for b, p, s in CELLS:
            done = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--cell", f"{b},{p},{s}"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = results[-1]
            print(
                f"b={b} prompt={p} s={s}: predicted {r['predicted_fp32_logits_bytes'] / MiB:.0f} MiB, measured {r['measured_peak_rise_bytes'] / MiB:.0f} MiB",
                flush=True,
            )
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    from gradian_lightning.gradients.memory import logit_peak_copies

    copies = logit_peak_copies(4)  # fp32 model

    act = plan_activations(args.model)
    lines = [
        f"Command: `PYTHONPATH=. python benchmarks/oom_table.py` (model {Path(args.model).name}, vocab {results[0]['vocab']}, fp32, CPU).",
        f"Plan's prediction above the weights: tokens in the batch × {act / MiB:.2f} MiB of activations + {copies:g} × fp32 logits.",
        "",
        "| batch_size | prompt tokens per row | supervised tokens per row | supervised tokens in batch | fp32 logits (plan), MiB | plan: peak above weights, MiB | measured peak rise, MiB | measured / plan |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        tokens = r["batch_size"] * (r["prompt_tokens"] + r["supervised_per_row"] + 1)
        logits, meas = r["predicted_fp32_logits_bytes"], r["measured_peak_rise_bytes"]
        predicted = tokens * act + copies * logits
        lines.append(
            f"| {r['batch_size']} | {r['prompt_tokens']} | {r['supervised_per_row']} | {r['n_supervised']} | {logits / MiB:.0f} | {predicted / MiB:.0f} | {meas / MiB:.0f} | {meas / predicted:.2f} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plan_activations(model_dir: str) -> int:
    """`gradian plan`'s activation bytes per token for this model in fp32."""
    import torch
    from transformers import AutoConfig

    from gradian_lightning.recipes.plan import activation_bytes_per_token

    return activation_bytes_per_token(AutoConfig.from_pretrained(model_dir), torch.float32)


if __name__ == "__main__":
    main()
