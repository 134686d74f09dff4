"""`gradian plan`: predict indexing's peak memory and the index's size, without loading weights.

One allocation dominates gradient indexing: the fp32 logits at the supervised positions of a batch,
`n_supervised × vocab × 4` bytes (see gradients/loss.py). Prompt tokens and padding cost nothing there, so the
prediction needs the supervised-token count of every row, hence the real tokenizer at the configured
`grads.max_seq_length`; the model itself is built on the meta device, from its config alone, for the
vocabulary, the parameter bytes and the widths of the selected modules.
"""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils._python_dispatch import TorchDispatchMode

from gradian_lightning.config import require_for
from gradian_lightning.data import IGNORE_INDEX, Fields, TokenizedRows
from gradian_lightning.data_sources import open_rows, streamed_rows
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.capture import linear_features, select_modules
from gradian_lightning.gradients.memory import (
    FP32_BYTES,
    SUGGESTED_LOSS_CHUNK_TOKENS,
    fp32_logit_bytes,
    human_bytes,
    logit_peak_copies,
)
from gradian_lightning.gradients.recompute import recomputed_units
from gradian_lightning.hub import load_tokenizer_and_config, meta_model
from gradian_lightning.index.layout import NUMPY_DTYPE
from gradian_lightning.index.statistics import statistics_bytes
from gradian_lightning.query.exact_scoring import (
    QUERY_BYTES,
    choose_method,
    exact_cost,
    exact_estimator,
    factor_set_bytes,
    head_part,
    run_settings_against_exact,
)
from gradian_lightning.specs import STORAGE_DTYPES, IndexSpec, QuerySpec

# Byte units, lower-cased: bytes, decimal (kb ... tb) and binary (kib ... tib).
_UNITS = {"": 1, "b": 1, **{f"{p}b": 10 ** (3 * n) for n, p in enumerate("kmgt", 1)}}
_UNITS.update({f"{p}ib": 2 ** (10 * n) for n, p in enumerate("kmgt", 1)})


def parse_bytes(text: str) -> int:
    """'24GiB', '80 GB', '512MiB', '1e9' -> bytes. Raises `ConfigError` for anything else."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"--device-memory {text!r} is not a size; write e.g. 24GiB, 80GB or 16000MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def accelerator_memory() -> Optional[Tuple[int, str]]:
    """(bytes, device name) of the first visible accelerator (CUDA, then MPS), or None."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"cuda:0 {props.name}"
    if torch.backends.mps.is_available():
        return int(torch.mps.recommended_max_memory()), "mps"
    return None


def model_dtype(cfg: DictConfig, config: Any) -> torch.dtype:
    """The dtype `gradian index` loads the model in."""
    name = cfg.model.dtype
    if name == "auto":
        name = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32").replace(
            "torch.", ""
        )
    return getattr(torch, name)


class _WeightCasts(TorchDispatchMode):
    """Notes the storage of every dtype conversion of a weight (what autocast makes of a Linear's weight)."""

    def __init__(self, weights: set) -> None:
        super().__init__()
        self.weights, self.copies = weights, set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten._to_copy.default
            and isinstance(args[0], torch.Tensor)
            and args[0].untyped_storage().data_ptr() in self.weights
        ):
            self.copies.add(out.untyped_storage().data_ptr())
        return out


# Lightning's `trainer.precision` -> (dtype the weights are converted to, None: as loaded; autocast dtype or None).
PRECISIONS = {
    "32-true": (None, None),
    "32": (None, None),
    "64-true": (torch.float64, None),
    "64": (torch.float64, None),
    "bf16-true": (torch.bfloat16, None),
    "16-true": (torch.float16, None),
    "bf16-mixed": (None, torch.bfloat16),
    "bf16": (None, torch.bfloat16),
    "16-mixed": (None, torch.float16),
    "16": (None, torch.float16),
}


def precision_dtypes(cfg: DictConfig, config: Any) -> Tuple[torch.dtype, Optional[torch.dtype]]:
    """(dtype of the weights while indexing, autocast dtype or None) under `trainer.precision`.

    `*-true` converts the weights (Lightning does it before validation), `*-mixed` keeps them and
    runs the forward under autocast. Unset means "32-true": the weights stay as `model.dtype` loads them.
    """
    precision = str(cfg.trainer.get("precision", None) or "32-true")
    if precision not in PRECISIONS:
        raise ConfigError(
            f"setting 'trainer.precision'={precision!r} is not one gradian plan can predict; use one of {', '.join(PRECISIONS)}"
        )
    weights, autocast = PRECISIONS[precision]
    return weights or model_dtype(cfg, config), autocast


def _saved_activation_bytes(
    config: Any,
    layers: int,
    dtype: torch.dtype,
    tokens: int,
    trust_remote_code: bool,
    autocast: Optional[torch.dtype] = None,
) -> Tuple[int, int]:
    """Bytes autograd keeps for backward in one indexing forward of `tokens` tokens through `layers`
    layers, and the part of them that the layers' `mlp` blocks keep: (all, mlp).

    As `GradientRows` runs it: parameters detached (no Linear input is kept for a weight
    gradient), and the graph starting at the embeddings' output, a safe bound for any module_filter
    (the real graph starts at the first captured module's output).

    Under `autocast`, the low-precision copies of Linear weights it saves are left out: they do not
    grow with tokens (`autocast_weight_bytes` counts them once).
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model = model.to_empty(device="cpu")  # real storage, random values: only sizes matter here
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.requires_grad_(False)  # plan's own throwaway copy: the same graph as detached parameters
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    casts = _WeightCasts(weights)  # autocast's copies of the weights: counted once, not per token
    saved: Dict[int, Tuple[int, bool]] = {}  # storage -> (bytes, saved inside an mlp block)
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if (
            storage.data_ptr() not in weights and storage.data_ptr() not in casts.copies
        ):  # weights are saved too, but they are not activations
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), inside[0]))
        return t

    for unit in recomputed_units(model, "mlp"):
        unit.register_forward_pre_hook(lambda module, args: inside.__setitem__(0, True))
        unit.register_forward_hook(lambda module, args, out: inside.__setitem__(0, False))

    ids = torch.randint(0, min(100, config.vocab_size), (1, tokens))
    no_logits = torch.zeros(1, tokens, dtype=torch.bool)  # the logits are accounted for separately
    mixed = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), mixed, casts:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=no_logits, use_cache=False)
    return sum(size for size, _ in saved.values()), sum(size for size, mlp in saved.values() if mlp)


def activation_bytes_per_token(
    config: Any,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    tokens: int = 32,
    autocast: Optional[torch.dtype] = None,
    recompute: str = "none",
) -> int:
    """Bytes of activations kept for backward per token (prompt, completion and padding alike).

    Measured, not modelled: one forward of a 1-layer and a 2-layer copy of the architecture (random
    weights of `dtype`, full width, under `autocast` when given) under `saved_tensors_hooks`; the
    difference is one layer's share, plus what the 1-layer model keeps outside its layer.
    `recompute` (`grads.recompute`, recompute.py): "none", every layer keeps its share; "layers",
    one layer's share is alive at a time, beside every layer's input ([tokens, hidden] in `dtype`);
    "mlp", every layer keeps its share less its MLP block's, plus the block's input, and one
    block's share is alive at a time.
    """
    (one, mlp), (two, _) = (
        _saved_activation_bytes(config, n, dtype, tokens, trust_remote_code, autocast) for n in (1, 2)
    )
    per_layer, layers = two - one, config.num_hidden_layers
    hidden = (
        int(config.hidden_size) * torch.empty((), dtype=dtype).element_size()
    )  # one [tokens, hidden] input, per token
    if recompute == "layers":
        return int(round(one / tokens + layers * hidden))
    if recompute == "mlp" and mlp > 0:
        return int(round((one - per_layer + layers * (per_layer - mlp) + mlp) / tokens + layers * hidden))
    return int(round((one - per_layer + per_layer * layers) / tokens))


def peak_bytes(
    weights: int,
    tokens: int,
    act_per_token: int,
    n_supervised: int,
    vocab_size: int,
    chunk_tokens: Optional[int] = None,
    copies: float = 1.0,
) -> int:
    """Predicted peak of one indexing batch: weights + activations + `copies` × fp32 logits.

    `tokens` counts every position of the padded batch (batch × padded length); `chunk_tokens` is
    grads.loss_chunk_tokens (None: the whole batch's supervised tokens at once); `copies` is
    `memory.logit_peak_copies` of the model's logit dtype.
    """
    return int(weights + tokens * act_per_token + copies * fp32_logit_bytes(n_supervised, vocab_size, chunk_tokens))


def largest_fitting_batch(
    counts_desc: Sequence[int],
    longest: int,
    vocab_size: int,
    weights: int,
    act_per_token: int,
    memory_bytes: int,
    chunk_tokens: Optional[int] = None,
    copies: float = 1.0,
) -> int:
    """Largest b whose worst-case batch fits in `memory_bytes`: the b rows with most supervised
    tokens (`counts_desc`, sorted descending), padded to the longest row. 0 when one row does not fit."""
    b = np.arange(1, len(counts_desc) + 1, dtype=np.int64)
    worst = np.cumsum(np.asarray(counts_desc, dtype=np.int64))
    if chunk_tokens is not None:
        worst = np.minimum(worst, chunk_tokens)
    need = weights + b * longest * act_per_token + copies * worst * vocab_size * FP32_BYTES
    fits = np.flatnonzero(need <= memory_bytes)
    return int(fits[-1] + 1) if len(fits) else 0


def index_layout(model: torch.nn.Module, spec: IndexSpec, rows: int) -> Dict[str, Any]:
    """What `gradian index` will write for `rows` rows: modules, row width, and bytes per storage dtype
    (the rows, their per-module float32 norms (and int8's scales) and the row statistics, index/layout.py and
    index/statistics.py; the per-row flags and zarr's metadata are left out). `statistics_bytes`
    is the statistics' share: about 4× the int8 rows below k² rows, then fixed.

    `model` may live on the meta device.
    """
    projector = GradientRows(model, spec).projector
    stats = statistics_bytes(projector.blocks, projector.width, rows)
    return {
        "modules": len(projector.blocks),
        "width": projector.width,
        "statistics_bytes": stats,
        "bytes_by_storage_dtype": {
            # a float32 norm per module, and for int8 a float32 scale per module too
            d: rows
            * (projector.width * np.dtype(NUMPY_DTYPE[d]).itemsize + len(projector.blocks) * (8 if d == "int8" else 4))
            + stats
            for d in STORAGE_DTYPES
        },
    }


def query_plan(cfg: DictConfig, model: torch.nn.Module, spec: IndexSpec, supervised: int) -> Dict[str, Any]:
    """What `gradian query` at `cfg.query.*` will run on the index these settings build: the method
    query.method=auto chooses (`choose_method`, the rule `gradian query` applies, the training data
    taken as there), why, and the exact pass's own bytes: one checkpoint's factor set, cached
    under index.path/factors/ (uncompressed), and one query's full-space directions in memory.

    `supervised` is the training rows' supervised tokens in all; `model` may live on the meta device."""
    q = QuerySpec.from_config(cfg.query)
    saved = len(cfg.model.checkpoints or []) or 1
    chosen = 1 if q.checkpoints == "last" else len(q.checkpoints) if isinstance(q.checkpoints, tuple) else saved
    selected = select_modules(model, list(spec.module_filter))
    shapes = [linear_features(m) for m in selected.values()]
    # The output head, where the estimator scores it as a part of its own (exact_modules' rule).
    head = head_part(model, selected, spec)[0] if exact_estimator(q, chosen).head else None
    diagonal = [linear_features(head[1])] if head is not None else []
    weights = sum(o * i for o, i in shapes + diagonal)
    refused = run_settings_against_exact(cfg.query.engine, bool(cfg.query.token_scores))
    resolved, why = choose_method(q, supervised, chosen, weights, lambda: refused)
    factors = factor_set_bytes(shapes, diagonal)
    return {
        "method": resolved.method,
        "why": why or f"query.method={q.method}",
        "cost": exact_cost(supervised, chosen, weights)[0],
        "exact_budget": q.exact_budget,
        "checkpoints": chosen,
        "factor_set_bytes": factors,
        "factor_cache_bytes": factors * chosen,
        "query_direction_bytes": 4 * weights,
        "queries_per_pass": max(1, QUERY_BYTES // max(4 * weights, 1)),
    }


def format_index_start(rows: int, layout: Dict[str, Any], storage_dtype: str, path: str, checkpoints: int = 1) -> str:
    """The line `gradian index` prints before its first batch: the predicted size of the whole
    index, `checkpoints` times the rows of one (each checkpoint has its rows and statistics)."""
    size = human_bytes(checkpoints * layout["bytes_by_storage_dtype"][storage_dtype])
    each = f" × {checkpoints} checkpoints" if checkpoints > 1 else ""
    return f"gradian index: {rows} rows{each} × {layout['modules']} modules, row width {layout['width']:,} ({storage_dtype}) -> {size} predicted for {path}"


def make_plan(cfg: DictConfig, device_memory: Optional[int] = None) -> Dict[str, Any]:
    """Everything `gradian plan` prints, as plain data (bytes are ints).

    `device_memory` (bytes) defaults to the visible accelerator's memory, unless trainer.accelerator
    is cpu; without either, no fitting batch size is computed.
    """
    require_for(cfg, "plan")
    fields = Fields.from_config(cfg.data)
    rows = streamed_rows(open_rows(cfg.data.train, fields))  # read forward, as gradian index reads it
    tokenizer, config = load_tokenizer_and_config(cfg.model)
    g, spec = cfg.grads, IndexSpec.from_config(cfg.grads)
    examples = TokenizedRows(rows, tokenizer, g.max_seq_length, source=str(cfg.data.train), fields=fields)
    # [N] int64 each, one row tokenised at a time (24 bytes a row): supervised targets (positions t
    # whose label[t + 1] is not -100), tokens, supervised tokens cut by max_seq_length.
    each = map(examples.__getitem__, range(len(examples)))
    per_row = ((sum(t != IGNORE_INDEX for t in e.labels[1:]), len(e.input_ids), e.truncated_tokens) for e in each)
    counts, lengths, cut = np.fromiter(per_row, dtype=np.dtype((np.int64, 3)), count=len(examples)).T
    model = meta_model(config, cfg.model.trust_remote_code)
    vocab = int(model.get_output_embeddings().out_features)
    dtype, autocast = precision_dtypes(cfg, config)
    weights = sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()
    if autocast is not None:  # autocast keeps a low-precision copy of every linear weight for backward
        weights += (
            sum(m.weight.numel() for m in model.modules() if linear_features(m) is not None)
            * torch.empty((), dtype=autocast).element_size()
        )
    act = activation_bytes_per_token(
        config, dtype, cfg.model.trust_remote_code, autocast=autocast, recompute=spec.recompute
    )
    copies = logit_peak_copies(
        torch.empty((), dtype=autocast or dtype).element_size()
    )  # the head's logits are in the autocast dtype, if any

    desc = np.sort(counts)[::-1]
    b = min(g.batch_size, len(counts))
    batches = [slice(i, i + g.batch_size) for i in range(0, len(counts), g.batch_size)]
    in_order = max(int(counts[s].sum()) for s in batches)
    chunk = spec.loss_chunk_tokens
    worst = fp32_logit_bytes(int(desc[:b].sum()), vocab, chunk)
    typical_logits = fp32_logit_bytes(int(round(b * counts.mean())), vocab, chunk)
    source = "--device-memory"
    if device_memory is None and str(cfg.trainer.get("accelerator", "auto")) != "cpu":
        found = accelerator_memory()
        if found is not None:
            device_memory, source = found[0], found[1]
    return {
        "model": str(cfg.model.name_or_path),
        "data": str(cfg.data.train),
        "rows": len(counts),
        "batch_size": g.batch_size,
        "max_seq_length": g.max_seq_length,
        "vocab_size": vocab,
        "supervised_tokens": {
            "max": int(counts.max()),
            "p95": float(np.percentile(counts, 95)),
            "mean": float(counts.mean()),
            "min": int(counts.min()),
        },
        "truncated_rows": int((cut > 0).sum()),
        "empty_rows": int((counts == 0).sum()),
        "fp32_logits_bytes": {
            "worst_case": worst,
            "typical": typical_logits,
            "largest_batch_in_index_order": fp32_logit_bytes(in_order, vocab, chunk),
        },
        "precision": {
            "trainer.precision": str(cfg.trainer.get("precision", None) or "32-true"),
            "weights_dtype": str(dtype).replace("torch.", ""),
            "autocast_dtype": None if autocast is None else str(autocast).replace("torch.", ""),
        },
        "loss_chunk_tokens": chunk,
        "weights_bytes": int(weights),
        "activation_bytes_per_token": act,
        "logit_peak_copies": copies,
        "peak_bytes": {
            "worst_case": peak_bytes(weights, b * int(lengths.max()), act, int(desc[:b].sum()), vocab, chunk, copies),
            "typical": int(round(weights + b * lengths.mean() * act + copies * typical_logits)),
            "largest_batch_in_index_order": max(
                peak_bytes(
                    weights, len(lengths[s]) * int(lengths[s].max()), act, int(counts[s].sum()), vocab, chunk, copies
                )
                for s in batches
            ),
        },
        "device_memory": None if device_memory is None else {"bytes": int(device_memory), "source": source},
        "largest_batch_size_that_fits": None
        if device_memory is None
        else largest_fitting_batch(desc, int(lengths.max()), vocab, weights, act, device_memory, chunk, copies),
        # The third lever, offered only when it is off: the same rows with a bounded loss peak.
        "largest_batch_size_that_fits_with_suggested_chunk": None
        if device_memory is None or chunk is not None
        else largest_fitting_batch(
            desc, int(lengths.max()), vocab, weights, act, device_memory, SUGGESTED_LOSS_CHUNK_TOKENS, copies
        ),
        "suggested_loss_chunk_tokens": SUGGESTED_LOSS_CHUNK_TOKENS,
        "index": index_layout(model, spec, len(counts)),
        "query": query_plan(cfg, model, spec, int(counts.sum())),
    }


def format_plan(plan: Dict[str, Any]) -> str:
    """The plan as the lines `gradian plan` prints."""
    s, f = plan["supervised_tokens"], plan["fp32_logits_bytes"]
    n, copies, pr = plan["rows"], plan["logit_peak_copies"], plan["precision"]
    lines = [
        f"gradian plan: {n} rows of {plan['data']} at grads.max_seq_length={plan['max_seq_length']}, model {plan['model']} (vocab {plan['vocab_size']:,})",
        f"  supervised tokens per row: max {s['max']}, p95 {s['p95']:.1f}, mean {s['mean']:.1f}, min {s['min']}",
        f"  rows cut by grads.max_seq_length: {plan['truncated_rows']} ({100.0 * plan['truncated_rows'] / n:.1f}%); rows left with nothing supervised: {plan['empty_rows']}",
        f"  fp32 logits at grads.batch_size={plan['batch_size']} (supervised tokens × vocab × 4 bytes"
        + (
            f"; at most grads.loss_chunk_tokens={plan['loss_chunk_tokens']} tokens at a time):"
            if plan["loss_chunk_tokens"]
            else "):"
        ),
        f"    worst case (the {min(plan['batch_size'], n)} rows with most supervised tokens): {human_bytes(f['worst_case'])}",
        f"    typical (batch_size × mean): {human_bytes(f['typical'])}",
        f"    largest batch in gradian index's order: {human_bytes(f['largest_batch_in_index_order'])}",
        f"  trainer.precision={pr['trainer.precision']}: weights in {pr['weights_dtype']}"
        + (
            f", forward under {pr['autocast_dtype']} autocast (its weight copies counted with the weights)"
            if pr["autocast_dtype"]
            else ""
        ),
        f"  activations kept for backward: {human_bytes(plan['activation_bytes_per_token'])} per token (prompt and padding included)",
        f"  predicted peak (weights {human_bytes(plan['weights_bytes'])} + activations + {copies:g} × fp32 logits): "
        f"worst case {human_bytes(plan['peak_bytes']['worst_case'])}, typical {human_bytes(plan['peak_bytes']['typical'])}, "
        f"largest batch in gradian index's order {human_bytes(plan['peak_bytes']['largest_batch_in_index_order'])}",
    ]
    memory = plan["device_memory"]
    if memory is None:
        lines.append(
            "  largest batch size that fits: unknown (no accelerator visible); pass --device-memory, e.g. --device-memory 24GiB"
        )
    else:
        fits = plan["largest_batch_size_that_fits"]
        what = (
            f"{fits}" + (" (every row at once)" if fits >= n else "")
            if fits
            else "0: not even the largest row fits; lower grads.max_seq_length or use a larger device"
        )
        lines.append(f"  largest batch size that fits {human_bytes(memory['bytes'])} ({memory['source']}): {what}")
        chunked, c = plan["largest_batch_size_that_fits_with_suggested_chunk"], plan["suggested_loss_chunk_tokens"]
        if chunked is not None and chunked > fits:
            lines.append(
                f"  with grads.loss_chunk_tokens={c} (head and fp32 loss {c} tokens at a time, recomputed in backward: the same rows, "
                f"fp32 logits at most {human_bytes(fp32_logit_bytes(c, plan['vocab_size']))}): {chunked}"
                + (" (every row at once)" if chunked >= n else "")
            )
    ix = plan["index"]
    sizes = ", ".join(f"{d} {human_bytes(b)}" for d, b in ix["bytes_by_storage_dtype"].items())
    lines.append(
        f"  index on disk ({n} rows × width {ix['width']:,} from {ix['modules']} modules, uncompressed, {human_bytes(ix['statistics_bytes'])} of it row statistics): {sizes}"
    )
    q = plan["query"]
    lines.append(f"  gradian query: {q['why']}")
    if q["method"] == "exact":
        lines.append(
            f"    the exact pass: factors cached under index.path/factors/ {human_bytes(q['factor_cache_bytes'])} "
            f"({q['checkpoints']} checkpoint(s), uncompressed); {human_bytes(q['query_direction_bytes'])} of directions a query in memory, "
            f"{q['queries_per_pass']} queries a pass over the training rows"
        )
    return "\n".join(lines)
