"""The field's estimators computed exactly on an LDS set, as references for issue 41: exact inner
product and whole-row cosine, full-space K-FAC and EK-FAC influence, and approximate unrolling
over a range of horizons, at the fine-tuned checkpoint and summed over base + fine-tuned; each
one's raw and centred LDS against the set's retrained subsets, and planted-source retrieval.

Run after `benchmarks.studies.lds_sets.run KIND` has made the set's work folder (models, rows,
`gradian validate`'s retrained subsets):

    PYTHONPATH=. python -m benchmarks.studies.lds_sets.estimators facts-N256
    PYTHONPATH=. python -m benchmarks.studies.lds_sets.estimators smollm2-N80 --group-layers 2

Independent of the package's gradient code (as benchmarks/studies/reference.py): forward hooks on
the selected nn.Linear modules keep each input x_t, a tensor hook its output-gradient δ_t, for each
row's summed supervised-token cross-entropy; a row's weight gradient is G_n = Σ_t δ_tᵀ x_t [out, in].
Per module, with A = Σ x xᵀ / positions (the positions at or before the row's last supervised
one) and G = Σ_n Σ_t δ δᵀ / examples, their eigenbases Q_A, Q_G and a row's rotated gradient
G̃_n = Q_Gᵀ G_n Q_A, every estimator here is Σ_modules Σ_{o,i} w(E)[o,i] G̃_q[o,i] G̃_n[o,i]:

    inner              w = 1
    kfac d / ekfac d   w = 1 / (E + d · mean E), E = λ_G ⊗ λ_A (K-FAC) or mean_n G̃_n² (EK-FAC)
    ... unroll h       w = Ē (1 - exp(-h E / Ē)) / E, Ē the mean of E over every module

Modules are processed a group of layers at a time (every row's G̃_n of a group in memory), so
SmolLM2's whole MLP fits: one forward + backward of every row per group and checkpoint. Modules
outside the layers (the output head, `lm_head`) are a group each, after them.

`--modules` picks the modules: the MLP's (the default, every result before the option), the
output head, the attention projections, or sums of them. The head's weight gradient of a row is
Σ_t (p_t − y_t) ⊗ h_t over its supervised tokens (p_t the softmax, y_t the one-hot target, h_t the
final hidden state). Where the model ties the head to the input embedding (SmolLM2; the tiny
Llama does not), the hook sees the head's use of the shared weight only, not the embedding's.
Where a selected module's side exceeds KFAC_MAX_SIDE (SmolLM2's head, vocab × vocab), only the
inner product is computed, in factored form per token pair, with no weight gradient made:

    ⟨G_q, G_n⟩ = Σ_{t∈q, s∈n} (δ_t · δ_s) (x_t · x_s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.studies.lds_sets.common import (
    bm25,
    lds_figures,
    noise_ceiling,
    paired_difference,
    per_query,
    retrieval,
    subset_standard_error,
)
from gradian_lightning import JsonlDataset, collate, read_jsonl
from gradian_lightning.config import load_config
from gradian_lightning.hub import load_model_and_tokenizer
from gradian_lightning.validation.lds import shared_variance_share
from gradian_lightning.validation.subsets import SubsetRuns, write_json_atomically

HERE = Path(__file__).resolve().parent
MLP = ("gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
HEAD = ("lm_head",)
# --modules: which nn.Linear modules' gradients every estimator is computed over (by their last
# name). "mlp" is every result before this option; "all" every nn.Linear of a Llama.
MODULES = {
    "mlp": MLP,
    "head": HEAD,
    "mlp+head": MLP + HEAD,
    "attn": ATTENTION,
    "mlp+attn": MLP + ATTENTION,
    "all": MLP + ATTENTION + HEAD,
}
# --modules A|B: each part's cosine in the estimator's metric, summed (per_family).
PER_FAMILY = ("mlp|head", "mlp|attn|head")
# A module with a side larger than this has no K-FAC factors here (SmolLM2's head: G would be
# 49,152² values, 19 GB in float64): a selection holding one computes the inner product only, in
# factored form (module docstring).
KFAC_MAX_SIDE = 8192
DAMPINGS = (0.01, 0.1, 1.0)
# How the two checkpoints' scores combine (`combined` in main).
CASES = ("ft", "ft cos", "base+ft", "base+ft qn", "base+ft cos")
HORIZONS = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 1000.0)


def estimators() -> List[str]:
    names = ["inner"]  # with case "... cos": the whole-row cosine
    for kind in ("kfac", "ekfac"):
        names += [f"{kind} d={d:g}" for d in DAMPINGS] + [f"{kind} unroll h={h:g}" for h in HORIZONS]
    return names


def batches(rows: List[Dict], tokenizer, max_seq_length: int, batch_size: int):
    dataset = JsonlDataset(rows, tokenizer, max_seq_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for lo in range(0, len(dataset), batch_size):
        yield collate([dataset[i] for i in range(lo, min(lo + batch_size, len(dataset)))], pad_token_id=pad)


def carrying(batch) -> torch.Tensor:
    """Bool [B, T]: attended positions at or before the row's last supervised one (t with labels[t+1] set)."""
    keep = torch.zeros_like(batch["labels"], dtype=torch.bool)
    keep[:, :-1] = batch["labels"][:, 1:] != -100
    steps = torch.arange(1, keep.shape[1] + 1)
    last = (keep * steps).amax(dim=1)
    return (steps[None, :] <= last[:, None]) & batch["attention_mask"].bool()


def token_grads(model, modules: Dict[str, torch.nn.Linear], batch, dtype):
    """{name: (x [B, T, in], δ [B, T, out])} of one batch, x zero outside `carrying`."""
    inputs, outputs = {}, {}

    def keep(name, args, output):
        inputs[name], outputs[name] = args[0].detach(), output

    hooks = [m.register_forward_hook(lambda _, a, o, n=n: keep(n, a, o)) for n, m in modules.items()]
    try:
        with torch.enable_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1),
                batch["labels"][:, 1:].flatten(),
                ignore_index=-100,
                reduction="sum",
            )
            grads = torch.autograd.grad(loss, [outputs[n] for n in modules])
    finally:
        for h in hooks:
            h.remove()
    mask = carrying(batch)[..., None].to(dtype)
    return {n: (inputs[n].to(dtype) * mask, g.to(dtype) * mask) for n, g in zip(modules, grads)}


def selected_modules(model, choice: str = "mlp") -> Dict[str, torch.nn.Linear]:
    """{name: module} of the nn.Linear modules `--modules choice` names, in the model's order."""
    names = MODULES[choice]
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in names}


def module_groups(modules: Dict[str, torch.nn.Linear], group_layers: int) -> List[Dict[str, torch.nn.Linear]]:
    """The modules in groups of `group_layers` decoder layers, then each module outside the layers
    (the head) alone: the rows' gradients of one group are held in memory at once."""

    def layer(name: str) -> Optional[int]:
        return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None

    layers = sorted({layer(n) for n in modules if layer(n) is not None})
    groups = []
    for lo in range(0, len(layers), group_layers):
        chosen = set(layers[lo : lo + group_layers])
        groups.append({n: m for n, m in modules.items() if layer(n) in chosen})
    return groups + [{n: m} for n, m in modules.items() if layer(n) is None]


def factored_inner(model, tokenizer, train, queries, spec: Dict, modules, group_layers: int, dtype):
    """The inner product alone, ⟨G_q, G_n⟩ = Σ_{t,s} (δ_t·δ_s)(x_t·x_s) per module, summed: [Q, N]
    scores and both sides' squared norms, from each row's tokens with a nonzero δ (a position whose
    output gradient is zero adds nothing), without making any row's weight gradient."""
    length, size = spec["max_seq_length"], 8
    scores, q_norm, n_norm = 0.0, 0.0, 0.0
    for group in module_groups(modules, group_layers):
        tokens = {n: {"train": [], "query": []} for n in group}  # (row, x [T, in], δ [T, out]) per row
        for rows, label in ((train, "train"), (queries, "query")):
            row = 0
            for batch in batches(rows, tokenizer, length, size):
                for n, (x, g) in token_grads(model, group, batch, dtype).items():
                    for b in range(x.shape[0]):
                        live = g[b].abs().amax(dim=1) > 0
                        tokens[n][label].append((row + b, x[b, live], g[b, live]))
                row += batch["input_ids"].shape[0]
        for n in group:
            sides = {}
            for label, count in (("train", len(train)), ("query", len(queries))):
                rows_of = tokens[n][label]
                owner = torch.cat([torch.full((len(x),), r) for r, x, _ in rows_of])
                x = torch.cat([x for _, x, _ in rows_of])
                g = torch.cat([g for _, _, g in rows_of])
                own = torch.zeros(count, dtype=dtype)  # ‖G_r‖² = Σ_{t,s∈r} (δ_t·δ_s)(x_t·x_s)
                for r, xr, gr in rows_of:
                    own[r] += ((gr @ gr.T) * (xr @ xr.T)).sum()
                sides[label] = (owner, x, g, own, count)
            q_owner, q_x, q_g, q_own, q_count = sides["query"]
            n_owner, n_x, n_g, n_own, n_count = sides["train"]
            pairs = (q_g @ n_g.T) * (q_x @ n_x.T)  # [Tq, Tn] token-pair products
            by_query = torch.zeros(q_count, pairs.shape[1], dtype=dtype).index_add_(0, q_owner, pairs)
            block = torch.zeros(q_count, n_count, dtype=dtype).index_add_(1, n_owner, by_query)
            scores = scores + block.double()
            q_norm, n_norm = q_norm + q_own.double(), n_norm + n_own.double()
            tokens[n] = None
            del pairs, by_query, block
    return {"inner": scores.numpy()}, {"inner": (q_norm.numpy(), n_norm.numpy())}, {}


def weighted_products(tr, qu, eig: Dict, damp: Dict, mean_e: Dict, dtype):
    """Every estimator's weights w over one module's rotated gradients (or a block of their
    entries: train `tr` [N, D], queries `qu` [Q, D], eigenvalues `eig` {kind: [D]}; `damp` the
    module's mean eigenvalue, the damping's unit), and (keys, [E, Q, N] products Σ w g_q g_n,
    [Q, E] and [N, E] squared norms in each metric)."""
    weights = {"inner": torch.ones_like(eig["kfac"])}
    for kind, e in eig.items():
        for d in DAMPINGS:
            weights[f"{kind} d={d:g}"] = 1 / (e + d * damp[kind])
        scaled = e / mean_e[kind]
        for h in HORIZONS:
            w = -torch.expm1(-h * scaled) / scaled.clamp_min(torch.finfo(dtype).tiny)
            weights[f"{kind} unroll h={h:g}"] = torch.where(scaled > 0, w, torch.full_like(w, h))
    keys = list(weights)
    stacked = torch.stack([qu * weights[k] for k in keys])  # [E, Q, D]
    block = (stacked.flatten(0, 1) @ tr.T).view(len(keys), qu.shape[0], tr.shape[0])
    metric = torch.stack([weights[k] for k in keys]).T  # [D, E]
    return keys, block, qu.square() @ metric, tr.square() @ metric  # [Q, E], [N, E]


def accumulate(out: Dict, q_norm: Dict, n_norm: Dict, keys, block, q_squared, n_squared) -> None:
    """Add one module's (or block's) weighted_products to the running scores and squared norms."""
    for i, (k, s) in enumerate(zip(keys, block)):
        out[k] = out[k] + s.double()
        q_norm[k] = q_norm.get(k, 0) + q_squared[:, i].double()
        n_norm[k] = n_norm.get(k, 0) + n_squared[:, i].double()


def diagonal_head_scores(model, tokenizer, train, queries, spec: Dict, name: str, dtype, chunk: int = 256):
    """Every estimator over one module whose G factor is kept as its diagonal (the output basis the
    identity), for a module too wide to hold every row's gradient (SmolLM2's head: 49,152 × 576 a
    row): each row's live tokens (δ ≠ 0) are kept, and its rotated gradient Σ_t δ_t[c] ⊗ x̃_t is
    made `chunk` output rows c at a time for every row; estimators are sums over entries, so the
    blocks add. A is over the positions `carrying` keeps, as in scores_at."""
    module = {name: dict(model.named_modules())[name]}
    length, size = spec["max_seq_length"], 8
    a_sum, g_diag, norm_sum, positions, examples = 0, 0, 0.0, 0, 0
    live = {"train": [], "query": []}  # per row: (x [T, in], δ [T, out]) at its tokens with δ ≠ 0
    for rows, label in ((train, "train"), (queries, "query")):
        for batch in batches(rows, tokenizer, length, size):
            x, g = token_grads(model, module, batch, dtype)[name]
            if label == "train":
                positions += int(carrying(batch).sum())
                examples += int((batch["labels"][:, 1:] != -100).any(1).sum())
                a_sum = a_sum + torch.einsum("bti,btj->ij", x, x)
                g_diag = g_diag + g.square().sum((0, 1))
            for b in range(x.shape[0]):
                keep = g[b].abs().amax(dim=1) > 0
                live[label].append((x[b, keep], g[b, keep]))
                if label == "train":
                    norm_sum += float(((g[b, keep] @ g[b, keep].T) * (x[b, keep] @ x[b, keep].T)).sum())
    lam_a, q_a = torch.linalg.eigh(a_sum.double() / positions)
    lam_a, q_a, lam_g = lam_a.clamp_min(0).to(dtype), q_a.to(dtype), (g_diag.double() / examples).to(dtype)
    count = module[name].weight.numel()
    mean_e = {"kfac": float(lam_g.sum() * lam_a.sum()) / count, "ekfac": norm_sum / examples / count}
    live = {label: [(x @ q_a, g) for x, g in rows] for label, rows in live.items()}
    out = {e: 0.0 for e in estimators()}
    q_norm: Dict[str, torch.Tensor] = {}
    n_norm: Dict[str, torch.Tensor] = {}
    for lo in range(0, len(lam_g), chunk):
        block = slice(lo, lo + chunk)
        tr = torch.stack([(g[:, block].T @ x).flatten() for x, g in live["train"]])  # [N, chunk · in]
        qu = torch.stack([(g[:, block].T @ x).flatten() for x, g in live["query"]])
        eig = {"kfac": torch.outer(lam_g[block], lam_a).flatten(), "ekfac": tr.square().sum(0) / examples}
        accumulate(out, q_norm, n_norm, *weighted_products(tr, qu, eig, mean_e, mean_e, dtype))
        del tr, qu
    norms = {k: (q_norm[k].numpy(), n_norm[k].numpy()) for k in out}
    return {k: v.numpy() for k, v in out.items()}, norms, mean_e


def scores_at(
    model,
    tokenizer,
    train,
    queries,
    spec: Dict,
    group_layers: int,
    dtype,
    choice: str = "mlp",
    max_side=None,
    diagonal_g_above=None,
) -> Dict[str, np.ndarray]:
    """Every estimator's [Q, N] scores at one model (module docstring), over `--modules choice`; a
    head (lm_head) with more outputs than `diagonal_g_above` keeps only the diagonal of its G factor
    (the identity as its output basis): a factor any vocabulary can afford."""
    model.eval()
    modules = selected_modules(model, choice)
    wide = diagonal_g_above is not None and max_side is not None and choice == "head"
    if wide and modules["lm_head"].out_features > max(diagonal_g_above, max_side):  # too wide to hold: in blocks
        return diagonal_head_scores(model, tokenizer, train, queries, spec, "lm_head", dtype)
    if max(max(m.in_features, m.out_features) for m in modules.values()) > (max_side or KFAC_MAX_SIDE):
        return factored_inner(model, tokenizer, train, queries, spec, modules, group_layers, dtype)
    length, size = spec["max_seq_length"], 8
    # Pass 1, every module: A and G sums, positions, examples, Σ_n ‖G_n‖² (the EK-FAC eigenvalues' total).
    a_sum = {n: 0 for n in modules}
    g_sum = {n: 0 for n in modules}
    norm_sum = {n: 0.0 for n in modules}
    positions = examples = 0
    for batch in batches(train, tokenizer, length, size):
        keep = carrying(batch)
        positions += int(keep.sum())
        examples += int((batch["labels"][:, 1:] != -100).any(1).sum())
        for n, (x, g) in token_grads(model, modules, batch, dtype).items():
            a_sum[n] = a_sum[n] + torch.einsum("bti,btj->ij", x, x)
            g_sum[n] = g_sum[n] + torch.einsum("bto,btp->op", g, g)
            norm_sum[n] += float((torch.bmm(g, g.transpose(1, 2)) * torch.bmm(x, x.transpose(1, 2))).sum())
    bases = {}
    for n in modules:
        lam_a, q_a = torch.linalg.eigh(a_sum[n].double() / positions)
        lam_g, q_g = torch.linalg.eigh(g_sum[n].double() / examples)
        if diagonal_g_above is not None and n.endswith("lm_head") and modules[n].out_features > diagonal_g_above:
            lam_g = torch.diagonal(g_sum[n].double() / examples).clone()
            q_g = torch.eye(len(lam_g), dtype=torch.float64)
        bases[n] = (q_a.to(dtype), lam_a.clamp_min(0).to(dtype), q_g.to(dtype), lam_g.clamp_min(0).to(dtype))
    del a_sum, g_sum
    count = sum(m.weight.numel() for m in modules.values())
    mean_e = {
        "kfac": sum(float(b[1].sum() * b[3].sum()) for b in bases.values()) / count,
        "ekfac": sum(norm_sum.values()) / examples / count,  # Σ_oi Λ = mean_n ‖G̃_n‖² = mean_n ‖G_n‖²
    }
    names = estimators()
    out = {e: 0.0 for e in names}
    q_norm: Dict[str, torch.Tensor] = {}
    n_norm: Dict[str, torch.Tensor] = {}
    for group in module_groups(modules, group_layers):
        rotated: Dict[str, List[torch.Tensor]] = {n: [] for n in group}
        for rows, label in ((train, "train"), (queries, "query")):
            for batch in batches(rows, tokenizer, length, size):
                for n, (x, g) in token_grads(model, group, batch, dtype).items():
                    q_a, _, q_g, _ = bases[n]
                    rotated[n].append((label, torch.bmm((g @ q_g).transpose(1, 2), x @ q_a)))
        for n in group:
            tr = torch.cat([r for label, r in rotated[n] if label == "train"]).flatten(1)  # [N, out·in]
            qu = torch.cat([r for label, r in rotated[n] if label == "query"]).flatten(1)  # [Q, out·in]
            rotated[n] = []
            _, lam_a, _, lam_g = bases[n]
            eig = {"kfac": torch.outer(lam_g, lam_a).flatten(), "ekfac": tr.square().sum(0) / examples}
            damp = {kind: e.mean() for kind, e in eig.items()}
            accumulate(out, q_norm, n_norm, *weighted_products(tr, qu, eig, damp, mean_e, dtype))
            del tr, qu
    # Each estimator's squared norms in its own metric w: ‖g_q‖²_w [Q] and ‖g_n‖²_w [N].
    norms = {k: (q_norm[k].numpy(), n_norm[k].numpy()) for k in out}
    return {k: v.numpy() for k, v in out.items()}, norms, mean_e


def merged_by_set(results: List[Dict]) -> List[Dict]:
    """One result per set from results over several `--modules` (a result without the key is the
    MLP's, as every result before the option): entries of other modules are named "MODULES: estimator"
    and carry `modules`, so the best reference stays the MLP's, as issue 41 defines it."""
    merged: Dict[str, Dict] = {}
    for result in sorted(results, key=lambda r: r.get("modules", "mlp") != "mlp"):  # the MLP's first
        modules = result.get("modules", "mlp")
        entries = [
            {
                **e,
                "modules": modules,
                "estimator": e["estimator"]
                if modules == "mlp" or e["estimator"] == "BM25"
                else f"{modules}: {e['estimator']}",
            }
            for e in result["entries"]
            if result["set"] not in merged or e["estimator"] != "BM25"  # BM25 once a set
        ]
        if result["set"] in merged:
            merged[result["set"]]["entries"] += entries
        else:
            merged[result["set"]] = {**result, "entries": entries}
    return list(merged.values())


def per_family(parts: List[tuple]) -> tuple:
    """`--modules A|B`: at one checkpoint, the sum over the parts of each part's cosine in the
    estimator's own metric (an unroll's Ē is each part's own), as (scores, norms, mean eigenvalues)
    with unit norms, so that every case is a sum of per-part cosines ("ft" that checkpoint's, "base+ft"
    the mean over both): the parts weigh the same whatever their gradients' sizes. The estimators are
    the first part's; a later part with no factors (SmolLM2's head: inner product only) adds its
    plain cosine to each, the most its size allows."""

    def cosine(scores, norms, name):
        name = name if name in scores else "inner"
        return scores[name] / np.sqrt(np.outer(*norms[name]))

    names = list(parts[0][0])
    summed = {n: sum(cosine(scores, norms, n) for scores, norms, _ in parts) for n in names}
    ones = {n: (np.ones(summed[n].shape[0]), np.ones(summed[n].shape[1])) for n in names}
    return summed, ones, [means for _, _, means in parts]


def is_reference(entry: Dict) -> bool:
    """The field's estimators as issue 41 names them: exact inner product and whole-row cosine, and
    full-space K-FAC and EK-FAC influence at each damping, at the fine-tune alone and summed, over
    the MLP's modules."""
    if entry.get("modules", "mlp") != "mlp":
        return False
    if entry["estimator"] == "inner":
        return entry["case"] in ("ft", "ft cos", "base+ft", "base+ft cos")
    return " d=" in entry["estimator"] and entry["case"] in ("ft", "base+ft")


def best_reference(result: Dict) -> Dict:
    return max((e for e in result["entries"] if is_reference(e)), key=lambda e: e["lds"])


def has_reference(result: Dict) -> bool:
    """Whether the MLP's estimators were run on the set (a set with only other --modules has no
    best reference, so no share)."""
    return any(is_reference(e) for e in result["entries"])


def worst_set_table(results: List[Dict], top: int = 12, always: Sequence[tuple] = ()) -> str:
    """Every (case, estimator) by its worst share of each set's best reference (raw LDS)."""
    left_out = [r["set"] for r in results if not raw_ceiling_above_zero(r) or not has_reference(r)]
    results = [r for r in results if r["set"] not in left_out]
    common = set.intersection(*({(e["case"], e["estimator"]) for e in r["entries"]} for r in results))
    keys = [(e["case"], e["estimator"]) for e in results[0]["entries"] if (e["case"], e["estimator"]) in common]
    keys = [k for k in keys if k[1] != "BM25"]
    best = {r["set"]: best_reference(r) for r in results}
    rows = []
    for key in keys:
        shares = {}
        for r in results:
            entry = next(e for e in r["entries"] if (e["case"], e["estimator"]) == key)
            shares[r["set"]] = (entry["lds"] / best[r["set"]]["lds"], entry)
        rows.append((min(v for v, _ in shares.values()), key, shares))
    rows.sort(key=lambda x: -x[0])
    chosen = rows[:top] + [r for r in rows[top:] if r[1] in always]
    head = "| case | estimator | worst share | " + " | ".join(r["set"] for r in results) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(results)]
    lines.append(
        "| best reference | | | "
        + " | ".join(
            f"{best[r['set']]['lds']:+.3f} ({best[r['set']]['case']}, {best[r['set']]['estimator']})" for r in results
        )
        + " |"
    )
    lines.append(
        "| BM25 | | | "
        + " | ".join(f"{next(e for e in r['entries'] if e['estimator'] == 'BM25')['lds']:+.3f}" for r in results)
        + " |"
    )
    for worst, (case, name), shares in chosen:
        cells = [f"{e['lds']:+.3f} ({v:.2f})" for v, e in shares.values()]
        lines.append(f"| {case} | {name} | {worst:.2f} | " + " | ".join(cells) + " |")
    note = (
        f"\nLeft out (raw noise ceiling within 2 standard errors of 0, or no MLP reference): {', '.join(left_out)}.\n"
        if left_out
        else ""
    )
    return "\n".join(lines) + "\n" + note


def raw_ceiling_above_zero(result: Dict) -> bool:
    ceiling = result.get("ceiling")
    return bool(ceiling) and ceiling["lds"] > 2 * ceiling["standard_error"]


def against_bm25(results: List[Dict], key: tuple, minus: Optional[tuple] = None) -> str:
    """One (case, estimator) on every set: raw and centred LDS, its share of the set's best
    reference, retrieval, and its raw LDS minus BM25's paired by query (mean ± standard error);
    with `minus`, also minus that (case, estimator)'s raw LDS, paired by query."""
    lines = [
        "| set | raw LDS | share of best reference | centred LDS | R@10 | MRR | minus BM25 (paired) |"
        + (f" minus {minus[0]}, {minus[1]} (paired) |" if minus else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if minus else ""),
    ]
    for r in results:
        entry = next((e for e in r["entries"] if (e["case"], e["estimator"]) == key), None)
        if entry is None:  # --modules not run on this set
            lines.append(f"| {r['set']} | not measured | | | | | |")
            continue
        lexical = next(e for e in r["entries"] if e["estimator"] == "BM25")
        difference = paired_difference(entry["per_query"]["raw"], lexical["per_query"]["raw"])
        paired = f"{difference[0]:+.3f} ± {difference[1]:.3f}" if difference else "BM25 has no score"
        if difference and "minus_bm25_subset_standard_error" in entry:  # both parts of the error
            both = float(np.hypot(difference[1], entry["minus_bm25_subset_standard_error"]))
            paired += f" (± {both:.3f} with the subsets': {difference[0] / both:+.1f} SE)"
        share = entry["lds"] / best_reference(r)["lds"] if has_reference(r) else float("nan")
        flag = "" if raw_ceiling_above_zero(r) else " (raw ceiling ≈ 0)"
        lines.append(
            f"| {r['set']}{flag} | {entry['lds']:+.3f} ± {entry['standard_error']:.3f} | {share:.2f} | "
            f"{entry['centred_lds']:+.3f} ± {entry['centred_standard_error']:.3f} | {entry.get('recall@10', float('nan')):.2f} | "
            f"{entry.get('mrr', float('nan')):.2f} | {paired} |" + (f" {versus(r, entry, minus)} |" if minus else "")
        )
    return "\n".join(lines) + "\n"


def versus(result: Dict, entry: Dict, key: tuple) -> str:
    """`entry`'s raw LDS minus that of the (case, estimator) `key` on the same set, paired by query."""
    other = next((e for e in result["entries"] if (e["case"], e["estimator"]) == key), None)
    difference = paired_difference(entry["per_query"]["raw"], other["per_query"]["raw"]) if other else None
    return f"{difference[0]:+.3f} ± {difference[1]:.3f}" if difference else "—"


def above_bm25(result: Dict, top: int) -> str:
    """The `top` (case, estimator) pairs of one set by raw LDS minus BM25's, paired by query (mean ±
    standard error): how far above word overlap any estimator measured gets on this set."""
    lexical = next(e for e in result["entries"] if e["estimator"] == "BM25")
    rows = []
    for e in result["entries"]:
        difference = paired_difference(e["per_query"]["raw"], lexical["per_query"]["raw"])
        if e is not lexical and difference:
            rows.append((difference, e))
    rows.sort(key=lambda x: -x[0][0])
    lines = [
        f"{result['set']}: BM25 {lexical['lds']:+.3f} ± {lexical['standard_error']:.3f}",
        "",
        "| case | estimator | raw LDS | minus BM25 (paired) |",
        "|---|---|---|---|",
    ]
    for (mean, error), e in rows[:top]:
        lines.append(
            f"| {e['case']} | {e['estimator']} | {e['lds']:+.3f} ± {e['standard_error']:.3f} | {mean:+.3f} ± {error:.3f} ({mean / error:.1f} SE) |"
        )
    return "\n".join(lines) + "\n"


# --by-modules: the (case, estimator) pairs shown for each --modules.
SHOWN = (
    ("ft", "inner"),
    ("ft cos", "inner"),
    ("base+ft", "inner"),
    ("base+ft cos", "inner"),
    ("base+ft", "kfac d=0.1"),
    ("base+ft cos", "kfac d=0.1"),
    ("base+ft", "ekfac d=0.1"),
    ("ft", "kfac unroll h=1"),
    ("base+ft cos", "kfac unroll h=1"),
    ("base+ft cos", "kfac unroll h=30"),
)


def modules_table(results: List[Dict], against: str, shown: Sequence[tuple] = SHOWN) -> str:
    """Each shown (case, estimator) over each `--modules` in `results` (merged_by_set): raw LDS ±
    standard error per set, raw LDS minus BM25's on the set `against` (paired by query), and the
    worst share of each set's best reference (MLP) over the sets with a raw noise ceiling where the
    pair was measured (those where it was not are named)."""
    order = list(MODULES) + list(PER_FAMILY)
    present = sorted(
        {e.get("modules", "mlp") for r in results for e in r["entries"]},
        key=lambda m: (order.index(m.split(" ")[0]), m),  # "mlp|head side128" after "mlp|head"
    )
    counted = [r for r in results if raw_ceiling_above_zero(r) and has_reference(r)]
    head = "| modules | case | estimator | " + " | ".join(r["set"] for r in results)
    lines = [
        head
        + f" | minus BM25 on {against} (paired; ± over queries; ± with the subsets) | worst share | not measured on |",
        "|---" * (len(results) + 6) + "|",
    ]
    lexical = {r["set"]: next(e for e in r["entries"] if e["estimator"] == "BM25") for r in results}
    for modules in present:
        for case, base_name in shown:
            name = base_name if modules == "mlp" else f"{modules}: {base_name}"
            found = {
                r["set"]: next((e for e in r["entries"] if (e["case"], e["estimator"]) == (case, name)), None)
                for r in results
            }
            if not any(found.values()):
                continue
            cells = [f"{e['lds']:+.3f} ± {e['standard_error']:.3f}" if e else "—" for e in found.values()]
            target = found.get(against)
            difference = (
                paired_difference(target["per_query"]["raw"], lexical[against]["per_query"]["raw"]) if target else None
            )
            paired = "—"
            if difference:  # over queries, then with the draw of subsets' part (common.subset_standard_error)
                both = float(np.hypot(difference[1], target.get("minus_bm25_subset_standard_error", 0.0)))
                paired = f"{difference[0]:+.3f} ± {difference[1]:.3f}; ± {both:.3f}: {difference[0] / both:+.1f} SE"
            shares = [(found[r["set"]]["lds"] / best_reference(r)["lds"], r["set"]) for r in counted if found[r["set"]]]
            worst = "{:.2f} ({})".format(*min(shares)) if shares else "—"
            missing = ", ".join(r["set"] for r in counted if not found[r["set"]])
            lines.append(
                f"| {modules} | {case} | {base_name} | " + " | ".join(cells) + f" | {paired} | {worst} | {missing} |"
            )
    return "\n".join(lines) + "\n"


def set_table(result: Dict, estimators_shown: Sequence[str]) -> str:
    ceiling = result.get("ceiling")
    lines = [
        f"{result['set']}: {result['rows']} rows, {result['queries']} queries, {result['num_subsets']} subsets; "
        f"{100 * result['shared_variance']:.0f}% of the loss variance shared; raw noise ceiling "
        + (f"{ceiling['lds']:+.3f} ± {ceiling['standard_error']:.3f}" if ceiling else "not measured"),
        "",
        "| case | estimator | raw LDS | centred LDS | R@10 | MRR |",
        "|---|---|---|---|---|---|",
    ]
    for e in result["entries"]:
        if e["estimator"] in estimators_shown or e["estimator"] == "BM25":
            recall = f"{e['recall@10']:.2f}" if "recall@10" in e else ""
            mrr = f"{e['mrr']:.2f}" if "mrr" in e else ""
            lines.append(
                f"| {e['case']} | {e['estimator']} | {e['lds']:+.3f} ± {e['standard_error']:.3f} | "
                f"{e['centred_lds']:+.3f} ± {e['centred_standard_error']:.3f} | {recall} | {mrr} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="the set's work folder name, e.g. facts-N256 (under --root)")
    parser.add_argument("--root", type=Path, default=Path("/tmp/gradian-lds-sets"))
    parser.add_argument(
        "--results", type=Path, nargs="+", default=[HERE / "estimators"],
        help="the folder results go to; --report: every result under these folders, merged by set",
    )  # fmt: skip
    parser.add_argument(
        "--modules", choices=list(MODULES) + list(PER_FAMILY), default="mlp",
        help="the nn.Linear modules the estimators are computed over (module docstring)",
    )  # fmt: skip
    parser.add_argument("--group-layers", type=int, default=64, help="layers whose rows' gradients are held at once")
    parser.add_argument("--float64", action="store_true", help="float64 arithmetic (the tiny sets)")
    parser.add_argument(
        "--diagonal-g-above", type=int, metavar="N",
        help="the head, where it has more outputs than N, keeps only the diagonal of its G factor (any vocabulary affords it)",
    )  # fmt: skip
    parser.add_argument(
        "--kfac-max-side", type=int, default=KFAC_MAX_SIDE,
        help="a selection holding a module with a larger side gets the inner product only (128 on the "
        "tiny sets: the head without factors, as a real vocabulary's must be)",
    )  # fmt: skip
    parser.add_argument(
        "--scores-only", action="store_true", help="make and keep the scores; no LDS (subsets may still train)"
    )
    parser.add_argument(
        "--epochs-between", type=int, nargs="*", default=[],
        help="also score the fine-tune after these epochs (case 'all': base, these and ft summed)",
    )  # fmt: skip
    parser.add_argument(
        "--defaults",
        nargs="*",
        default=["base+ft cos:kfac d=0.1"],
        help="CASE:ESTIMATOR rows for --report's per-set table",
    )
    parser.add_argument("--report", action="store_true", help="print the tables of every result in --results")
    parser.add_argument("--minus", metavar="CASE:ESTIMATOR", help="--report: --defaults rows also minus this, paired")
    parser.add_argument(
        "--by-modules", metavar="SET",
        help="--report: only the table of SHOWN estimators for each --modules measured, minus BM25 on SET",
    )  # fmt: skip
    parser.add_argument(
        "--above-bm25", type=int, default=0, help="--report: also each set's N estimators furthest above BM25 (paired)"
    )
    args = parser.parse_args(argv)
    if args.report:
        results = merged_by_set([json.loads(p.read_text()) for d in args.results for p in sorted(d.rglob("*.json"))])
        if args.by_modules:
            print(modules_table(results, args.by_modules))
            return 0
        shown = ["inner", "kfac d=0.1", "ekfac d=0.1", "kfac unroll h=1", "kfac unroll h=100", "ekfac unroll h=100"]
        for result in results:
            print(f"#### {result['set']}\n\n`{result['command']}`\n\n{set_table(result, shown)}")
        print(f"#### Worst set\n\n{worst_set_table(results)}")
        for key in args.defaults:
            case, name = key.split(":", 1)  # a --modules name holds ":" too
            minus = tuple(args.minus.split(":", 1)) if args.minus else None
            print(f"#### {case}, {name} on every set\n\n{against_bm25(results, (case, name), minus)}")
        if args.above_bm25:
            for result in results:
                print(f"#### Furthest above BM25\n\n{above_bm25(result, args.above_bm25)}")
        return 0
    work = args.root / args.name
    torch.set_num_threads(1)
    started = time.perf_counter()
    result = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else {}
    if result.get("spec"):
        spec = result["spec"]
    else:  # the set still training: its spec as run.py makes it (NAME is KIND-N{rows}[variant])
        from benchmarks.studies.lds_sets.run import spec_for

        kind, rows = args.name.split("-N")[0], int(args.name.split("-N")[1].split("-")[0])
        spec = spec_for(kind, rows, smoke=False).__dict__
    train, queries = read_jsonl(work / "train.jsonl"), read_jsonl(work / "queries.jsonl")
    ids = [r["id"] for r in train]
    sources = [[ids.index(s) for s in q["sources"]] for q in queries] if all("sources" in q for q in queries) else None
    base = Path(spec["base"]) if spec.get("base") else work / "base"
    dtype = torch.float64 if args.float64 else torch.float32
    per_checkpoint, norms, means = {}, {}, {}
    checkpoints = [("base", base)]
    for k in args.epochs_between:  # the fine-tune's own model after k of its epochs (constant-rate AdamW,
        # one shuffling generator: the first k epochs of the full run), for the trajectory cases
        path = work / f"ft-e{k}"
        if not (path / "config.json").is_file():
            from benchmarks.studies.lds_sets.common import SetSpec, train_and_save

            model, tokenizer = load_model_and_tokenizer(load_config(None, [f"model.name_or_path={base}"]).model)
            known = {k: v for k, v in spec.items() if k in SetSpec.__dataclass_fields__}
            train_and_save(SetSpec(**known), model, tokenizer, train, k, path)
        checkpoints.append((f"e{k}", path))
    checkpoints.append(("ft", work / "ft"))
    for label, path in checkpoints:
        parts = []
        for part in args.modules.split("|"):  # "mlp|head": each part scored (and cached) on its own
            # The scores do not depend on the retrained subsets: kept, so they can be made while those train.
            selection = "" if part == "mlp" else f"{part}-"  # the MLP's caches keep their names
            if args.kfac_max_side != KFAC_MAX_SIDE:
                selection += f"side{args.kfac_max_side}-"
            if args.diagonal_g_above is not None and "head" in part:  # the head's factor alone changes
                selection += f"diag{args.diagonal_g_above}-"
            cache = work / f"estimator-scores-{selection}{label}-{str(dtype).split('.')[-1]}.pt"
            if not cache.is_file():
                model, tokenizer = load_model_and_tokenizer(load_config(None, [f"model.name_or_path={path}"]).model)
                made = scores_at(
                    model.to(dtype),
                    tokenizer,
                    train,
                    queries,
                    spec,
                    args.group_layers,
                    dtype,
                    part,
                    args.kfac_max_side,
                    args.diagonal_g_above,
                )
                torch.save(made, cache)
                print(f"{args.name}: {label} ({part}) scored at {time.perf_counter() - started:.0f} s", flush=True)
            parts.append(torch.load(cache, weights_only=False))
        per_checkpoint[label], norms[label], means[label] = parts[0] if len(parts) == 1 else per_family(parts)
    if args.scores_only:
        return 0

    runs = SubsetRuns.existing(work / "runs")
    subsets, outputs = runs.subsets, -runs.losses().mean(axis=0)

    def combined(name: str, case: str) -> np.ndarray:
        """One checkpoint's scores, or the equal-weight sum over both (an index of saved models has no
        learning rates: index/checkpoints.py), raw, each divided by the query's norm in the
        estimator's metric ("qn"), or the cosine in that metric ("cos")."""
        labels = {"ft": ["ft"], "base+ft": ["base", "ft"], "all": [label for label, _ in checkpoints]}[case.split()[0]]
        total = 0.0
        for label in labels:
            s = per_checkpoint[label][name]
            q, n = norms[label][name]
            if case.endswith(" qn"):
                s = s / np.sqrt(q)[:, None]
            elif case.endswith(" cos"):
                s = s / np.sqrt(q[:, None] * n[None, :])
            total = total + s / len(labels)
        return total

    entries = []
    lexical = bm25(train, queries)
    cases = CASES + (("all", "all qn", "all cos") if args.epochs_between else ())
    computed = [name for name in estimators() if name in per_checkpoint["ft"]]  # inner only where factored
    for case in cases:
        for name in computed:
            scores = combined(name, case)
            entry = {"estimator": name, "case": case, **lds_figures(scores, subsets, outputs)}
            entry["per_query"] = per_query(scores, subsets, outputs)
            if np.any(lexical):  # the draw of subsets' share of the error of "minus BM25" (common.py)
                entry["minus_bm25_subset_standard_error"] = subset_standard_error(scores, subsets, outputs, lexical)
            if sources:
                entry.update(retrieval(scores, sources))
            entries.append(entry)
    entries.append(
        {
            "estimator": "BM25",
            "case": "words",
            **lds_figures(lexical, subsets, outputs),
            "per_query": per_query(lexical, subsets, outputs),
            **(retrieval(lexical, sources) if sources else {}),
        }
    )
    ceiling = result.get("indexes", {}).get("exact", {}).get("ceiling")
    if ceiling is None:  # as gradian validate reports it: one retraining against the other
        ceiling = noise_ceiling(runs.losses())
    out = {
        "set": args.name,
        # a smaller --kfac-max-side is another estimator: named apart in merged reports
        "modules": args.modules
        + (f" side{args.kfac_max_side}" if args.kfac_max_side != KFAC_MAX_SIDE else "")
        + (f" diagG{args.diagonal_g_above}" if args.diagonal_g_above is not None else ""),
        "command": "PYTHONPATH=. python -m benchmarks.studies.lds_sets.estimators "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": len(train),
        "queries": len(queries),
        "num_subsets": int(subsets.shape[0]),
        "shared_variance": shared_variance_share(outputs),
        "ceiling": ceiling,
        "mean_eigenvalue": means,
        "checkpoints": [label for label, _ in checkpoints],
        "dtype": str(dtype),
        "wall_seconds": time.perf_counter() - started,
        "entries": entries,
    }
    if len(args.results) != 1:
        parser.error("--results: one folder when computing (several only with --report)")
    args.results[0].mkdir(parents=True, exist_ok=True)
    write_json_atomically(args.results[0] / f"{args.name}.json", out)
    for e in entries:
        print(
            f"{e['case']:8s} {e['estimator']:22s} raw {e['lds']:+.3f} ± {e['standard_error']:.3f}  centred {e['centred_lds']:+.3f}  R@10 {e.get('recall@10', float('nan')):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
