"""The Linear Datamodeling Score (LDS; Park et al., TRAK, 2023), as Bergson, dattri and Kronfluence report it.

For M models trained on subsets S_1..S_M of the training rows and Q queries: a scorer predicts
model m's output on query q as the sum of its scores of the rows in S_m; the measured output is
-loss (the query's supervised-token loss summed, under model m). A query's LDS is the Spearman
rank correlation of the two over the M subsets; the score of a scorer is the mean over queries.

Centred LDS asks a narrower question. Some subsets lower every query's loss at once (rows that
teach a shared format or style, say): raw LDS rewards predicting that common movement, which says
little about which rows matter to one answer more than to others. Removing each subset's mean over
the queries, from the predicted and the measured outputs alike, before the per-query correlation
leaves only what moves one query relative to the rest. `shared_variance_share` says how much of the
variance the removed part held.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 of the last axis of `values` [..., n], ties given their average rank (float64)."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, axis=-1, kind="stable")
    ordered = np.take_along_axis(values, order, axis=-1)
    ranks = np.empty_like(values)
    for index in np.ndindex(values.shape[:-1]):
        row = ordered[index]
        # Each run of equal values gets the mean of the positions it spans.
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        ends = np.r_[starts[1:], len(row)]
        mean_position = np.repeat((starts + ends - 1) / 2.0, ends - starts)
        ranks[index + (order[index],)] = mean_position
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rho between a and b along the last axis ([..., n] each): the Pearson correlation
    of their average ranks. NaN where either side is constant (no ranking to compare)."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra -= ra.mean(axis=-1, keepdims=True)
    rb -= rb.mean(axis=-1, keepdims=True)
    denominator = np.sqrt((ra * ra).sum(axis=-1) * (rb * rb).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (ra * rb).sum(axis=-1) / denominator, np.nan)


def centred_over_queries(values: np.ndarray) -> np.ndarray:
    """`values` [M, Q] (float64) with each subset's mean over the Q queries removed from its row."""
    values = np.asarray(values, dtype=np.float64)
    return values - values.mean(axis=1, keepdims=True)


def linear_datamodeling_score(
    scores: np.ndarray, subsets: np.ndarray, outputs: np.ndarray, centred: bool = False
) -> np.ndarray:
    """Per-query LDS [Q] float64.

    scores [Q, N]: each query's score of each training row; subsets [M, N] bool: the rows each
    model was trained on; outputs [M, Q]: each model's measured output per query (-loss).
    `centred`: remove each subset's mean over queries from the predicted and the measured outputs
    first (needs Q >= 2; with one query nothing is left to correlate).
    """
    predicted = np.asarray(subsets, dtype=np.float64) @ np.asarray(scores, dtype=np.float64).T  # [M, Q]
    outputs = np.asarray(outputs, dtype=np.float64)
    if centred:
        predicted, outputs = centred_over_queries(predicted), centred_over_queries(outputs)
    return spearman(predicted.T, outputs.T)


def retraining_ceiling(losses: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per-query raw and centred LDS [Q] of one retraining predicting the other: `losses` [R, M, Q]
    (repeats >= 2, subsets, queries), the first two repeats' negated losses ranked against each
    other over the subsets; what no scorer can beat (gradian validate's "ceiling")."""
    first, second = -losses[0], -losses[1]
    return spearman(first.T, second.T), spearman(centred_over_queries(first).T, centred_over_queries(second).T)


def shared_variance_share(outputs: np.ndarray) -> float:
    """The share (0..1) of the outputs' variance across subsets that all queries share.

    outputs [M, Q]. Each query's output is centred over the subsets; the shared part is, per
    subset, the mean of those over the queries. Shared and query-specific parts are orthogonal,
    so the share is the shared part's sum of squares over the total's (NaN when nothing varies).
    """
    varying = np.asarray(outputs, dtype=np.float64)
    varying = varying - varying.mean(axis=0, keepdims=True)
    shared = varying.mean(axis=1, keepdims=True)  # [M, 1]
    total = float((varying * varying).sum())
    return float(varying.shape[1] * (shared * shared).sum() / total) if total > 0 else float("nan")


def mean_and_standard_error(values: np.ndarray) -> Tuple[float, float]:
    """Mean and standard error of the mean over the finite values (NaN, NaN when none)."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if len(finite) == 0:
        return float("nan"), float("nan")
    error = finite.std(ddof=1) / np.sqrt(len(finite)) if len(finite) > 1 else float("nan")
    return float(finite.mean()), float(error)
