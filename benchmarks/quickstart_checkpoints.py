"""Why the quickstart sums checkpoints: its recipe trained under five variants (CPU threads 1 and 2,
float64 training: proxies for another CPU's rounding; seeds 1 and 2: other shuffles and inits),
with exact gradients of every Linear captured after every epoch, then scored many ways.

    PYTHONPATH=. python benchmarks/quickstart_checkpoints.py     # -> benchmarks/results/quickstart_checkpoints.md

Training is a plain AdamW loop with the quickstart's model, data, batch size, learning rate and
epochs (the Lightning recipe itself is checked by benchmarks/quickstart_robustness.py). Projection
to k = 16 is applied to the exact gradients (P_out G P_inᵀ with the library's matrices), so every
module filter and checkpoint set is scored from one training run. Scores: per-module cosine after
`precondition` (none / diag / fisher, damping 0.1), summed over the checkpoints (equal learning
rates: equal weights). Reported: recall@10 and MRR per variant, and their minimum.
"""

from __future__ import annotations

import functools
import sys
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.gradients.batch import projected_gradients
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.projection import KroneckerProjector, module_seed
from gradian_lightning.recipes.quickstart import QUERIES, TRAIN, tiny_llama, word_tokenizer

VARIANTS = {
    "threads 1": dict(threads=1),
    "threads 2": dict(threads=2),
    "float64": dict(dtype=torch.float64),
    "seed 1": dict(seed=1),
    "seed 2": dict(seed=2),
}
FILTERS = {
    "down+o (old quickstart)": ["down_proj", "o_proj"],
    "mlp (quickstart)": ["down_proj", "up_proj", "gate_proj"],
}
CHECKPOINTS = {
    "last": [12],
    "6,12": [6, 12],
    "4,8,12": [4, 8, 12],
    "3,6,9,12": [3, 6, 9, 12],
    "every epoch": list(range(1, 13)),
}
PRECONDITIONS = [("none", 0.0), ("diag", 0.1), ("fisher", 0.1)]


def train_variant(threads=2, dtype=torch.float32, seed=0, epochs=12, lr=3e-3):
    """{epoch: (train rows [N, D], query rows [Q, D]) exact, float64}, blocks, source positions."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    train_rows, query_rows = read_jsonl(TRAIN), read_jsonl(QUERIES)
    tok = word_tokenizer(r["prompt"] + r["completion"] for r in train_rows + query_rows)
    model = tiny_llama(len(tok), seed=seed).to(dtype)
    col = partial(collate, pad_token_id=tok.pad_token_id)
    data = JsonlDataset(train_rows, tok, 64, source="train")
    asked = JsonlDataset(
        [{k: q[k] for k in ("id", "prompt", "completion")} for q in query_rows], tok, 64, source="queries"
    )
    shuffled = DataLoader(
        data, batch_size=8, shuffle=True, collate_fn=col, generator=torch.Generator().manual_seed(seed)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    modules = select_modules(model, ["*"])
    projector, capture = KroneckerProjector(modules, None, 0), LinearCapture(modules)

    def rows(dataset):
        model.eval()
        out = [
            projected_gradients(
                model, {k: b[k] for k in ("input_ids", "attention_mask", "labels")}, capture, projector
            )[0]
            for b in DataLoader(dataset, batch_size=8, collate_fn=col)
        ]
        model.train()
        return torch.cat(out).double()

    found = {}
    for epoch in range(1, epochs + 1):
        model.train()
        for b in shuffled:
            loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        found[epoch] = (rows(data), rows(asked))
    ids = [r["id"] for r in train_rows]
    return found, projector.describe(), [ids.index(q["source"]) for q in query_rows]


def project(rows, blocks, names, k=16):
    out = []
    for b in blocks:
        if b["name"].split(".")[-1] not in names:
            continue
        g = rows[:, b["offset"] : b["offset"] + b["size"]].view(-1, b["out_features"], b["in_features"])
        gen = torch.Generator().manual_seed(module_seed(0, b["name"]))
        p_out = torch.randn(k, b["out_features"], generator=gen).double() / k**0.5
        p_in = torch.randn(k, b["in_features"], generator=gen).double() / k**0.5
        out.append((p_out @ g @ p_in.T).reshape(len(rows), -1))
    return out


def precondition(train, queries, how, damping):
    if how == "none":
        return train, queries
    t_out, q_out = [], []
    for t, q in zip(train, queries):
        if how == "diag":
            m = t.pow(2).mean(0)
            s = (m + damping * m.mean()).rsqrt()
            t_out.append(t * s), q_out.append(q * s)
        else:
            w, v = torch.linalg.eigh(t.T @ t / len(t))
            w = w.clamp_min(0)
            f = v @ torch.diag((w + damping * w.mean()).rsqrt()) @ v.T
            t_out.append(t @ f), q_out.append(q @ f)
    return t_out, q_out


def modcos(train, queries):
    unit = lambda a: a / a.norm(dim=1, keepdim=True).clamp_min(1e-300)  # noqa: E731
    return sum(unit(q) @ unit(t).T for t, q in zip(train, queries)) / len(train)


def metrics(scores, sources):
    ranks = torch.tensor([int((s > s[src]).sum()) + 1 for s, src in zip(scores, sources)], dtype=torch.float64)
    return float((ranks <= 10).double().mean()), float((1 / ranks).mean())


def main() -> None:
    runs = {name: train_variant(**kw) for name, kw in VARIANTS.items()}

    @functools.lru_cache(maxsize=None)
    def part(variant, epoch, filt, how, damping):
        found, blocks, _ = runs[variant]
        train, queries = found[epoch]
        t, q = precondition(
            project(train, blocks, FILTERS[filt]), project(queries, blocks, FILTERS[filt]), how, damping
        )
        return modcos(t, q)

    lines = [
        "| module_filter (k=16) | precondition | checkpoints | recall@10 min | recall@10 per variant | MRR min | MRR per variant |",
        "|---|---|---|---|---|---|---|",
    ]
    for filt in FILTERS:
        for how, damping in PRECONDITIONS:
            for ck_name, epochs in CHECKPOINTS.items():
                r10, mrr = [], []
                for variant in VARIANTS:
                    a, b = metrics(sum(part(variant, e, filt, how, damping) for e in epochs), runs[variant][2])
                    r10.append(a), mrr.append(b)
                lines.append(
                    f"| {filt} | {how} | {ck_name} | {min(r10):.3f} | {' '.join(f'{x:.2f}' for x in r10)} | {min(mrr):.3f} | {' '.join(f'{x:.2f}' for x in mrr)} |"
                )
                print(lines[-1], flush=True)
    header = f"Variants, in column order: {', '.join(VARIANTS)}. Command: `PYTHONPATH=. python benchmarks/quickstart_checkpoints.py`. torch {torch.__version__}, shared 2-core CPU.\n\n"
    (Path(__file__).parent / "results" / "quickstart_checkpoints.md").write_text(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
