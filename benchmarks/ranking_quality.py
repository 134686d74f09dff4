"""Ranking quality on planted-source sets: which index settings find the training rows behind a query.

    PYTHONPATH=. python benchmarks/ranking_quality.py                 # every kind x model (~30 min, 2 CPUs)
    PYTHONPATH=. python benchmarks/ranking_quality.py --kinds fact --models tiny-ft
    PYTHONPATH=. python benchmarks/ranking_quality.py --report        # tables from the saved results

For one (data set, model) the training and query rows go through one forward/backward each with
every `nn.Linear` captured; the captured (inputs, output-grads) are projected at every projection
dim and seed. A module's block depends only on (seed, module name, dim) (gradients/projection.py), so the row
of any `module_filter` is a column subset of the all-Linear row: one pass serves every filter.
Each setting (filter, dim, storage dtype, score) is then scored with plain torch and summarised as
recall@1, recall@10 and MRR of the query's first-ranked source row, averaged over projection seeds.
Results go to benchmarks/ranking_results/<kind>.<model>.json; `--report` prints the tables of
benchmarks/RANKING.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader

from gradian_lightning.data import JsonlDataset, collate, read_jsonl
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss
from gradian_lightning.gradients.projection import KroneckerProjector

HERE = Path(__file__).parent
DATA, RESULTS = HERE / "ranking_data", HERE / "ranking_results"
KINDS = ("fact", "backdoor", "format", "distractor")
MODELS = ("smollm2", "smollm2-ft", "tiny-ft")
SMOLLM2 = Path.home() / ".cache" / "gradian" / "smollm2-135m-instruct"
DIMS: Tuple[Optional[int], ...] = (8, 16, 32, 64)
SEEDS = (0, 1)
SCORES = ("cosine", "inner", "cosine-modnorm")
STORAGE = ("float32", "float16")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}User : {{ m['content'] }} "
    "{% else %}Assistant : {{ m['content'] }} </s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant : {% endif %}"
)


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


def module_filters(names: Sequence[str]) -> Dict[str, Callable[[str], bool]]:
    """Named module selections to compare, as predicates over dotted module names."""
    layers = sorted({_layer(n) for n in names if _layer(n) >= 0})
    half = layers[len(layers) // 2]
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    return {
        "down_proj": lambda n: n.endswith("down_proj"),
        "mlp": lambda n: ".mlp." in n,
        "attn": lambda n: n.split(".")[-1] in attn,
        "mlp+attn": lambda n: _layer(n) >= 0,
        "all-linear": lambda n: True,  # includes lm_head
        "down_proj-early": lambda n: n.endswith("down_proj") and _layer(n) < half,
        "down_proj-late": lambda n: n.endswith("down_proj") and _layer(n) >= half,
    }


# ---------------------------------------------------------------- models


def load_model(name: str, kind: str, train_rows: List[Dict], query_rows: List[Dict], log: Callable[[str], None]):
    """(model in eval mode, tokenizer, fine-tuning notes) for one model name of MODELS."""
    if name.startswith("smollm2"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(SMOLLM2, use_fast=True)
        model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
        if name == "smollm2":
            return model.eval(), tokenizer, {}
        # The tied embedding/head (28M of 135M parameters) stays frozen: cheaper, and what a
        # brief LoRA-like fine-tune leaves alone too.
        model.get_input_embeddings().weight.requires_grad_(False)
        notes = fine_tune(model, tokenizer, train_rows, query_rows, epochs=1, lr=2e-4, batch_size=8, log=log)
        return model.eval(), tokenizer, notes
    if name == "tiny-ft":
        from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer

        texts = [json.dumps(r) for r in train_rows + query_rows] + [TINY_CHAT_TEMPLATE]
        tokenizer = word_tokenizer(texts, chat_template=TINY_CHAT_TEMPLATE)
        model = tiny_llama(len(tokenizer), seed=0)
        notes = fine_tune(model, tokenizer, train_rows, query_rows, epochs=12, lr=3e-3, batch_size=8, log=log)
        return model.eval(), tokenizer, notes
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _loader(rows: List[Dict], tokenizer, batch_size: int, shuffle: bool = False, seed: int = 0) -> DataLoader:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = JsonlDataset(rows, tokenizer, max_seq_length=128)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        collate_fn=partial(collate, pad_token_id=pad),
    )


@torch.no_grad()
def mean_loss(model, tokenizer, rows: List[Dict]) -> float:
    """Mean per-example supervised loss (nats per row) over `rows`."""
    total = 0.0
    for batch in _loader(rows, tokenizer, 16):
        total += supervised_token_loss(model, batch).sum().item()
    return total / len(rows)


def fine_tune(
    model,
    tokenizer,
    train_rows,
    query_rows,
    epochs: int,
    lr: float,
    batch_size: int,
    log: Callable[[str], None],
    optimizer_out: Optional[List] = None,
) -> Dict:
    """Plain AdamW loop on the supervised tokens of `train_rows`; returns losses before and after.

    `optimizer_out`, when given, receives the optimizer (its second moments precondition rows)."""
    torch.manual_seed(0)
    before = {
        "train": mean_loss(model.eval(), tokenizer, train_rows),
        "queries": mean_loss(model, tokenizer, query_rows),
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    for epoch in range(epochs):
        for batch in _loader(train_rows, tokenizer, batch_size, shuffle=True, seed=epoch):
            loss = supervised_token_loss(model, batch).sum() / batch["labels"].ne(-100).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        log(f"  epoch {epoch + 1}/{epochs}: last batch loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    model.zero_grad(set_to_none=True)
    if optimizer_out is not None:
        optimizer_out.append(optimizer)
    for p in model.parameters():
        p.requires_grad_(True)  # gradients are taken w.r.t. module outputs; trainability is irrelevant
    after = {"train": mean_loss(model, tokenizer, train_rows), "queries": mean_loss(model, tokenizer, query_rows)}
    return {
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "loss_before": before,
        "loss_after": after,
        "seconds": round(time.perf_counter() - start),
    }


# ---------------------------------------------------------------- rows


def projectors(
    model, dims: Sequence[Optional[int]], seeds: Sequence[int]
) -> Tuple[Dict[str, torch.nn.Linear], Dict[Tuple, KroneckerProjector]]:
    """Every Linear of `model`, and one all-module projector per (dim, seed).

    Modules smaller than a dim (the tiny model's k/v at 64) are left out of that dim's projector.
    """
    modules = select_modules(model, ["*"])
    out = {}
    for dim in dims:
        fits = {n: m for n, m in modules.items() if dim is None or dim <= min(m.in_features, m.out_features)}
        for seed in seeds if dim is not None else seeds[:1]:
            out[(dim, seed)] = KroneckerProjector(fits, dim, seed)
    return modules, out


def gradient_rows(
    model, tokenizer, rows: List[Dict], projs: Dict[Tuple, KroneckerProjector], modules, batch_size: int = 8
) -> Dict[Tuple, torch.Tensor]:
    """{(dim, seed): rows [N, width] float32}: what `gradients.projected_gradients` gives, for many projectors from one backward."""
    capture = LinearCapture(modules)
    out: Dict[Tuple, List[torch.Tensor]] = {key: [] for key in projs}
    with torch.enable_grad():
        for batch in _loader(rows, tokenizer, batch_size):
            with capture:
                losses = supervised_token_loss(model, batch)
                output_grads = capture.output_grads(losses.sum())
            token_rows = supervised_targets(batch["labels"]).nonzero()[:, 0]
            for key, projector in projs.items():
                names = [b.name for b in projector.blocks]
                out[key].append(
                    projector.project(
                        {n: capture.inputs[n] for n in names},
                        {n: output_grads[n] for n in names},
                        len(losses),
                        token_rows,
                    )
                )
            capture.clear()
    return {key: torch.cat(parts) for key, parts in out.items()}


def block_columns(projector: KroneckerProjector, keep: Callable[[str], bool]) -> Optional[List[Tuple[int, int]]]:
    """(offset, size) of the kept modules' blocks, or None when a kept module is not in `projector`."""
    return [(b.offset, b.size) for b in projector.blocks if keep(b.name)] or None


# ---------------------------------------------------------------- scoring


def module_grams(
    queries: torch.Tensor, train: torch.Tensor, projector: KroneckerProjector
) -> Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per module: (dot products [Q, N], query squared norms [Q], training squared norms [N]), float64.

    Every score of every filter is a function of these, so the big rows are read once per setting.
    """
    out = {}
    for b in projector.blocks:
        q = queries[:, b.offset : b.offset + b.size].double()
        t = train[:, b.offset : b.offset + b.size].double()
        out[b.name] = (q @ t.T, (q * q).sum(1), (t * t).sum(1))
    return out


def filter_scores(
    grams: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]], names: Sequence[str], score: str
) -> torch.Tensor:
    """Scores [Q, N] float64 of queries against training rows restricted to the modules `names`.

    inner: raw dot products of the concatenated blocks; cosine: those divided by both row norms;
    cosine-modnorm: every module block of each row scaled to unit norm first, then cosine, which
    equals the mean over modules of the per-module cosines.
    """
    tiny = 1e-300
    if score == "cosine-modnorm":
        return sum(
            g / (nq[:, None] * nt[None, :]).sqrt().clamp_min(tiny) for g, nq, nt in (grams[n] for n in names)
        ) / len(names)
    dots = sum(grams[n][0] for n in names)
    if score == "inner":
        return dots
    if score == "cosine":
        nq = sum(grams[n][1] for n in names)
        nt = sum(grams[n][2] for n in names)
        return dots / (nq[:, None] * nt[None, :]).sqrt().clamp_min(tiny)
    raise ValueError(f"unknown score {score!r}")


def first_source_ranks(scores: torch.Tensor, sources: List[List[int]]) -> torch.Tensor:
    """Rank (1 = top) of the best-ranked source row of each query, int64 [Q]."""
    order = scores.argsort(dim=1, descending=True)
    ranks = []
    for q, src in enumerate(sources):
        is_source = torch.zeros(scores.shape[1], dtype=torch.bool)
        is_source[src] = True
        ranks.append(int(is_source[order[q]].nonzero()[0]) + 1)
    return torch.tensor(ranks)


def ranking_metrics(ranks: torch.Tensor) -> Dict[str, float]:
    ranks = ranks.double()
    return {
        "r@1": (ranks <= 1).double().mean().item(),
        "r@10": (ranks <= 10).double().mean().item(),
        "mrr": (1.0 / ranks).mean().item(),
    }


def evaluate(query_rows_by_key, train_rows_by_key, projs, names, sources) -> List[Dict]:
    """One record per (filter, dim, storage, score): metrics averaged over projection seeds.

    float16 storage is simulated by rounding both query and training rows to float16 and back
    (the index stores float16; query rows are computed in float32 but compared to stored rows).
    """
    filters = module_filters(names)
    found: Dict[Tuple, List[Dict]] = {}
    nonfinite: Dict[Tuple, int] = {}
    for (dim, seed), projector in projs.items():
        present = {b.name for b in projector.blocks}
        for storage in STORAGE:
            q, t = query_rows_by_key[(dim, seed)], train_rows_by_key[(dim, seed)]
            if storage == "float16":
                q, t = q.half(), t.half()
                bad = int((~torch.isfinite(q)).sum() + (~torch.isfinite(t)).sum())
                q, t = q.float(), t.float()
            else:
                bad = 0
            grams = module_grams(q, t, projector)
            for fname, keep in filters.items():
                chosen = [n for n in names if keep(n)]
                if not chosen or not set(chosen) <= present:
                    continue  # a module is smaller than dim
                for score in SCORES:
                    scores = filter_scores(grams, chosen, score).nan_to_num(nan=-float("inf"))
                    key = (fname, dim, storage, score)
                    found.setdefault(key, []).append(ranking_metrics(first_source_ranks(scores, sources)))
                    nonfinite[key] = nonfinite.get(key, 0) + bad
    records = []
    for (fname, dim, storage, score), per_seed in found.items():
        mean = {k: sum(m[k] for m in per_seed) / len(per_seed) for k in per_seed[0]}
        records.append(
            {
                "filter": fname,
                "dim": dim,
                "storage": storage,
                "score": score,
                "seeds": len(per_seed),
                "nonfinite": nonfinite[(fname, dim, storage, score)],
                **mean,
            }
        )
    return records


def run_one(kind: str, model_name: str, dims, seeds, log: Callable[[str], None]) -> Dict:
    train_rows = read_jsonl(DATA / f"{kind}.train.jsonl")
    query_rows = read_jsonl(DATA / f"{kind}.queries.jsonl")
    position = {r["id"]: i for i, r in enumerate(train_rows)}
    sources = [[position[s] for s in q["sources"]] for q in query_rows]
    start = time.perf_counter()
    torch.manual_seed(0)
    model, tokenizer, notes = load_model(model_name, kind, train_rows, query_rows, log)
    if model_name == "tiny-ft":
        dims = tuple(dims) + (None,)  # exact gradients are affordable for the tiny model
    modules, projs = projectors(model, dims, seeds)
    names = list(modules)
    t0 = time.perf_counter()
    train_by_key = gradient_rows(model, tokenizer, train_rows, projs, modules)
    query_by_key = gradient_rows(model, tokenizer, query_rows, projs, modules)
    grad_seconds = time.perf_counter() - t0
    log(f"  rows of {len(names)} modules x {len(projs)} projections: {grad_seconds:.0f} s")
    records = evaluate(query_by_key, train_by_key, projs, names, sources)
    return {
        "kind": kind,
        "model": model_name,
        "train_rows": len(train_rows),
        "queries": len(query_rows),
        "modules": len(names),
        "fine_tune": notes,
        "gradient_seconds": round(grad_seconds),
        "total_seconds": round(time.perf_counter() - start),
        "records": records,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}, threads {torch.get_num_threads()}".strip(),
    }


# ---------------------------------------------------------------- report


def load_results() -> List[Dict]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]


def _pick(records: List[Dict], **want) -> Optional[Dict]:
    for r in records:
        if all(r[k] == v for k, v in want.items()):
            return r
    return None


DEFAULT = {"filter": "down_proj", "dim": 16, "storage": "float16", "score": "cosine"}


def report(results: List[Dict]) -> str:
    """Markdown tables: each setting varied on its own around DEFAULT, per kind x model."""
    results = sorted(results, key=lambda r: (KINDS.index(r["kind"]), MODELS.index(r["model"])))
    columns = [f"{r['kind']}/{r['model']}" for r in results]
    out = []

    def table(title: str, rows: List[Tuple[str, Dict]], metric: str) -> None:
        out.append(f"\n#### {title} ({metric})\n")
        out.append("| setting | " + " | ".join(columns) + " | mean |")
        out.append("|---|" + "---|" * (len(columns) + 1))
        for label, change in rows:
            cells, values = [], []
            for res in results:
                rec = _pick(res["records"], **{**DEFAULT, **change})
                cells.append("n/a" if rec is None else f"{rec[metric]:.2f}")
                if rec is not None:
                    values.append(rec[metric])
            mean = f"{sum(values) / len(values):.3f}" if len(values) == len(results) else "n/a"
            out.append(f"| {label} | " + " | ".join(cells) + f" | {mean} |")

    both = ("cosine", "cosine-modnorm")
    scores = [(s, {"score": s}) for s in SCORES]
    filters = [
        (f"{f} / {s}", {"filter": f, "score": s})
        for s in both
        for f in module_filters(["model.layers.0.x", "model.layers.1.x"])
    ]
    dims = [(f"{d} / {s}", {"dim": d, "score": s}) for s in both for d in DIMS]
    storage = [(f"{t} / {s}", {"storage": t, "score": s}) for s in both for t in STORAGE]
    combos = [
        (f"{f} / dim {d} / {s}", {"filter": f, "dim": d, "score": s})
        for s in both
        for f in ("down_proj", "mlp", "down_proj-late")
        for d in (16, 32)
    ]
    for metric in ("mrr", "r@1", "r@10"):
        table("score (down_proj, dim 16, float16)", scores, metric)
        table("module_filter / score (dim 16, float16)", filters, metric)
        table("projection_dim / score (down_proj, float16)", dims, metric)
        table("storage_dtype / score (down_proj, dim 16)", storage, metric)
        table("module_filter / dim / score (float16)", combos, metric)
    exact = [r for r in results if r["model"] == "tiny-ft"]
    if exact:
        out.append("\n#### tiny-ft: projection vs exact gradients (float32, MRR)\n")
        out.append(
            "| filter / score | "
            + " | ".join(f"{r['kind']} dim {d}" for r in exact for d in ("16", "64", "exact"))
            + " |"
        )
        out.append("|---|" + "---|" * (3 * len(exact)))
        for f in ("down_proj", "mlp", "all-linear"):
            for score in ("cosine", "cosine-modnorm"):
                cells = []
                for r in exact:
                    for d in (16, 64, None):
                        rec = _pick(r["records"], filter=f, dim=d, storage="float32", score=score)
                        cells.append("n/a" if rec is None else f"{rec['mrr']:.2f}")
                out.append(f"| {f} / {score} | " + " | ".join(cells) + " |")
    out.append("\n#### runs\n")
    out.append(
        "| run | projection seeds | train rows | queries | modules | fine-tune loss train (before→after) | queries (before→after) | gradient s | total s | date | machine |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ft = r["fine_tune"]
        tr = f"{ft['loss_before']['train']:.1f}→{ft['loss_after']['train']:.1f}" if ft else "(pretrained)"
        qu = f"{ft['loss_before']['queries']:.1f}→{ft['loss_after']['queries']:.1f}" if ft else ""
        seeds = max(rec["seeds"] for rec in r["records"])
        out.append(
            f"| {r['kind']}/{r['model']} | {seeds} | {r['train_rows']} | {r['queries']} | {r['modules']} | {tr} | {qu} | {r['gradient_seconds']} | {r['total_seconds']} | {r['date']} | {r['machine']} |"
        )
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="projection seeds to average over")
    parser.add_argument("--redo", action="store_true", help="recompute results that already exist")
    parser.add_argument("--report", action="store_true", help="only print the tables of the saved results")
    args = parser.parse_args(argv)
    if args.report:
        print(report(load_results()))
        return
    RESULTS.mkdir(exist_ok=True)
    log = partial(print, flush=True)
    for model_name in args.models:
        for kind in args.kinds:
            path = RESULTS / f"{kind}.{model_name}.json"
            if path.exists() and not args.redo:
                log(f"{path.name}: exists, skipped (--redo recomputes)")
                continue
            log(f"{kind} / {model_name} ...")
            result = run_one(kind, model_name, DIMS, args.seeds, log)
            path.write_text(json.dumps(result, indent=1) + "\n")
            best = _pick(result["records"], **DEFAULT)
            log(
                f"{kind} / {model_name}: default r@1 {best['r@1']:.2f} mrr {best['mrr']:.2f}; {result['total_seconds']} s"
            )


if __name__ == "__main__":
    sys.exit(main())
