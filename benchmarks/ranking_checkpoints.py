"""Preconditioning and checkpoints on SmolLM2, pretrained and fine-tuned, through the product's own
index and query code (IndexWriter statistics, `Index.topk(precondition=..., damping=...)`), with
exact unprojected per-module cosine as the ceiling.

    PYTHONPATH=. python benchmarks/ranking_checkpoints.py --kinds fact        # -> benchmarks/ranking_results/checkpoints.<kind>.json
    PYTHONPATH=. python benchmarks/ranking_checkpoints.py --report            # the table in RANKING.md

Per kind: SmolLM2-135M-Instruct as built ("base") and the same after the fine-tune of
ranking_quality.py ("ft": 1 epoch, AdamW 2e-4, batch 8, embedding frozen). Rows of the 30
down_proj modules at projection_dim 16 and 32, stored float16. Settings: precondition none / diag /
fisher (damping 0.1 and 1.0); checkpoints: the model's own ("last") or base + ft summed with equal
weights ("base+ft", what `model.checkpoints=[base, ft]` and `query.checkpoints=all` compute).
The exact ceiling never materialises a gradient: <G_a, G_b> = sum_t sum_s (g_t.g_s)(x_t.x_s).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

from benchmarks.ranking_quality import DATA, RESULTS, SMOLLM2, _loader, fine_tune, first_source_ranks, ranking_metrics
from gradian_lightning import open_index
from gradian_lightning.data import read_jsonl
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.index.writer import IndexWriter

DIMS = (16, 32)
SETTINGS = [("none", 0.0), ("diag", 0.1), ("fisher", 0.1), ("fisher", 1.0)]


def capture_rows(model, tokenizer, rows: List[Dict], modules) -> Dict:
    """Projected rows per dim [N, D] and, per module, the token inputs/output-grads [N, T, *] (zero-padded)."""
    projectors = {dim: KroneckerProjector(modules, dim, 0) for dim in DIMS}
    capture = LinearCapture(modules)
    projected = {dim: [] for dim in DIMS}
    tokens: Dict[str, List] = {name: [] for name in modules}
    with torch.enable_grad():
        for batch in _loader(rows, tokenizer, 8):
            with capture:
                losses = supervised_token_loss(model, batch)
                grads = capture.output_grads(losses.sum())
            token_rows = supervised_targets(batch["labels"]).nonzero()[:, 0]
            for dim, projector in projectors.items():
                projected[dim].append(projector.project(capture.inputs, grads, len(losses), token_rows))
            mask = batch["attention_mask"][..., None].float()
            for name in modules:
                x, g = capture.inputs[name], grads[name]
                if x.dim() == 3:
                    tokens[name].append((x.float() * mask, g.float() * mask))
            capture.clear()
    return {"projected": {d: torch.cat(p) for d, p in projected.items()}, "tokens": tokens}


def _pad_cat(parts: List[torch.Tensor]) -> torch.Tensor:
    t = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, t - p.shape[1])) for p in parts])


def exact_modcos(queries: Dict, train: Dict) -> torch.Tensor:
    """Exact per-module cosine averaged over modules [Q, N], float64, from token grams."""
    total = 0
    names = list(queries["tokens"])
    for name in names:
        xq, gq = (_pad_cat([p[i] for p in queries["tokens"][name]]).double() for i in (0, 1))
        xt, gt = (_pad_cat([p[i] for p in train["tokens"][name]]).double() for i in (0, 1))
        cross = torch.einsum("qts,qts->q", torch.einsum("qti,qsi->qts", gq, gq), torch.einsum("qti,qsi->qts", xq, xq))
        selft = torch.einsum("nts,nts->n", torch.einsum("nti,nsi->nts", gt, gt), torch.einsum("nti,nsi->nts", xt, xt))
        inner = torch.zeros(len(xq), len(xt), dtype=torch.float64)
        for lo in range(0, len(xt), 16):  # [Q, n, T, T] per block of training rows bounds memory
            gg = torch.einsum("qti,nsi->qnts", gq, gt[lo : lo + 16])
            xx = torch.einsum("qti,nsi->qnts", xq, xt[lo : lo + 16])
            inner[:, lo : lo + 16] = (gg * xx).sum((2, 3))
        total = total + inner / (cross.sqrt()[:, None] * selft.sqrt()[None, :]).clamp_min(1e-300)
    return total / len(names)


def index_scores(tmp: Path, train_rows: torch.Tensor, query_rows: torch.Tensor, modules, dim: int, precondition: str, damping: float) -> torch.Tensor:
    """All scores [Q, N] through the product: an index written by IndexWriter, ranked by Index.topk."""
    path = tmp / f"ix-{dim}-{id(train_rows)}"
    if not path.exists():
        meta = {"fingerprint": "bench", "global_step": 0, "modules": KroneckerProjector(modules, dim, 0).describe()}
        writer = IndexWriter(path, len(train_rows), train_rows.shape[1], "float16", meta)
        n = len(train_rows)
        writer.write(range(n), train_rows, torch.ones(n), torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32), [str(i) for i in range(n)])
        writer.close()
    index = open_index(path)
    queries = query_rows.half().float()  # query rows are rounded to the storage dtype, as query_gradients does
    top = index.topk(queries, k=len(index), precondition=precondition, damping=damping)
    out = torch.empty(len(queries), len(index), dtype=torch.float64)
    out.scatter_(1, top.indices, top.scores.double())
    return out


def run_kind(kind: str, log) -> Dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = read_jsonl(DATA / f"{kind}.train.jsonl")
    queries = read_jsonl(DATA / f"{kind}.queries.jsonl")
    position = {r["id"]: i for i, r in enumerate(train)}
    sources = [[position[s] for s in q["sources"]] for q in queries]
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2, use_fast=True)
    base = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    start = time.perf_counter()
    rows = {}
    for name in ("base", "ft"):
        model = base if name == "base" else copy.deepcopy(base)
        notes = {}
        if name == "ft":
            model.get_input_embeddings().weight.requires_grad_(False)
            notes = fine_tune(model, tokenizer, train, queries, epochs=1, lr=2e-4, batch_size=8, log=log)
        modules = select_modules(model, ["down_proj"])
        rows[name] = {"train": capture_rows(model, tokenizer, train, modules), "queries": capture_rows(model, tokenizer, queries, modules), "notes": notes, "modules": modules}
        log(f"  {kind}/{name}: rows captured ({time.perf_counter() - start:.0f} s)")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        scores = {}
        for name in ("base", "ft"):
            r = rows[name]
            scores[(name, "exact", "none", 0.0)] = exact_modcos(r["queries"], r["train"])
            for dim in DIMS:
                for precondition, damping in SETTINGS:
                    scores[(name, dim, precondition, damping)] = index_scores(Path(tmp), r["train"]["projected"][dim], r["queries"]["projected"][dim], r["modules"], dim, precondition, damping)
            log(f"  {kind}/{name}: scored ({time.perf_counter() - start:.0f} s)")
        for (name, dim, precondition, damping), s in scores.items():
            records.append({"model": name, "checkpoints": "last", "dim": dim, "precondition": precondition, "damping": damping, **ranking_metrics(first_source_ranks(s, sources))})
        # base + ft: what query.checkpoints=all sums for an index built from model.checkpoints=[base, ft]
        # (no learning rates recorded: equal weights). The fine-tuned model's queries are what is explained.
        for key in {(d, p, l) for (_, d, p, l) in scores}:
            s = scores[("base", *key)] + scores[("ft", *key)]
            records.append({"model": "ft", "checkpoints": "base+ft", "dim": key[0], "precondition": key[1], "damping": key[2], **ranking_metrics(first_source_ranks(s, sources))})
    return {"kind": kind, "fine_tune": rows["ft"]["notes"], "seconds": round(time.perf_counter() - start), "records": records,
            "machine": f"torch {torch.__version__}, threads {torch.get_num_threads()}, shared 2-core CPU"}


def report() -> str:
    lines = []
    for path in sorted(RESULTS.glob("checkpoints.*.json")):
        result = json.loads(path.read_text())
        lines += [f"#### {result['kind']}: MRR / R@1 / R@10 (down_proj, float16; fine-tune train loss {result['fine_tune']['loss_before']['train']:.1f} -> {result['fine_tune']['loss_after']['train']:.1f})", "",
                  "| dim | precondition | damping | base, last | ft, last | ft, base+ft | worse of base and ft (best ft recipe) |", "|---|---|---|---|---|---|---|"]
        cell = {(r["model"], r["checkpoints"], str(r["dim"]), r["precondition"], r["damping"]): r for r in result["records"]}
        keys = sorted({(str(r["dim"]), r["precondition"], r["damping"]) for r in result["records"]}, key=lambda k: (k[0] != "exact", k))
        for dim, p, damp in keys:
            b, f, bf = (cell.get((m, c, dim, p, damp)) for m, c in (("base", "last"), ("ft", "last"), ("ft", "base+ft")))
            fmt = lambda r: "—" if r is None else f"{r['mrr']:.2f} / {r['r@1']:.2f} / {r['r@10']:.2f}"  # noqa: E731
            worse = min(b["mrr"], max(f["mrr"], bf["mrr"] if bf else 0))
            lines.append(f"| {dim} | {p} | {damp} | {fmt(b)} | {fmt(f)} | {fmt(bf)} | {worse:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="*", default=["fact"])
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.report:
        print(report())
        return
    for kind in args.kinds:
        result = run_kind(kind, log=lambda m: print(m, flush=True))
        (RESULTS / f"checkpoints.{kind}.json").write_text(json.dumps(result, indent=1))
        print(report())


if __name__ == "__main__":
    main()
