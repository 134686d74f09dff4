"""Which tokens of a training row carry its score: each token's share of the row's score.

A row's projected gradient is, per module, Σ_t (P_out δ_t)(P_in x_t)ᵀ over its positions t
(gradients/projection.py), δ_t the output-gradient of the whole row's loss at position t and x_t
the module's input there. One forward/backward of the row therefore gives each position's part
r_t, not summed (`GradientRows(..., per_position=True)`), and Σ_t r_t is the row. The projection
and the preconditioners are linear, so the row's score against a query splits into one term per
position:

    inner     score = q·W r            = Σ_t q·W r_t
    cosine    score = Σ_m q̂_m·(W r)_m / (M |(W r)_m|)   (per module; whole-row cosine likewise)
              and each position's term divides by the same norms, of the whole row, not its own.

(W: the preconditioner, identity for none.) A position's term is given to the token at that
position, the token whose activations x_t are: prompt tokens get terms too (a later token's loss
reaches them through attention), and a token's term includes the loss of predicting the token
after it (its δ_t is that loss's gradient, among others). The last token predicts nothing and no
loss depends on it: its term is 0. The terms sum to the row's score, as computed from the
unrounded row; the index stores the row rounded to grads.storage_dtype, so the ranked score
differs from the sum by that rounding. Cost: one forward/backward per row, rows batched.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from gradian_lightning.data import IGNORE_INDEX, JsonlDataset, collate
from gradian_lightning.gradients.batch import BATCH_KEYS, GradientRows
from gradian_lightning.hub import pad_token_id
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.rows import index_gradient_rows
from gradian_lightning.query.scorer import Scorer

# Rows run in one forward/backward: at most this many, and their per-position rows
# (rows × longest row's tokens × D float32) at most POSITION_BYTES, at least one row.
ROWS_AT_ONCE = 8
POSITION_BYTES = 256 * 2**20


def token_texts(tokenizer: Any, ids: List[int]) -> List[str]:
    """Each token's piece of the decoded text, with the spaces before it, so that the pieces joined
    read as the text (a token's own string lacks the space for some tokenizers, has a marker in others)."""
    pieces, before = [], ""
    for t in range(len(ids)):
        upto = tokenizer.decode(ids[: t + 1])
        pieces.append(upto[len(before) :] if upto.startswith(before) else tokenizer.decode(ids[t : t + 1]))
        before = upto
    return pieces


def each_token_rows(
    index: IndexReader,
    model: nn.Module,
    tokenizer: Any,
    rows: Sequence[Dict[str, Any]],
    gradient_rows: Optional[GradientRows] = None,
) -> Iterator[Dict[str, Any]]:
    """Each position's part of the projected gradient of each data row, as the index's rows are made.

    Yields per row, in order, {"tokens": the row's text token by token (str, with the spaces
    before each), "supervised": bool per token (a completion token, whose loss counts), "rows":
    float32 [T, D] on the model's device, row t the part of position t (module docstring)}. Their
    sum over T is the row's projected gradient (unrounded). Rows run `ROWS_AT_ONCE` at a time, one
    forward/backward each batch; a row with no supervised token gets zeros without one. Mode, RNG
    and parameters' .grad are left as they were. `gradient_rows`: `index_gradient_rows(index,
    model)` when the caller already made it (checked once for many rows).
    """
    gradient_rows = gradient_rows or index_gradient_rows(index, model)
    max_len = index.meta.max_seq_length or 2**31 - 1
    examples = JsonlDataset(list(rows), tokenizer, max_len, source="token scores").examples
    width = gradient_rows.projector.width
    pending: List[Any] = []
    for example in examples:
        longest = max(len(e.input_ids) for e in pending + [example])
        if pending and (len(pending) == ROWS_AT_ONCE or (len(pending) + 1) * longest * width * 4 > POSITION_BYTES):
            yield from _position_rows(gradient_rows, tokenizer, pending)
            pending = []
        pending.append(example)
    if pending:
        yield from _position_rows(gradient_rows, tokenizer, pending)


def _position_rows(gradient_rows: GradientRows, tokenizer: Any, examples: List[Any]) -> Iterator[Dict[str, Any]]:
    """`each_token_rows` of some examples, from one forward/backward of those with a supervised token."""
    device = next(gradient_rows.model.parameters()).device
    supervised = [[t > 0 and e.labels[t] != IGNORE_INDEX for t in range(len(e.labels))] for e in examples]
    runs = [e for e, s in zip(examples, supervised) if any(s)]
    made = iter(())
    if runs:  # collated here: a DataLoader's iterator draws from the caller's RNG
        batch = collate(runs, pad_token_id=pad_token_id(tokenizer))
        parts = gradient_rows({k: batch[k].to(device) for k in BATCH_KEYS}, per_position=True)[0]
        # Right padding: a row's positions are the first len(input_ids); the pads' parts are zero
        # (no loss depends on a position after the row's last token).
        made = iter([parts[i, : len(e.input_ids)] for i, e in enumerate(runs)])
    for e, s in zip(examples, supervised):
        rows = next(made) if any(s) else torch.zeros(len(e.input_ids), gradient_rows.projector.width, device=device)
        yield {"tokens": token_texts(tokenizer, e.input_ids), "supervised": s, "rows": rows}


def token_rows(
    index: IndexReader,
    model: nn.Module,
    tokenizer: Any,
    row: Dict[str, Any],
    gradient_rows: Optional[GradientRows] = None,
) -> Dict[str, Any]:
    """`each_token_rows` of one data row: {"tokens", "supervised", "rows": float32 [T, D]}."""
    return next(each_token_rows(index, model, tokenizer, [row], gradient_rows))


def row_token_terms(
    scorer: Scorer,
    model: nn.Module,
    tokenizer: Any,
    rows: Sequence[Dict[str, Any]],
    done: Optional[Callable[[int], Any]] = None,
) -> List[Dict[str, Any]]:
    """Each token's term of each training row's score against every query of `scorer` (a `Scorer`
    of the index, made with `shortcut=False` and prepared with the query rows), one
    forward/backward per row (batched) whatever the number of queries.

    `rows`: the training rows to explain (data rows, as in data.train); `done(1)` is called as each
    row is finished (a progress bar's `update`). Returns per training row, in order, {"tokens",
    "supervised", "terms": float64 [Q, T] (their sum over T is the row's score against each query,
    from its unrounded gradient), or None for a row with no supervised token (never ranked)}.
    """
    made = index_gradient_rows(scorer.index, model)
    explained = []
    for parts in each_token_rows(scorer.index, model, tokenizer, rows, made):
        terms = scorer.token_terms(parts["rows"]).cpu() if any(parts["supervised"]) else None
        explained.append({"tokens": parts["tokens"], "supervised": parts["supervised"], "terms": terms})
        if done is not None:
            done(1)
    return explained


def for_query(explained: Sequence[Dict[str, Any]], query: int) -> List[Dict[str, Any]]:
    """`row_token_terms` output for query number `query` alone: per row {"tokens", "supervised",
    "terms": [float per token, all None for a row with no supervised token], "score": their sum}."""
    out = []
    for e in explained:
        if e["terms"] is None:
            terms, score = [None] * len(e["tokens"]), 0.0
        else:
            terms = e["terms"][query].tolist()
            score = float(sum(terms))
        out.append({"tokens": e["tokens"], "supervised": e["supervised"], "terms": terms, "score": score})
    return out


def query_token_scores(
    scorer: Scorer, model: nn.Module, tokenizer: Any, rows: List[Dict[str, Any]], query: int = 0
) -> List[Dict[str, Any]]:
    """Each token's term of each training row's score against query number `query` of `scorer` (a
    `Scorer` of the index, made with `shortcut=False` and prepared with the query rows).

    `rows`: the training rows to explain (data rows, as in data.train). Returns per training row
    {"tokens", "supervised", "terms": [float per token; all None for a row with no supervised
    token], "score": their sum (the row's score from its unrounded gradient)}, in the order of
    `rows`. For several queries, `row_token_terms` explains each row once for all of them.
    """
    return for_query(row_token_terms(scorer, model, tokenizer, rows), query)


def summed_over_checkpoints(weighted: Sequence[Tuple[float, List[Dict[str, Any]]]]) -> List[Dict[str, Any]]:
    """`query_token_scores` of the same rows at several checkpoints, each (weight, explained), as one:
    every token's terms and the score weighted and summed, as the checkpoints' scores are
    (index/checkpoints.py), so the summed terms still add up to the summed score."""
    total: List[Dict[str, Any]] = []
    for weight, explained in weighted:
        if not total:
            total = [{**e, "terms": [None] * len(e["terms"]), "score": 0.0} for e in explained]
        for acc, e in zip(total, explained):
            acc["terms"] = [None if t is None else (a or 0.0) + weight * t for a, t in zip(acc["terms"], e["terms"])]
            acc["score"] += weight * e["score"]
    return total
