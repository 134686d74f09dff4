"""Loss memory: gather-then-upcast loss (gradients/loss.py) against the naive full-logits fp32 loss.

SmolLM2-135M's real embedding/output head (vocab 49152, hidden 576, tied), truncated to its first
decoder layer so the 48-point sweep runs on a small CPU: the loss part does not depend on depth.
Each point runs in a fresh process: model and batch are made, the kernel's peak-RSS mark is reset
(/proc/self/clear_refs), then one forward, the per-example loss and the backward to the final
norm (the same work indexing does at the top of the model; no weight gradient is formed), and the
peak RSS above the starting RSS is read back. Three variants:
  - trunk:    the decoder only (hidden states, no head, no loss): what both variants share;
  - naive:    full logits [B, T, vocab], fp32 cross-entropy at every position, summed per example;
  - gathered: `supervised_token_loss` (logits only at supervised positions, upcast after the gather).
"Loss part" = variant peak - trunk peak. A second, instrumented pass records the largest fp32
[.., vocab] tensor that the variant creates, to check it against batch × supervised × vocab × 4.
The naive loss does not depend on the supervised fraction, so it runs once per (batch, sequence).

    PYTHONPATH=. python -m benchmarks.perf.loss_memory
    PYTHONPATH=. python -m benchmarks.perf.loss_memory --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

from benchmarks.common import (
    emit,
    fmt_bytes,
    largest_fp32_vocab_tensor,
    load_model,
    peak_rss_rise,
    run_child,
    synthetic_examples,
    write_result,
)

BATCHES, SEQS, FRACTIONS = (1, 2, 4, 8), (256, 512), (0.10, 0.25, 1.00)


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from gradian_lightning.data import collate
    from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss

    torch.manual_seed(0)
    model = load_model(args.model, layers=args.layers)
    vocab = model.config.vocab_size
    batch = collate(synthetic_examples(args.batch, args.seq, vocab, args.fraction))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}  # views of weights are not loss tensors
    target = model.model.norm.weight  # backward stops here: the head's and the loss's backward only
    for p in model.parameters():
        # Read every weight once before the baseline: from_pretrained may map them from the file,
        # and paging the 108 MiB head in during the step would count as loss memory.
        p.detach().sum()

    def run() -> None:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if args.variant == "trunk":
            out = model.model(**inputs, use_cache=False).last_hidden_state.sum()
        elif args.variant == "naive":
            logits = model(**inputs, use_cache=False).logits  # [B, T, vocab]
            token = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1),
                batch["labels"][:, 1:].flatten(),
                ignore_index=-100,
                reduction="none",
            )
            out = token.view(args.batch, -1).sum(dim=1).sum()
        else:
            out = supervised_token_loss(model, batch).sum()
        torch.autograd.grad(out, [target])

    peak = peak_rss_rise(run)
    with largest_fp32_vocab_tensor(vocab, parameters) as probe:
        run()
    emit(
        {
            "peak": peak,
            "vocab_tensor": probe.nbytes,
            "supervised": int(supervised_targets(batch["labels"]).sum()),
            "vocab": vocab,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="gathered")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers kept (default 1)")
    parser.add_argument("--smoke", action="store_true", help="tiny Llama, one point: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        return child(args)

    batches, seqs, fractions = ((2,), (32,), (0.25,)) if args.smoke else (BATCHES, SEQS, FRACTIONS)
    model = "tiny" if args.smoke else args.model

    def point(variant: str, b: int, s: int, f: float) -> Dict[str, Any]:
        result = run_child(
            "benchmarks.perf.loss_memory",
            [
                "--variant",
                variant,
                "--batch",
                str(b),
                "--seq",
                str(s),
                "--fraction",
                str(f),
                "--model",
                model,
                "--layers",
                str(args.layers),
            ],
        )
        print(
            f"{variant} B={b} T={s} sup={f:.0%}: peak +{fmt_bytes(result['peak'])}, largest fp32 vocab tensor {fmt_bytes(result['vocab_tensor'])}",
            flush=True,
        )
        return result

    rows: List[List[Any]] = []
    headline: List[str] = []
    for b in batches:
        for s in seqs:
            trunk = point("trunk", b, s, 1.0)
            naive = point("naive", b, s, 1.0)
            naive_part = max(naive["peak"] - trunk["peak"], 1)
            vocab = naive["vocab"]
            for f in fractions:
                gathered = point("gathered", b, s, f)
                part = gathered["peak"] - trunk["peak"]
                formula = gathered["supervised"] * vocab * 4  # batch × supervised-per-row × vocab × 4
                rows.append(
                    [
                        b,
                        s,
                        f"{f:.0%}",
                        gathered["supervised"],
                        fmt_bytes(trunk["peak"]),
                        fmt_bytes(naive["peak"]),
                        fmt_bytes(gathered["peak"]),
                        fmt_bytes(naive_part),
                        fmt_bytes(part),
                        f"{part / naive_part:.2f}",
                        f"{fmt_bytes(gathered['vocab_tensor'])} / {fmt_bytes(formula)}",
                        f"{fmt_bytes(naive['vocab_tensor'])} / {fmt_bytes(b * s * vocab * 4)}",
                    ]
                )
                if abs(f - 0.25) < 1e-9:
                    headline.append(f"{part / naive_part:.2f}")
    header = [
        "batch",
        "seq",
        "supervised",
        "supervised tokens",
        "trunk peak",
        "naive peak",
        "gathered peak",
        "naive loss part",
        "gathered loss part",
        "loss part ratio",
        "gathered fp32 vocab tensor: measured / B×sup×V×4",
        "naive fp32 logits: measured / B×T×V×4",
    ]
    text = (
        f"Model: {'tiny Llama' if args.smoke else f'SmolLM2-135M-Instruct truncated to {args.layers} decoder layer(s)'} (fp32), vocab {vocab}; "
        "peaks are RSS above the process's RSS before the step, fresh process per point; loss part = peak − trunk peak.\n"
        f"At 25% supervised the gathered loss part is {', '.join(headline)} of naive (batch × seq in table order)."
    )
    write_result("loss_memory", text, [{"header": header, "rows": rows}], args.out)


if __name__ == "__main__":
    main()
