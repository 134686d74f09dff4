"""Rank training rows for queries: query rows made like the index's, then a streaming top-k.

    query JSONL rows -> `query_gradients`: the index's model, modules, loss and projection, read
                        back from the index attributes -> query rows [Q, D] float32
    index chunks     -> `streaming_topk`: per chunk [c, D], scores [Q, c] = queries @ rowsᵀ in
                        float32 on one device, merged into a running top-k (and bottom-k) per query

Memory is the query rows, one chunk and the running [Q, k] state: it does not grow with N.
Rows with zero supervised tokens, NaN/inf gradients or not yet written are never ranked.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from gradian_lightning.capture import LinearCapture, select_modules
from gradian_lightning.config import NORMALIZE, SCORES, module_patterns
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError, DataError, IndexMismatchError
from gradian_lightning.gradients import projected_gradients
from gradian_lightning.projection import KroneckerProjector
from gradian_lightning.store import IndexReader, decode, encode

LOSS_KIND = "supervised_token_sum"  # what `supervised_token_loss` computes; the index records its own


@dataclass
class Ranking:
    """The best rows per query, best first. Rows hold fewer than k entries when fewer rows are rankable.

    `indices` int64 [Q, k'] dataset positions; `scores` float32 [Q, k'], k' = min(k, rankable rows).
    """

    indices: torch.Tensor
    scores: torch.Tensor


def _unit(rows: torch.Tensor) -> torch.Tensor:
    # A zero row (nothing supervised, or an exactly zero gradient) scores 0 rather than NaN.
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(torch.finfo(rows.dtype).tiny)


def _merge(best: Ranking, scores: torch.Tensor, positions: torch.Tensor, k: int, largest: bool) -> Ranking:
    values = torch.cat([best.scores, scores], dim=1)
    indices = torch.cat([best.indices, positions.expand(scores.shape[0], -1)], dim=1)
    top = values.topk(min(k, values.shape[1]), dim=1, largest=largest, sorted=True)
    return Ranking(indices.gather(1, top.indices), top.values)


def _unit_modules(rows: torch.Tensor, blocks: Sequence[Dict[str, Any]]) -> torch.Tensor:
    """Scale each module's block of `rows` [n, D] to unit L2 norm, in place; a zero block stays zero."""
    tiny = torch.finfo(rows.dtype).tiny
    sizes = {int(b["size"]) for b in blocks}
    if len(sizes) == 1 and sum(int(b["size"]) for b in blocks) == rows.shape[1]:  # projected: equal k² blocks
        view = rows.view(rows.shape[0], len(blocks), -1)
        view /= torch.linalg.vector_norm(view, dim=2, keepdim=True).clamp_min(tiny)
        return rows
    for b in blocks:
        part = rows[:, int(b["offset"]) : int(b["offset"]) + int(b["size"])]
        part /= torch.linalg.vector_norm(part, dim=1, keepdim=True).clamp_min(tiny)
    return rows


def streaming_topk(
    index: IndexReader,
    query_rows: torch.Tensor,
    k: int,
    score: str = "cosine",
    bottom_k: int = 0,
    device: Optional[torch.device | str] = None,
    normalize: str = "module",
) -> tuple[Ranking, Optional[Ranking]]:
    """Top-k (and, when `bottom_k` > 0, bottom-k: most negative first) rows of `index` per query.

    `query_rows` [Q, D] float32. `score`: "cosine" or "inner" (raw dot product). For cosine,
    `normalize` says what is scaled to unit norm: "module" (default) each module's block of a row,
    so the score is the mean over modules of the per-module cosines and a module with large
    gradients cannot outvote the rest (benchmarks/RANKING.md: mean MRR 0.42 -> 0.55 over 12
    planted-source sets); "row" the whole row, as in LESS/TrackStar. Each chunk is scored as one
    float32 matmul on `device` (default: the queries' device). Returns (top, bottom or None).
    """
    if score not in SCORES:
        raise ConfigError(f"setting 'query.score'={score!r} is not allowed; use {' or '.join(SCORES)}")
    if normalize not in NORMALIZE:
        raise ConfigError(f"setting 'query.normalize'={normalize!r} is not allowed; use {' or '.join(NORMALIZE)}")
    if k < 1 or bottom_k < 0:
        raise ConfigError(f"top_k={k}, bottom_k={bottom_k}: use top_k >= 1 and bottom_k >= 0")
    width = int(index.meta["width"])
    if query_rows.dim() != 2 or query_rows.shape[1] != width:
        raise IndexMismatchError(f"query rows have shape {tuple(query_rows.shape)} but the index at {str(index.path)!r} holds rows of width {width}; compute them with query_gradients on this index")
    device = torch.device(device) if device is not None else query_rows.device
    queries = query_rows.detach().to(device=device, dtype=torch.float32)
    by_module = score == "cosine" and normalize == "module"
    # An index written without a module layout (by IndexWriter directly) is one block: the row.
    blocks = index.meta.get("modules") or [{"offset": 0, "size": width}]
    if by_module:
        queries = _unit_modules(queries.clone(), blocks) / len(blocks)  # / M: scores are a mean of cosines
    elif score == "cosine":
        queries = _unit(queries)
    empty = Ranking(torch.empty(len(queries), 0, dtype=torch.long, device=device), torch.empty(len(queries), 0, device=device))
    top, bottom = empty, empty
    for lo, rows in index.chunks():
        keep = torch.from_numpy(index.rankable(lo, lo + len(rows)))
        positions = torch.arange(lo, lo + len(keep))
        if not bool(keep.all()):  # copying only when some rows must go keeps the common case one pass cheaper
            if not bool(keep.any()):
                continue
            rows, positions = rows[keep], positions[keep]
        rows, positions = rows.to(device), positions.to(device)
        if by_module:
            rows = _unit_modules(rows, blocks)  # each chunk is a fresh tensor: normalising in place is safe
        scores = queries @ rows.T  # [Q, c] float32
        if score == "cosine" and not by_module:  # dividing the scores by the row norms saves normalising a copy of the chunk
            scores /= torch.linalg.vector_norm(rows, dim=1).clamp_min(torch.finfo(rows.dtype).tiny)
        top = _merge(top, scores, positions, k, largest=True)
        if bottom_k:
            bottom = _merge(bottom, scores, positions, bottom_k, largest=False)
    return top, (bottom if bottom_k else None)


# -- query rows, computed the way the index was -------------------------------------------------
def _describe_model(model: nn.Module) -> Dict[str, Any]:
    config = getattr(model, "config", None)
    return {
        "class": type(model).__name__,
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "vocab_size": getattr(config, "vocab_size", None),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def index_mismatches(meta: Dict[str, Any], model: Optional[nn.Module] = None, settings: Optional[Dict[str, Any]] = None) -> List[str]:
    """What disagrees between an index's attributes and a query's model and settings (empty: all agree).

    `settings` holds the query's own `module_filter`, `projection_dim`, `seed`, `storage_dtype`
    (any subset); `model` is the model the query will run. Each entry is a short phrase.
    """
    found: List[str] = []
    projection = meta.get("projection", {})
    settings = settings or {}
    for key, theirs in (("projection_dim", projection.get("dim")), ("seed", projection.get("seed")), ("storage_dtype", meta.get("storage_dtype"))):
        if key in settings and settings[key] != theirs:
            found.append(f"grads.{key} is {settings[key]!r} here but {theirs!r} in the index")
    if meta.get("loss", {}).get("kind", LOSS_KIND) != LOSS_KIND:
        found.append(f"the index's loss is {meta['loss']['kind']!r}, this gradian computes {LOSS_KIND!r}")
    if model is None:
        return found
    ours, theirs = _describe_model(model), meta.get("model", {})
    for key, what in (("class", "model class"), ("name_or_path", "model"), ("vocab_size", "vocabulary size"), ("dtype", "model dtype")):
        if ours[key] is not None and theirs.get(key) is not None and ours[key] != theirs[key]:
            found.append(f"{what} is {ours[key]!r} here but {theirs[key]!r} in the index")
    linears = dict(model.named_modules())
    modules_found = True
    for block in meta.get("modules", []):
        name, shape = block["name"], (block["out_features"], block["in_features"])
        module = linears.get(name)
        if not isinstance(module, nn.Linear):
            modules_found = False
            found.append(f"module {name!r} is missing from the model" if module is None else f"module {name!r} is {type(module).__name__}, not nn.Linear")
        elif (module.out_features, module.in_features) != shape:
            modules_found = False
            found.append(f"module {name!r} is {module.out_features}x{module.in_features} here but {shape[0]}x{shape[1]} in the index")
    if "module_filter" in settings and modules_found:
        try:
            chosen = list(select_modules(model, module_patterns(settings["module_filter"])))
        except ConfigError:
            chosen = []
        wanted = [b["name"] for b in meta.get("modules", [])]
        if chosen != wanted:
            found.append(f"grads.module_filter={settings['module_filter']!r} selects {len(chosen)} modules here, not the {len(wanted)} modules of the index")
    return found


def check_matches_index(index: IndexReader, model: Optional[nn.Module] = None, settings: Optional[Dict[str, Any]] = None) -> None:
    """Raise `IndexMismatchError`, one line naming each mismatch, when the query cannot match the index."""
    found = index_mismatches(index.meta, model, settings)
    if found:
        raise IndexMismatchError(
            f"the query does not match the index at {str(index.path)!r}: {'; '.join(found)}; query with the model and grads.* settings the index was built with"
        )


def index_projector(index: IndexReader, model: nn.Module) -> tuple[Dict[str, nn.Linear], KroneckerProjector]:
    """The index's modules, found by name in `model`, and its projection, rebuilt from the attributes."""
    check_matches_index(index, model)
    linears = dict(model.named_modules())
    modules = {b["name"]: linears[b["name"]] for b in index.meta["modules"]}
    projection = index.meta["projection"]
    projector = KroneckerProjector(modules, projection["dim"], projection["seed"])
    if projector.describe() != index.meta["modules"] or projector.width != int(index.meta["width"]):
        raise IndexMismatchError(
            f"the row layout rebuilt from the index at {str(index.path)!r} differs from its attributes (width {projector.width} vs {index.meta['width']}); rebuild the index with `gradian index`"
        )
    return modules, projector


def query_gradients(
    index: IndexReader,
    model: nn.Module,
    tokenizer: Any,
    rows: Sequence[Dict[str, Any]],
    batch_size: int = 8,
    max_seq_length: Optional[int] = None,
    device: Optional[torch.device | str] = None,
    forward_context: Optional[ContextManager] = None,
    source: str = "query data",
) -> torch.Tensor:
    """Projected loss gradients [Q, D] float32 of arbitrary rows, made exactly like `index`'s rows.

    `rows` are dicts in any training-data format (prompt/completion, messages, text). The modules,
    projection (dim, seed) and storage dtype are read from the index attributes; the rows are
    rounded to the storage dtype, so a training row used as a query scores like its stored row.
    `max_seq_length` defaults to the one the index was built with (its `data.max_seq_length`), or
    no truncation. `device` defaults to the model's. The model's train/eval mode, RNG and
    parameters' `.grad` are left as they were. Raises `IndexMismatchError` naming each mismatch and
    `DataError` for a row with no supervised token.
    """
    modules, projector = index_projector(index, model)
    if max_seq_length is None:
        max_seq_length = (index.meta.get("data") or {}).get("max_seq_length") or 2**31 - 1
    dataset = JsonlDataset(rows, tokenizer, max_seq_length, source=source)
    for example in dataset.examples:
        if all(label < 0 for label in example.labels[1:]):
            raise DataError(f"{source} row {example.index + 1} (id {example.id!r}) has no supervised token within max_seq_length={max_seq_length}; give it a completion or shorten its prompt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=partial(collate, pad_token_id=pad))
    device = torch.device(device) if device is not None else next(model.parameters()).device
    capture = LinearCapture(modules)
    storage = index.meta["storage_dtype"]
    out = []
    # The index is written in eval mode (Lightning's validation loop); restore the caller's mode after.
    training = {m: m.training for m in model.modules()}
    devices = [device] if device.type != "cpu" else []
    try:
        model.eval()
        with torch.random.fork_rng(devices=devices, device_type=device.type), torch.inference_mode(False), torch.enable_grad():
            for batch in loader:
                batch = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
                rows_, _ = projected_gradients(model, batch, capture, projector, forward_context or contextlib.nullcontext())
                out.append(decode(encode(rows_, storage), storage))
    finally:
        for m, mode in training.items():
            m.train(mode)
    return torch.cat(out).to(device)


# -- the `gradian query` recipe -----------------------------------------------------------------
def results_for(index: IndexReader, query_ids: Sequence[str], top: Ranking, bottom: Optional[Ranking] = None) -> List[Dict[str, Any]]:
    """One JSON-ready dict per query: {"query_id", "results": [{"rank", "id", "index", "score"}], "opponents"?}.

    `id` is the training row's stored id (its `id` column, or its position).
    """
    rankings = {"results": top, **({"opponents": bottom} if bottom is not None else {})}
    positions = sorted({int(i) for r in rankings.values() for i in r.indices.flatten().tolist()})
    ids = dict(zip(positions, index.column("id", positions))) if positions else {}
    out = []
    for q, query_id in enumerate(query_ids):
        entry: Dict[str, Any] = {"query_id": query_id}
        for key, ranking in rankings.items():
            entry[key] = [
                {"rank": r + 1, "id": str(ids[int(i)]), "index": int(i), "score": float(s)}
                for r, (i, s) in enumerate(zip(ranking.indices[q].tolist(), ranking.scores[q].tolist()))
            ]
        out.append(entry)
    return out


def write_results(path: str | Path, results: Sequence[Dict[str, Any]]) -> None:
    """Write `results_for` output as JSONL, one line per query."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in results))


def run_query(cfg: Any) -> Dict[str, Any]:
    """Answer `cfg.query.data` against the index at `cfg.index.path`; write `cfg.query.output` if set.

    Returns {"results": per-query dicts (see `results_for`), "queries": the query rows,
    "train_rows": the index's training rows when its data file is still there (else None),
    "index": the reader, "device": where scoring ran}.
    """
    import lightning as L
    from omegaconf import OmegaConf

    from gradian_lightning.config import require
    from gradian_lightning.data import read_jsonl
    from gradian_lightning.indexing import file_sha256, load_model_and_tokenizer

    require(cfg, "model.name_or_path", "query.data")
    queries = read_jsonl(cfg.query.data)
    index = IndexReader(cfg.index.path)
    g = cfg.grads
    settings = {"module_filter": OmegaConf.to_object(g.module_filter) if OmegaConf.is_config(g.module_filter) else g.module_filter,
                "projection_dim": g.projection_dim, "seed": g.seed, "storage_dtype": g.storage_dtype}
    check_matches_index(index, settings={k: v for k, v in settings.items() if k != "module_filter"})  # before the model loads
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    fabric_kwargs = {k: trainer[k] for k in ("accelerator", "precision") if trainer.get(k) is not None}
    fabric = L.Fabric(**fabric_kwargs, devices=1)
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    check_matches_index(index, model, settings)
    model.to(fabric.device)
    rows = query_gradients(index, model, tokenizer, queries, g.batch_size, device=fabric.device, forward_context=fabric.autocast(), source=str(cfg.query.data))
    top, bottom = streaming_topk(index, rows, cfg.query.top_k, cfg.query.score, cfg.query.bottom_k, device=fabric.device, normalize=cfg.query.normalize)
    query_ids = [str(q.get("id", i)) for i, q in enumerate(queries)]
    results = results_for(index, query_ids, top, bottom)
    if cfg.query.output:
        write_results(cfg.query.output, results)
    data = index.meta.get("data") or {}
    # Snippets only from the very file that was indexed: an edited file no longer lines up.
    same_file = data.get("path") and Path(data["path"]).is_file() and file_sha256(data["path"]) == data.get("sha256")
    train_rows = read_jsonl(data["path"]) if same_file else None
    return {"results": results, "queries": queries, "train_rows": train_rows, "index": index, "device": str(fabric.device)}
