"""Loss chunking at Llama-3's vocabulary: the loss peak with and without `grads.loss_chunk_tokens`.

A tiny random-init Llama (hidden 256, 2 layers) with a 128,256-token vocabulary, on the CPU. Each
point runs in a fresh process: model and batch are made, the kernel's peak-RSS mark is reset, then
one forward, the per-example loss and the backward to the final norm (the head's and the loss's
backward, as indexing does at the top of the model), and the peak RSS above the starting RSS is
read back. Variants:
  - trunk:      the decoder only (no head, no loss): what every variant shares;
  - gathered:   `supervised_token_loss` as by default (head and fp32 loss over all supervised tokens);
  - chunk N:    `supervised_token_loss(..., chunk_tokens=N)` (head + fp32 loss N tokens at a time,
                recomputed in backward).
"Loss part" = variant peak - trunk peak, against plan's formula logit_peak_copies × fp32 logits (1: fp32 model),
where the fp32 logits are min(supervised, N) × vocab × 4 bytes. A second, instrumented pass records
the largest fp32 [.., vocab] tensor created. Time: the median of 3 timed steps after a warm-up, in
the same child; the time ratio is chunked / gathered at the same batch.

    PYTHONPATH=. python -m benchmarks.perf.loss_chunking
    PYTHONPATH=. python -m benchmarks.perf.loss_chunking --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

from benchmarks.common import (
    emit,
    fmt_bytes,
    largest_fp32_vocab_tensor,
    peak_rss_rise,
    run_child,
    synthetic_examples,
    tiny_llama,
    write_result,
)

VOCAB = 128_256  # Llama-3's
BATCHES, SEQ, FRACTION, CHUNKS = (1, 2, 4, 8), 256, 0.5, (128, 256)


def child(args: argparse.Namespace) -> None:
    import torch

    from gradian_lightning.data import collate
    from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss

    torch.set_num_threads(1)
    model = tiny_llama(vocab_size=args.vocab, hidden=args.hidden, layers=2)
    batch = collate(synthetic_examples(args.batch, args.seq, args.vocab, args.fraction))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    target = model.model.norm.weight  # backward stops here: the head's and the loss's backward only
    chunk = None if args.variant in ("trunk", "gathered") else int(args.variant)
    vocab = args.vocab

    def run() -> None:
        if args.variant == "trunk":
            out = model.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
            ).last_hidden_state.sum()
        else:
            out = supervised_token_loss(model, batch, chunk_tokens=chunk).sum()
        torch.autograd.grad(out, [target])

    peak = peak_rss_rise(run)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    with largest_fp32_vocab_tensor(vocab, parameters) as probe:
        run()
    emit(
        {
            "peak": peak,
            "seconds": statistics.median(times),
            "vocab_tensor": probe.nbytes,
            "supervised": int(supervised_targets(batch["labels"]).sum()),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="gathered", help="trunk, gathered, or a chunk size")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--fraction", type=float, default=FRACTION)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="a small vocabulary and batch: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from gradian_lightning.gradients.memory import fp32_logit_bytes, logit_peak_copies

    copies = logit_peak_copies(4)  # the benchmark's model is fp32

    batches, seq, chunks, vocab = ((1, 2), 32, (8,), 4096) if args.smoke else (BATCHES, args.seq, CHUNKS, VOCAB)
    common = ["--seq", str(seq), "--fraction", str(args.fraction), "--vocab", str(vocab), "--hidden", str(args.hidden)]

    def point(variant: str, b: int) -> Dict[str, Any]:
        result = run_child("benchmarks.perf.loss_chunking", ["--variant", variant, "--batch", str(b), *common])
        print(
            f"{variant} B={b}: peak +{fmt_bytes(result['peak'])}, {result['seconds']:.3f} s, largest fp32 vocab tensor {fmt_bytes(result['vocab_tensor'])}",
            flush=True,
        )
        return result

    rows: List[List[Any]] = []
    for b in batches:
        trunk = point("trunk", b)
        gathered = point("gathered", b)
        for variant, result in [("gathered", gathered)] + [(str(c), point(str(c), b)) for c in chunks]:
            chunk = None if variant == "gathered" else int(variant)
            n = result["supervised"]
            part = result["peak"] - trunk["peak"]
            formula = copies * fp32_logit_bytes(n, vocab, chunk)
            loss_s, gathered_loss_s = result["seconds"] - trunk["seconds"], gathered["seconds"] - trunk["seconds"]
            rows.append(
                [
                    b,
                    n,
                    "off" if chunk is None else chunk,
                    fmt_bytes(part),
                    fmt_bytes(formula),
                    f"{part / formula:.2f}",
                    f"{fmt_bytes(result['vocab_tensor'])} / {fmt_bytes(fp32_logit_bytes(n, vocab, chunk))}",
                    f"{result['seconds']:.3f}",
                    f"{result['seconds'] / gathered['seconds']:.2f}",
                    f"{loss_s / gathered_loss_s:.2f}" if gathered_loss_s > 0 and loss_s > 0 else "n/a (below noise)",
                ]
            )
    header = [
        "batch",
        "supervised tokens",
        "loss_chunk_tokens",
        "loss part (measured)",
        f"formula {copies:g} × fp32 logits",
        "measured / formula",
        "largest fp32 vocab tensor: measured / min(sup, chunk)×V×4",
        "step s",
        "step time / unchunked",
        "loss-part time / unchunked",
    ]
    text = (
        f"Tiny random-init Llama (hidden {args.hidden}, 2 layers, fp32), vocab {vocab:,}; batches of {seq} tokens, {args.fraction:.0%} supervised; "
        "peaks are RSS above the process's RSS before the step, fresh process per point; loss part = peak − trunk peak; "
        "step = forward + per-example loss + backward to the final norm, median of 3 after a warm-up, 1 torch thread."
    )
    write_result("loss_chunking", text, [{"header": header, "rows": rows}], args.out)


if __name__ == "__main__":
    main()
