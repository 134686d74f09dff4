"""Query rows: arbitrary data rows -> projected loss gradients [Q, D], made exactly like an index's.

    query JSONL rows -> `query_gradients`: the index's model, modules, loss and projection, read
                        back from the index attributes -> query rows [Q, D] float32, rounded to the
                        index's storage dtype
A query that cannot match its index (another model, module layout, projection or dtype) stops
with one `IndexMismatchError` line naming each difference.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Collection, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import nn

from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError, DataError, IndexMismatchError
from gradian_lightning.gradients.batch import BATCH_KEYS, GradientRows
from gradian_lightning.gradients.capture import CAPTURABLE, linear_features, select_modules
from gradian_lightning.gradients.loss import LOSS_KIND
from gradian_lightning.gradients.peft import unwrap_peft
from gradian_lightning.gradients.weights import weights_digest
from gradian_lightning.hub import describe_model, normalized_name, pad_token_id
from gradian_lightning.index.layout import IndexMeta, round_trip
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.specs import MEMORY_SETTINGS, ROW_SETTINGS, IndexSpec, field_names


def index_mismatches(
    meta: IndexMeta,
    model: Optional[nn.Module] = None,
    spec: Optional[IndexSpec] = None,
    given: Optional[Collection[str]] = None,
) -> List[str]:
    """What disagrees between an index's attributes and a query's model and settings (empty: all agree).

    `spec` is the query's own `grads.*` settings, of which the fields named in `given` (default:
    all) are checked: its projection and storage dtype must be the index's, and with `model`, its
    module filter must select the index's modules. `model` is the model the query will run. Each
    entry is a short phrase.
    """
    found: List[str] = []
    given = set(field_names(IndexSpec) if given is None else given)
    if spec is not None:
        stored = meta.spec
        # The module filter is checked below, by the modules it selects in the query's model.
        for key in [k for k in ROW_SETTINGS if k in given and k != "module_filter"]:
            ours, theirs = getattr(spec, key), getattr(stored, key)
            if ours != theirs:
                found.append(f"grads.{key} is {ours!r} here but {theirs!r} in the index")
    if (meta.loss_kind or LOSS_KIND) != LOSS_KIND:
        found.append(f"the index's loss is {meta.loss_kind!r}, this gradian computes {LOSS_KIND!r}")
    if model is None:
        return found
    ours, theirs = describe_model(model), meta.model
    kind = [
        f"{what} is {ours[key]!r} here but {theirs[key]!r} in the index"
        for key, what in (("class", "model class"), ("vocab_size", "vocabulary size"), ("dtype", "model dtype"))
        if ours[key] is not None and theirs.get(key) is not None and ours[key] != theirs[key]
    ]
    found += kind or _weights_mismatch(model, ours, theirs, meta)  # other weights follow from another kind
    linears = dict(model.named_modules())
    modules_found = True
    for block in meta.blocks:
        name, shape = block.name, (block.out_features, block.in_features)
        module = linears.get(name)
        features = None if module is None else linear_features(module)
        if features is None:
            modules_found = False
            found.append(
                f"module {name!r} is missing from the model"
                if module is None
                else f"module {name!r} is {type(module).__name__}, not {CAPTURABLE}"
            )
        elif features != shape:
            modules_found = False
            found.append(f"module {name!r} is {features[0]}x{features[1]} here but {shape[0]}x{shape[1]} in the index")
    if spec is not None and modules_found and "module_filter" in given:
        try:
            chosen = list(select_modules(model, spec.module_filter))
        except ConfigError:
            chosen = []
        wanted = [b.name for b in meta.blocks]
        if chosen != wanted:
            found.append(
                f"grads.module_filter={list(spec.module_filter)!r} selects {len(chosen)} modules here, not the {len(wanted)} modules of the index"
            )
    return found


def _weights_mismatch(model: nn.Module, ours: Dict[str, Any], theirs: Dict[str, Any], meta: IndexMeta) -> List[str]:
    """[] when `model` holds the weights the index was built with, else the phrase saying what differs.

    By the weights' digest where the index recorded one; for the index of a sharded model, which
    records none (`weights_digest`), by the resolved model path."""
    indexed = theirs.get("weights_sha256")
    if indexed is None:
        name = normalized_name(theirs.get("name_or_path"))
        if ours["name_or_path"] is not None and name is not None and ours["name_or_path"] != name:
            return [f"model is {ours['name_or_path']!r} here but {name!r} in the index"]
        return []
    here = weights_digest(model)
    return (
        [_other_weights(here, indexed, theirs.get("name_or_path"), meta)]
        if here is not None and here != indexed
        else []
    )


def _other_weights(here: str, indexed: str, name: Optional[str], meta: IndexMeta) -> str:
    """The phrase for a model whose weights are not the ones these rows were made with."""
    at = f" at step {meta.global_step}" if meta.global_step is not None else ""
    built = f", built from {name!r}" if name else ""  # an index written from Python may not name its model
    phrase = f"the model's weights are not those the index was built with{at} (weights digest {here} here, {indexed} in the index{built})"
    held = [int(e["step"]) for e in meta.checkpoints if e.get("weights_sha256") == here]
    if held:
        return (
            phrase
            + f"; they are the weights of its checkpoint at step {held[0]}: score with that checkpoint (query.checkpoints=[{held[0]}], or index.at({held[0]}))"
        )
    return phrase


def check_matches_index(
    index: IndexReader,
    model: Optional[nn.Module] = None,
    spec: Optional[IndexSpec] = None,
    given: Optional[Collection[str]] = None,
) -> None:
    """Raise `IndexMismatchError`, one line naming each mismatch, when the query cannot match the
    index (`index_mismatches`)."""
    found = index_mismatches(index.meta, model, spec, given)
    if found:
        raise IndexMismatchError(
            f"the query does not match the index at {str(index.path)!r}: {'; '.join(found)}; query with the model and grads.* settings the index was built with"
        )


def index_gradient_rows(
    index: IndexReader,
    model: nn.Module,
    settings: Optional[IndexSpec] = None,
    given: Optional[Collection[str]] = None,
) -> GradientRows:
    """The `GradientRows` that make rows like `index`'s with `model`: the index's modules, found by
    name, and its stored spec (projection, seed, ...). `settings` and `given`: the caller's own
    `grads.*` settings (default: all of `settings` given), checked where given
    (`index_mismatches`); of them, those that change memory but never the rows
    (`specs.MEMORY_SETTINGS`: recompute, loss_chunk_tokens) replace the index's where given.
    Raises `IndexMismatchError` naming each mismatch; the model's weights digest is taken once, here."""
    model = unwrap_peft(model)
    check_matches_index(index, model, settings, given)
    linears = dict(model.named_modules())
    modules = {b.name: linears[b.name] for b in index.meta.blocks}
    given = set(field_names(IndexSpec) if given is None else given)
    memory = {k: getattr(settings, k) for k in MEMORY_SETTINGS if settings is not None and k in given}
    made = GradientRows(model, replace(index.meta.spec, **memory), modules)
    if tuple(made.projector.blocks) != index.meta.blocks:
        raise IndexMismatchError(
            f"the row layout rebuilt from the index at {str(index.path)!r} differs from its attributes (width {made.projector.width} vs {index.meta.width}); rebuild the index with `gradian index`"
        )
    return made


def tokenized_queries(
    index: IndexReader,
    rows: Sequence[Dict[str, Any]],
    tokenizer: Any,
    max_seq_length: Optional[int] = None,
    source: str = "query data",
) -> JsonlDataset:
    """Query rows tokenised as `index`'s rows were: `max_seq_length` defaults to the index's
    (its `data.max_seq_length`), or no truncation. `DataError` for a row with no supervised token."""
    if max_seq_length is None:
        max_seq_length = index.meta.max_seq_length or 2**31 - 1
    dataset = JsonlDataset(rows, tokenizer, max_seq_length, source=source)
    for example in dataset.examples:
        if all(label < 0 for label in example.labels[1:]):
            raise DataError(
                f"{source} row {example.index + 1} (id {example.id!r}) has no supervised token within max_seq_length={max_seq_length}; give it a completion or shorten its prompt"
            )
    return dataset


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
    settings: Optional[IndexSpec] = None,
    given: Optional[Collection[str]] = None,
) -> torch.Tensor:
    """Projected loss gradients [Q, D] float32 of arbitrary rows, made exactly like `index`'s rows.

    `rows` are dicts in any training-data format (prompt/completion, messages, text). The modules,
    projection (dim, seed) and storage dtype are read from the index attributes; the rows are
    rounded to the storage dtype, so a training row used as a query scores like its stored row.
    `max_seq_length` defaults to the one the index was built with (its `data.max_seq_length`), or
    no truncation. `device` defaults to the model's. The model's train/eval mode, RNG and
    parameters' `.grad` are left as they were. Raises `IndexMismatchError` naming each mismatch and
    `DataError` for a row with no supervised token. A `peft.PeftModel` is run as its base model
    (adapters in place), as `GradientIndexer` runs it. `settings`, `given`: the
    caller's `grads.*` settings to check against the index where given (`index_mismatches`), of
    which grads.recompute and grads.loss_chunk_tokens (memory only) are used where given.
    """
    gradient_rows = index_gradient_rows(index, model, settings, given)
    dataset = tokenized_queries(index, rows, tokenizer, max_seq_length, source)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    storage, blocks = index.meta.storage_dtype, index.meta.blocks
    out = []
    pad = pad_token_id(tokenizer)
    # Batches are collated here rather than by a DataLoader, whose iterator draws from the caller's RNG.
    for lo in range(0, len(dataset), batch_size):
        batch = collate(dataset.examples[lo : lo + batch_size], pad_token_id=pad)
        made, _ = gradient_rows({k: batch[k].to(device) for k in BATCH_KEYS}, forward_context)
        out.append(round_trip(made, storage, blocks))
    return torch.cat(out).to(device)
