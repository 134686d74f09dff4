"""Issue 10's grid: precondition × checkpoints × projection_dim × module_filter, on SmolLM2 pretrained
and fine-tuned, for every planted-source kind, through the product's own index and query code, with
exact unprojected per-module cosine as the ceiling.

    PYTHONPATH=. python benchmarks/ranking_grid.py --kinds fact newword     # -> benchmarks/ranking_results/grid.<kind>.json
    PYTHONPATH=. python benchmarks/ranking_grid.py --report                 # the tables of RANKING.md
    PYTHONPATH=. python benchmarks/ranking_grid.py --plot                   # benchmarks/results/ranking_grid.png
    PYTHONPATH=. python benchmarks/ranking_grid.py --pretrained fact mlp 16  # one pretrained cell at today's defaults

Per kind, two models: SmolLM2-135M-Instruct as built ("base", the pretrained case) and the same after
the fine-tune of ranking_quality.py ("ft": 1 epoch of AdamW, lr 2e-4, batch 8, tied embedding frozen;
the fine-tuned case). Each model's training and query rows go through one forward/backward with every
nn.Linear captured (the library's LinearCapture + supervised_token_loss); the library's
KroneckerProjector (seed 0) projects them at k = 16, 32, 64. A module's block depends only on
(seed, name, k), so any module_filter's row is a column subset of the all-Linear row.

Scored through the product: the training rows of each (model, filter, k) are written by IndexWriter
(float16, with the statistics it gathers) and ranked by `Index.topk(precondition=..., damping=...)`
with per-module cosine (the default score). Query rows are rounded to float16 first, as the query
recipe does. Settings:
  precondition  none; diag (damping 0.1, and 1.0 from the fact and distractor runs on); fisher
                (damping 0.1 and 1.0, and 3.0 from the fact and distractor runs on; k = 16 only: at k = 32 the
                index's 150 rows are far fewer than k² = 1024, so F is mostly damping, and the
                eigendecompositions of 211 1024×1024 blocks cost more than the rest of the cell;
                k = 64 keeps no k²×k² statistics at all); adam (fine-tuned model only: the training
                rows' factors are divided by the square roots of a rank-1 fit of AdamW's second
                moments of that weight (row means ⊗ column means, Adafactor's factorisation), as
                LESS preconditions the training gradients; query rows stay plain).
  checkpoints   last (the model's own index and queries); base+ft (fine-tuned case only: the sum of
                the base and fine-tuned indexes' scores with equal weights, what
                `model.checkpoints=[base, ft]` + `query.checkpoints=all` computes).
  ceiling       exact: unprojected per-module cosine averaged over the filter's modules, from
                <G_a, G_b> = Σ_t Σ_s (g_t·g_s)(x_t·x_s), never materialising a gradient; base+ft the
                same sum of the two models' exact scores.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import gradian_lightning.index.statistics as statistics
from benchmarks.common import pyplot
from benchmarks.ranking_quality import (
    DATA,
    RESULTS,
    SMOLLM2,
    _loader,
    fine_tune,
    first_source_ranks,
    module_filters,
    ranking_metrics,
)
from gradian_lightning import open_index
from gradian_lightning.data import read_jsonl
from gradian_lightning.gradients.capture import LinearCapture, select_modules
from gradian_lightning.gradients.loss import supervised_targets, supervised_token_loss
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.query.precondition import resolve
from gradian_lightning.specs import QuerySpec

KINDS = ("fact", "newword", "reversal", "format", "backdoor", "distractor")
DIMS = (16, 32, 64)
FILTERS = ("down_proj", "mlp", "all-linear")
SETTINGS = [("none", 0.0), ("diag", 0.1), ("diag", 1.0), ("fisher", 0.1), ("fisher", 1.0), ("fisher", 3.0)]
FISHER_DIMS = (16,)
PLOT = Path(__file__).parent / "results" / "ranking_grid.png"


def per_row_tokens(t: torch.Tensor, mask: torch.Tensor, token_rows: torch.Tensor, batch: int) -> torch.Tensor:
    """[B, T, d] positions (zeroed where `mask` is 0), or gathered [n, d] regrouped as [B, n_max, d]."""
    if t.dim() == 3:
        return t.float() * mask[..., None]
    counts = torch.bincount(token_rows, minlength=batch)
    out = t.new_zeros(batch, int(counts.max()), t.shape[-1], dtype=torch.float32)
    slot = torch.arange(len(token_rows)) - torch.cumsum(counts, 0)[token_rows] + counts[token_rows]
    out[token_rows, slot] = t.float()
    return out


def adam_scales(model, optimizer, modules: Dict[str, torch.nn.Linear]) -> Dict[str, tuple]:
    """Per module (1/√r [out], 1/√c [in]), each scaled to mean 1, from a rank-1 fit v ≈ r cᵀ / mean(v) of AdamW's exp_avg_sq."""
    scales = {}
    for name, module in modules.items():
        state = optimizer.state.get(module.weight, {})
        if "exp_avg_sq" not in state:
            continue  # frozen during the fine-tune (the tied head): no second moments, left plain
        v = state["exp_avg_sq"].float()
        eps = optimizer.defaults["eps"] ** 2  # Adam divides by √v + eps
        r, c = (v.mean(1) + eps).rsqrt(), (v.mean(0) + eps).rsqrt()
        # Cosine ignores a module's overall scale; mean 1 keeps the rows inside float16's range.
        scales[name] = (r / r.mean(), c / c.mean())
    return scales


class Captured:
    """One model's projected rows per (variant, k) [N, 211·k²] and exact per-module inner products."""

    def __init__(self, modules: Dict[str, torch.nn.Linear], dims: Optional[Sequence[int]] = None) -> None:
        self.modules = modules
        self.names = list(modules)
        self.dims = tuple(DIMS if dims is None else dims)  # DIMS read now: the smoke test narrows it
        self.projectors = {k: KroneckerProjector(modules, k, 0) for k in self.dims}

    def run(
        self, model, tokenizer, rows: List[Dict], queries: Optional["Captured"] = None, scales: Optional[Dict] = None
    ) -> "Captured":
        """Capture `rows`. As the query pass (`queries` None) keep every module's tokens for the exact
        ceiling; as the training pass, reduce them against the query pass's tokens on the fly."""
        capture = LinearCapture(self.modules)
        variants = {"plain": None, **({"adam": scales} if scales else {})}
        projected = {(v, k): [] for v in variants for k in self.dims}
        self.tokens = {name: [] for name in self.names}
        inner, selfs = [], []
        with torch.enable_grad():
            for batch in _loader(rows, tokenizer, 8):
                with capture:
                    losses = supervised_token_loss(model, batch)
                    grads = capture.output_grads(losses.sum())
                n = len(losses)
                token_rows = supervised_targets(batch["labels"]).nonzero()[:, 0]
                for v, sc in variants.items():
                    xs, gs = capture.inputs, grads
                    if sc:
                        xs = {m: x.float() * sc[m][1] if m in sc else x for m, x in xs.items()}
                        gs = {m: g.float() * sc[m][0] if m in sc else g for m, g in gs.items()}
                    for k in self.dims:
                        projected[(v, k)].append(self.projectors[k].project(xs, gs, n, token_rows))
                mask = batch["attention_mask"].float()
                block_inner, block_self = [], []
                for name in self.names:
                    x = per_row_tokens(capture.inputs[name], mask, token_rows, n)
                    g = per_row_tokens(grads[name], mask, token_rows, n)
                    gg, xx = torch.einsum("nti,nsi->nts", g, g), torch.einsum("nti,nsi->nts", x, x)
                    block_self.append((gg * xx).sum((1, 2)).double())
                    if queries is None:
                        self.tokens[name].append((x, g))
                    else:
                        qx, qg = queries.tokens[name]
                        q, t = qx.shape[:2]
                        cross = (qg.reshape(q * t, -1) @ g.reshape(-1, g.shape[-1]).T) * (
                            qx.reshape(q * t, -1) @ x.reshape(-1, x.shape[-1]).T
                        )
                        block_inner.append(cross.view(q, t, n, -1).sum((1, 3)).double())
                selfs.append(torch.stack(block_self, 1))  # [n, M]
                if queries is not None:
                    inner.append(torch.stack(block_inner, 2))  # [Q, n, M]
                capture.clear()
        self.projected = {key: torch.cat(p) for key, p in projected.items()}
        self.self_inner = torch.cat(selfs)  # [N, M]
        if queries is None:
            self.tokens = {
                name: tuple(_pad_cat([p[i] for p in parts]) for i in (0, 1)) for name, parts in self.tokens.items()
            }
        else:
            self.tokens = None
            self.inner = torch.cat(inner, 1)  # [Q, N, M]
        return self


def _pad_cat(parts: List[torch.Tensor]) -> torch.Tensor:
    t = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, t - p.shape[1])) for p in parts])


def exact_scores(train: Captured, queries: Captured, picked: Sequence[int]) -> torch.Tensor:
    """Exact per-module cosine averaged over the modules `picked`, float64 [Q, N]."""
    m = list(picked)
    norm = (queries.self_inner[:, None, m] * train.self_inner[None, :, m]).sqrt().clamp_min(1e-300)
    return (train.inner[:, :, m] / norm).mean(2)


def index_scores(
    tmp: Path,
    train_rows: torch.Tensor,
    query_rows: torch.Tensor,
    blocks: List[Dict],
    settings,
    resolved: Optional[Dict[str, str]] = None,
) -> Dict:
    """Scores [Q, N] per (precondition, damping) through IndexWriter + Index.topk; `resolved`, when
    given, gets what each precondition (e.g. "auto") resolves to for this index."""
    path = Path(tempfile.mkdtemp(dir=tmp))
    n = len(train_rows)
    meta = {"fingerprint": "bench", "global_step": 0, "modules": blocks}
    writer = IndexWriter(path / "ix", n, train_rows.shape[1], "float16", meta)
    writer.write(
        range(n),
        train_rows,
        torch.ones(n),
        torch.ones(n, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32),
        [str(i) for i in range(n)],
    )
    writer.close()
    index = open_index(path / "ix")
    queries = query_rows.half().float()
    out = {}
    for precondition, damping in settings:
        if resolved is not None:
            resolved[precondition] = resolve(index, precondition)
        top = index.topk(queries, k=n, precondition=precondition, damping=damping)
        s = torch.empty(len(queries), n, dtype=torch.float64)
        s.scatter_(1, top.indices, top.scores.double())
        out[(precondition, damping)] = s
    return out


def filter_columns(names: List[str], picked: List[int], k: int) -> tuple:
    """Column indices of modules `picked` in the all-Linear row at k, and their re-offset blocks."""
    size = k * k
    cols = torch.cat([torch.arange(m * size, (m + 1) * size) for m in picked])
    blocks = [{"name": names[m], "offset": i * size, "size": size} for i, m in enumerate(picked)]
    return cols, blocks


def load_kind(kind: str) -> Tuple[List[Dict], List[Dict], List[List[int]], Any, torch.nn.Module]:
    """A kind's training rows, queries, each query's planted sources as row positions, and
    SmolLM2's tokenizer and float32 model in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = read_jsonl(DATA / f"{kind}.train.jsonl")
    query_rows = read_jsonl(DATA / f"{kind}.queries.jsonl")
    position = {r["id"]: i for i, r in enumerate(train)}
    sources = [[position[s] for s in q["sources"]] for q in query_rows]
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2, use_fast=True)
    return (
        train,
        query_rows,
        sources,
        tokenizer,
        AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval(),
    )


def run_kind(kind: str, log: Callable[[str], None]) -> Dict:
    train, query_rows, sources, tokenizer, base = load_kind(kind)
    start = time.perf_counter()
    captured, notes = {}, {}
    for name in ("base", "ft"):
        model, scales = base, None
        if name == "ft":
            model = copy.deepcopy(base)
            model.get_input_embeddings().weight.requires_grad_(False)
            optimizers: List = []
            notes = fine_tune(
                model, tokenizer, train, query_rows, epochs=1, lr=2e-4, batch_size=8, log=log, optimizer_out=optimizers
            )
        modules = select_modules(model, ["*"])  # every nn.Linear
        if name == "ft":
            scales = adam_scales(model, optimizers[0], modules)
            del optimizers
        q = Captured(modules).run(model, tokenizer, query_rows)
        t = Captured(modules).run(model, tokenizer, train, queries=q, scales=scales)
        q.tokens = None
        captured[name] = (t, q)
        log(f"  {kind}/{name}: rows captured ({time.perf_counter() - start:.0f} s)")
        if name == "ft":
            del model
    names = captured["base"][0].names
    filters = module_filters(names)
    picks = {f: [i for i, n in enumerate(names) if filters[f](n)] for f in FILTERS}
    scores: Dict[tuple, torch.Tensor] = {}
    # Gram statistics only where fisher is scored (they cost minutes per 211 modules at k = 32).
    statistics.GRAM_MAX_SIZE = max(d * d for d in FISHER_DIMS)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (t, q) in captured.items():
            for f, picked in picks.items():
                scores[(name, f, "exact", "none", 0.0, "plain")] = exact_scores(t, q, picked)
                for k in DIMS:
                    cols, blocks = filter_columns(names, picked, k)
                    settings = [s for s in SETTINGS if s[0] != "fisher" or k in FISHER_DIMS]
                    for variant in ("plain", "adam"):
                        if (variant, k) not in t.projected:
                            continue
                        found = index_scores(
                            Path(tmp),
                            t.projected[(variant, k)][:, cols],
                            q.projected[("plain", k)][:, cols],
                            blocks,
                            settings if variant == "plain" else [("none", 0.0)],
                        )
                        for (p, d), s in found.items():
                            scores[(name, f, k, p if variant == "plain" else "adam", d, variant)] = s
                log(f"  {kind}/{name}/{f}: scored ({time.perf_counter() - start:.0f} s)")
    records = []
    for (name, f, k, p, d, _variant), s in scores.items():
        records.append(
            {
                "model": name,
                "checkpoints": "last",
                "filter": f,
                "dim": k,
                "precondition": p,
                "damping": d,
                **ranking_metrics(first_source_ranks(s, sources)),
            }
        )
        if name == "ft":
            # base + ft, equal weights; adam applies to the fine-tuned checkpoint only (the base has no optimizer state)
            base_key = ("base", f, k, "none" if p == "adam" else p, d, "plain")
            total = scores[base_key] + s
            records.append(
                {
                    "model": "ft",
                    "checkpoints": "base+ft",
                    "filter": f,
                    "dim": k,
                    "precondition": p,
                    "damping": d,
                    **ranking_metrics(first_source_ranks(total, sources)),
                }
            )
    return {
        "kind": kind,
        "fine_tune": notes,
        "seconds": round(time.perf_counter() - start),
        "records": records,
        "rows": len(train),
        "queries": len(query_rows),
        "machine": f"torch {torch.__version__}, threads {torch.get_num_threads()}, 2-core CPU",
    }


def pretrained_cell(kind: str, filter_name: str, k: int, log: Callable[[str], None]) -> Dict:
    """One (filter, k) cell of the pretrained case alone (no fine-tune, no other filter or k): the
    product's current defaults (`auto` as it resolves now, damping QuerySpec's) beside the
    explicit preconditioners and the exact ceiling, with recall@1/@10 and MRR. Same capture, index
    and scoring as run_kind; only the fine-tuned model and the other filters and dims are left out."""
    train, query_rows, sources, tokenizer, model = load_kind(kind)
    start = time.perf_counter()
    every = select_modules(model, ["*"])
    keep = module_filters(list(every))[filter_name]
    modules = {n: m for n, m in every.items() if keep(n)}
    q = Captured(modules, dims=(k,)).run(model, tokenizer, query_rows)
    t = Captured(modules, dims=(k,)).run(model, tokenizer, train, queries=q)
    log(f"  {kind}/base/{filter_name}: rows captured ({time.perf_counter() - start:.0f} s)")
    picked = list(range(len(modules)))
    cols, blocks = filter_columns(list(modules), picked, k)
    settings = [
        (QuerySpec.precondition, QuerySpec.damping),
        ("none", 0.0),
        ("diag", 1.0),
        ("fisher", 1.0),
        ("ekfac", 1.0),
    ]
    resolved: Dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        found = index_scores(
            Path(tmp),
            t.projected[("plain", k)][:, cols],
            q.projected[("plain", k)][:, cols],
            blocks,
            settings,
            resolved,
        )
    found[("exact", 0.0)] = exact_scores(t, q, picked)
    records = [
        {
            "precondition": p,
            "resolves_to": resolved.get(p, p),
            "damping": d,
            "dim": "exact" if p == "exact" else k,
            **ranking_metrics(first_source_ranks(s, sources)),
        }
        for (p, d), s in found.items()
    ]
    return {
        "kind": kind,
        "case": "pretrained",
        "filter": filter_name,
        "modules": len(modules),
        "dim": k,
        "score": "cosine, normalize=module",
        "storage_dtype": "float16",
        "rows": len(train),
        "queries": len(query_rows),
        "seconds": round(time.perf_counter() - start),
        "machine": f"torch {torch.__version__}, threads {torch.get_num_threads()}, 2-core CPU",
        "records": records,
    }


# ---------------------------------------------------------------- report


def load_results(kinds: Sequence[str] = KINDS) -> Dict[str, Dict]:
    return {
        k: json.loads((RESULTS / f"grid.{k}.json").read_text()) for k in kinds if (RESULTS / f"grid.{k}.json").exists()
    }


def cells(results: Dict[str, Dict]) -> Dict[tuple, Dict]:
    """(kind, case, filter, dim, precondition, damping) -> metrics; case is pretrained / ft-last / ft-base+ft."""
    out = {}
    for kind, result in results.items():
        for r in result["records"]:
            case = "pretrained" if r["model"] == "base" else f"ft-{r['checkpoints']}"
            out[(kind, case, r["filter"], str(r["dim"]), r["precondition"], r["damping"])] = r
    return out


def recipes(results: Dict[str, Dict]) -> List[tuple]:
    """Every (filter, dim, precondition, damping) scored on every kind's pretrained model."""
    keys = None
    for key_set in (
        {(f, d, p, lay) for (kd, c, f, d, p, lay) in cells(results) if c == "pretrained" and kd == kind}
        for kind in results
    ):
        keys = key_set if keys is None else keys & key_set
    order = {"exact": 0, "16": 1, "32": 2, "64": 3}
    return sorted(keys or [], key=lambda k: (FILTERS.index(k[0]), order[k[1]], k[2], k[3]))


def worse_case(table: Dict, kind: str, recipe: tuple, ft_case: str) -> Optional[float]:
    """min(pretrained MRR, fine-tuned MRR) of one kind for one recipe and fine-tuned checkpoint recipe."""
    b = table.get((kind, "pretrained", *recipe))
    p = recipe[2]
    f = table.get((kind, ft_case, *recipe)) if p != "adam" else None
    if b is None or f is None:
        return None
    return min(b["mrr"], f["mrr"])


def report(results: Optional[Dict[str, Dict]] = None) -> str:
    results = results or load_results()
    table = cells(results)
    kinds = list(results)
    lines = [
        "#### MRR per kind: pretrained / fine-tuned (own checkpoint) / fine-tuned (base+ft)",
        "",
        "| filter | k | precondition | damping | "
        + " | ".join(kinds)
        + " | worse case: mean over kinds | worse case: worst kind |",
        "|---|---|---|---|" + "---|" * len(kinds) + "---|---|",
    ]
    for recipe in recipes(results):
        row, worst = [], []
        for kind in kinds:
            parts = [table.get((kind, case, *recipe)) for case in ("pretrained", "ft-last", "ft-base+ft")]
            row.append(" / ".join("—" if r is None else f"{r['mrr']:.2f}" for r in parts))
            w = worse_case(table, kind, recipe, "ft-base+ft")
            if w is not None:
                worst.append(w)
        mean = f"{sum(worst) / len(worst):.3f} | {min(worst):.2f}" if len(worst) == len(kinds) else "— | —"
        lines.append(f"| {recipe[0]} | {recipe[1]} | {recipe[2]} | {recipe[3]} | " + " | ".join(row) + f" | {mean} |")
    swept = [kind for kind in kinds if (kind, "pretrained", "mlp", "16", "fisher", 3.0) in table]
    if swept:
        lines += [
            "",
            "#### damping, where it was swept: MRR pretrained / fine-tuned (own) / fine-tuned (base+ft), k = 16",
            "",
            "| filter | precondition | damping | " + " | ".join(swept) + " |",
            "|---|---|---|" + "---|" * len(swept),
        ]
        for f in FILTERS:
            for p, d in SETTINGS:
                if p == "none":
                    continue
                row = [
                    " / ".join(
                        f"{table[(kind, c, f, '16', p, d)]['mrr']:.2f}" for c in ("pretrained", "ft-last", "ft-base+ft")
                    )
                    for kind in swept
                ]
                lines.append(f"| {f} | {p} | {d} | " + " | ".join(row) + " |")
    adam = [(kind, r) for (kind, case, f, d, p, _lay), r in table.items() if p == "adam"]
    if adam:
        lines += [
            "",
            "#### adam (fine-tuned model only): MRR own checkpoint / base+ft, against none",
            "",
            "| filter | k | " + " | ".join(kinds) + " |",
            "|---|---|" + "---|" * len(kinds),
        ]
        for f in FILTERS:
            for d in map(str, DIMS):
                row = []
                for kind in kinds:
                    a = [table.get((kind, c, f, d, "adam", 0.0)) for c in ("ft-last", "ft-base+ft")]
                    n = [table.get((kind, c, f, d, "none", 0.0)) for c in ("ft-last", "ft-base+ft")]
                    row.append(
                        "—"
                        if None in a + n
                        else f"{a[0]['mrr']:.2f} / {a[1]['mrr']:.2f} (none {n[0]['mrr']:.2f} / {n[1]['mrr']:.2f})"
                    )
                lines.append(f"| {f} | {d} | " + " | ".join(row) + " |")
    lines += [
        "",
        "#### fine-tunes",
        "",
        "| kind | rows | queries | train loss before → after (nats/row) | query loss before → after | seconds (whole cell) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, result in results.items():
        ft = result["fine_tune"]
        lines.append(
            f"| {kind} | {result['rows']} | {result['queries']} | {ft['loss_before']['train']:.1f} → {ft['loss_after']['train']:.1f} | "
            f"{ft['loss_before']['queries']:.1f} → {ft['loss_after']['queries']:.1f} | {result['seconds']} |"
        )
    return "\n".join(lines)


def against_exact(results: Dict[str, Dict], recipe: tuple) -> str:
    """Per kind, one recipe's MRR against the exact unprojected per-module cosine of the same filter."""
    table = cells(results)
    exact = (recipe[0], "exact", "none", 0.0)
    lines = [
        f"#### {recipe[0]}, k = {recipe[1]}, precondition {recipe[2]} (damping {recipe[3]}) against exact per-module cosine ({recipe[0]}): MRR",
        "",
        "| kind | pretrained | exact | fine-tuned, own checkpoint | exact | fine-tuned, base+ft | exact, own checkpoint | exact, base+ft |",
        "|---|---|---|---|---|---|---|---|",
    ]
    columns = [
        ("pretrained", recipe),
        ("pretrained", exact),
        ("ft-last", recipe),
        ("ft-last", exact),
        ("ft-base+ft", recipe),
        ("ft-last", exact),
        ("ft-base+ft", exact),
    ]
    for kind in results:
        lines.append(f"| {kind} | " + " | ".join(f"{table[(kind, case, *r)]['mrr']:.2f}" for case, r in columns) + " |")
    # The mean over the kinds: the done-means compares the defaults with the ceiling case by case, over the sets.
    lines.append(
        "| **mean** | "
        + " | ".join(
            f"**{sum(table[(kind, case, *r)]['mrr'] for kind in results) / len(results):.3f}**" for case, r in columns
        )
        + " |"
    )
    return "\n".join(lines)


def plot(results: Optional[Dict[str, Dict]] = None, path: Path = PLOT) -> Path:
    """MRR against k per filter and precondition (none, diag; fisher 1.0 at k = 16 as a star), mean over kinds, per case; exact as dashed lines."""
    plt = pyplot()
    results = results or load_results()
    table = cells(results)
    kinds = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    for ax, (case, title) in zip(
        axes,
        (
            ("pretrained", "pretrained"),
            ("ft-last", "fine-tuned, own checkpoint"),
            ("ft-base+ft", "fine-tuned, base+ft"),
        ),
    ):
        for i, f in enumerate(FILTERS):
            for p, style in (("none", "-o"), ("diag", "-s")):
                ys = [
                    sum(table[(kd, case, f, str(d), p, 0.0 if p == "none" else 0.1)]["mrr"] for kd in kinds)
                    / len(kinds)
                    for d in DIMS
                ]
                ax.plot(DIMS, ys, style, color=f"C{i}", label=f"{f}, {p}", alpha=1.0 if p == "none" else 0.6)
            fisher = sum(table[(kd, case, f, "16", "fisher", 1.0)]["mrr"] for kd in kinds) / len(kinds)
            ax.plot([16], [fisher], "*", color=f"C{i}", markersize=11, label=f"{f}, fisher 1.0")
            exact = sum(table[(kd, case, f, "exact", "none", 0.0)]["mrr"] for kd in kinds) / len(kinds)
            ax.axhline(exact, color=f"C{i}", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(DIMS, [str(d) for d in DIMS])
        ax.set_xlabel("projection_dim k")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"MRR, mean over {len(kinds)} kinds")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("SmolLM2-135M: per-module cosine; dashed: exact unprojected ceiling per filter", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--plot", action="store_true")
    parser.add_argument(
        "--against-exact",
        nargs=4,
        metavar=("FILTER", "K", "PRECONDITION", "DAMPING"),
        help="one recipe against the exact ceiling, per kind",
    )
    parser.add_argument(
        "--pretrained",
        nargs=3,
        metavar=("KIND", "FILTER", "K"),
        help="only the pretrained case's (FILTER, K) cell, at the current defaults and beside them"
        " -> ranking_results/pretrained.KIND.FILTER.K.json",
    )
    args = parser.parse_args()
    if args.pretrained:
        kind, f, k = args.pretrained
        result = pretrained_cell(kind, f, int(k), log=lambda m: print(m, flush=True))
        (RESULTS / f"pretrained.{kind}.{f}.{k}.json").write_text(json.dumps(result, indent=1))
        print(
            "| precondition | resolves to | damping | k | recall@1 | recall@10 | MRR |\n|---|---|---|---|---|---|---|"
        )
        for r in result["records"]:
            print(
                f"| {r['precondition']} | {r['resolves_to']} | {r['damping']} | {r['dim']} | {r['r@1']:.3f} | {r['r@10']:.3f} | {r['mrr']:.3f} |"
            )
        print(f"({result['rows']} rows, {result['queries']} queries, {result['seconds']} s)")
        return
    if args.against_exact:
        f, k, p, d = args.against_exact
        print(against_exact(load_results(), (f, k, p, float(d))))
        return
    if args.report or args.plot:
        if args.plot:
            print(plot())
        if args.report:
            print(report())
        return
    for kind in args.kinds:
        result = run_kind(kind, log=lambda m: print(m, flush=True))
        (RESULTS / f"grid.{kind}.json").write_text(json.dumps(result, indent=1))
        print(report(load_results([kind])), flush=True)


if __name__ == "__main__":
    main()
