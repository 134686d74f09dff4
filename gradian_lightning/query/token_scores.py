"""Which tokens of a training row carry its score: each supervised token's share of the row's score.

A row's gradient is the sum of its supervised tokens' loss gradients (the loss is their sum), and
the projection and preconditioners are linear, so the projected row is the sum of the tokens'
projected rows, and its score against a query splits into one term per token:

    inner     score = q·W r            = Σ_s q·W r_s
    cosine    score = Σ_m q̂_m·(W r)_m / (M |(W r)_m|)   (per module; whole-row cosine likewise)
              and each token's term divides by the same norms, of the whole row, not its own.

(W: the preconditioner, identity for none.) The terms therefore sum to the row's score, as computed
from the unrounded row; the index stores the row rounded to grads.storage_dtype, so the ranked
score differs from the sum by that rounding. Each token's row is the row of a copy of the example
supervised at that token alone, through the same `GradientRows` (gradients/batch.py): one
forward/backward of as many copies as the row has supervised tokens.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from gradian_lightning.data import IGNORE_INDEX, JsonlDataset, collate
from gradian_lightning.gradients.batch import BATCH_KEYS, GradientRows
from gradian_lightning.hub import pad_token_id
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.rows import index_gradient_rows
from gradian_lightning.query.scorer import Scorer


def token_texts(tokenizer: Any, ids: List[int]) -> List[str]:
    """Each token's piece of the decoded text, with the spaces before it, so that the pieces joined
    read as the text (a token's own string lacks the space for some tokenizers, has a marker in others)."""
    pieces, before = [], ""
    for t in range(len(ids)):
        upto = tokenizer.decode(ids[: t + 1])
        pieces.append(upto[len(before) :] if upto.startswith(before) else tokenizer.decode(ids[t : t + 1]))
        before = upto
    return pieces


def token_rows(
    index: IndexReader,
    model: nn.Module,
    tokenizer: Any,
    row: Dict[str, Any],
    gradient_rows: Optional[GradientRows] = None,
) -> Dict[str, Any]:
    """The projected gradient of each supervised token's loss of one data row, as the index's rows are made.

    Returns {"tokens": the row's text token by token (str, with the spaces before each), "supervised": bool per token,
    "rows": float32 [S, D], one per supervised token in order}. Their sum is the row's projected
    gradient (unrounded). Mode, RNG and parameters' .grad are left as they were. `gradient_rows`:
    `index_gradient_rows(index, model)` when the caller already made it (checked once for many rows).
    """
    gradient_rows = gradient_rows or index_gradient_rows(index, model)
    max_len = index.meta.max_seq_length or 2**31 - 1
    example = JsonlDataset([row], tokenizer, max_len, source="token scores").examples[0]
    targets = [t for t in range(1, len(example.labels)) if example.labels[t] != IGNORE_INDEX]
    device = next(gradient_rows.model.parameters()).device
    tokens = token_texts(tokenizer, example.input_ids)
    if not targets:
        return {
            "tokens": tokens,
            "supervised": [False] * len(tokens),
            "rows": torch.zeros(0, gradient_rows.projector.width),
        }
    copies = []
    for t in targets:  # the example supervised at token t alone
        labels = [IGNORE_INDEX] * len(example.labels)
        labels[t] = example.labels[t]
        copies.append(type(example)(example.index, example.id, example.input_ids, labels, 0))
    out = []
    for lo in range(0, len(copies), 16):  # collated here: a DataLoader's iterator draws from the caller's RNG
        batch = collate(copies[lo : lo + 16], pad_token_id=pad_token_id(tokenizer))
        out.append(gradient_rows({k: batch[k].to(device) for k in BATCH_KEYS})[0].cpu())
    supervised = [t > 0 and example.labels[t] != IGNORE_INDEX for t in range(len(example.labels))]
    return {"tokens": tokens, "supervised": supervised, "rows": torch.cat(out)}


def query_token_scores(
    scorer: Scorer, model: nn.Module, tokenizer: Any, rows: List[Dict[str, Any]], query: int = 0
) -> List[Dict[str, Any]]:
    """Each supervised token's term of each training row's score against query number `query` of
    `scorer` (a `Scorer` of the index, made with `shortcut=False` and prepared with the query rows).

    `rows`: the training rows to explain (data rows, as in data.train). Returns per training row
    {"tokens", "supervised", "terms": [float per token, None where not supervised], "score": their
    sum (the row's score from its unrounded gradient)}, in the order of `rows`.
    """
    made = index_gradient_rows(scorer.index, model)
    explained = []
    for row in rows:
        parts = token_rows(scorer.index, model, tokenizer, row, made)
        values = scorer.token_terms(parts["rows"])[query].tolist() if len(parts["rows"]) else []
        terms, it = [], iter(values)
        for supervised in parts["supervised"]:
            terms.append(next(it) if supervised else None)
        explained.append(
            {"tokens": parts["tokens"], "supervised": parts["supervised"], "terms": terms, "score": float(sum(values))}
        )
    return explained


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
