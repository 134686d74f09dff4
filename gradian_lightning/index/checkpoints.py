"""Several checkpoints of one model in one index (TracIn-CP / LESS: scores summed over checkpoints).

    index.path/                        root zarr group; attribute "gradian" = the newest checkpoint's
                                       metadata plus "checkpoints": [{"step", "lr", "group", "complete"}]
                                       sorted by step (lr: the mean learning rate of the training
                                       segment that made its weights, or None: `SegmentRate`)
      checkpoints/step-<step>/         one checkpoint: exactly the layout of a one-checkpoint index
                                       (layout.py), with its own rows and statistics/

Plain zarr: `zarr.open_group(path)["checkpoints/step-120/grads"]`; the attribute lists the groups.
An index without the "checkpoints" key (every index written before this file existed, and any
index written without `checkpoints=True`) is its own single checkpoint at its `global_step`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gradian_lightning.errors import ConfigError
from gradian_lightning.index.layout import ATTRIBUTE, FORMAT_VERSION, IndexMeta, identity, stored_meta
from gradian_lightning.index.location import Location

GROUP = "checkpoints"


class SegmentRate:
    """The learning rate a checkpoint is recorded with: the mean rate of the optimizer steps taken
    since the checkpoint indexed before it (the training segment that made its weights; since the
    start of training for the first), as LESS weighs each checkpoint by its epoch's mean rate. It is
    the η of TracIn-CP's Σ_i η_i ∇ℓ(z', θ_i)·∇ℓ(z, θ_i) (`checkpoint_weights`), and with the steps
    between checkpoints, ηT, the training time of the segment. Not the rate of the last step alone:
    under a linear or cosine decay to 0 that is about 0 at the end, and the sum would weigh the
    fine-tuned model out (0.07% of the weight for the last of 4 checkpoints over 1,000 steps of a
    linear decay; its segment's mean rate gives it 6%).

    A callback calls `step` with the rate of each optimizer step, read where the step uses it
    (before the scheduler moves it on), and `close` at each checkpoint it indexes. A tensor rate
    (capturable optimizers; the scheduler updates it in place) is summed on its device into a new
    tensor and read back only at `close`: no synchronisation per step, nothing of the optimizer's changed.
    """

    def __init__(self) -> None:
        self.total: Any = 0.0  # Σ rate over the open segment's steps: a float, or a tensor
        self.steps = 0  # optimizer steps in the open segment
        self.last: Optional[float] = None  # the rate `close` returned last

    def step(self, lr: Any) -> None:
        """One optimizer step at rate `lr` (a number or a tensor; never modified)."""
        self.total = self.total + (lr.detach() if hasattr(lr, "detach") else float(lr))
        self.steps += 1

    def close(self, now: Any = None) -> Optional[float]:
        """The rate of the checkpoint indexed now, and a new segment opened. With no step since
        the checkpoint before (its weights indexed again), that checkpoint's rate; before any step,
        `now`, the rate the first step will take (None without an optimizer)."""
        if self.steps:
            self.last = float(self.total) / self.steps
            self.total, self.steps = 0.0, 0
        elif self.last is None and now is not None:
            return float(now)
        return self.last

    def state(self) -> Dict[str, Any]:
        """Plain numbers, for a training checkpoint (a resumed fit sums on from them)."""
        return {"lr_sum": float(self.total), "lr_steps": self.steps, "lr": self.last}

    def load(self, state: Dict[str, Any]) -> None:
        """Back to `state()`'s numbers; keys missing (a checkpoint saved before them) leave a fresh record."""
        self.total, self.steps = float(state.get("lr_sum") or 0.0), int(state.get("lr_steps") or 0)
        self.last = state.get("lr")


def checkpoint_group(step: int) -> str:
    """The group of checkpoint `step`, relative to the index root."""
    return f"{GROUP}/step-{int(step)}"


def checkpoint_entries(meta: IndexMeta) -> List[Dict[str, Any]]:
    """The checkpoints of an index, oldest first; a one-checkpoint index is one entry with group ""."""
    if meta.checkpoints:
        return [dict(e) for e in meta.checkpoints]
    return [
        {
            "step": meta.global_step or 0,
            "lr": meta.lr,
            "group": "",
            "complete": meta.complete,
            "weights_sha256": meta.model.get("weights_sha256"),
        }
    ]


def register_checkpoint(
    root: str | Path, step: int, lr: Optional[float], meta: Dict[str, Any], complete: bool, overwrite: bool = False
) -> str:
    """Create or update the root of a checkpointed index and list checkpoint `step` in it; returns its path.

    `meta` is the checkpoint's metadata (the root attribute mirrors the newest checkpoint's, so
    `open_index(root).meta` describes the rows a query must match). A root that holds a
    one-checkpoint index or something else is replaced only with `overwrite`.
    """
    root = Location(root)  # a local directory or an fsspec URL
    old = stored_meta(root)
    if not root.is_empty() and (old is None or "checkpoints" not in old or _rows_layout(old) != _rows_layout(meta)):
        if not overwrite:
            if old is None:
                raise root.not_an_index()  # index.overwrite=true would be refused for it too
            what = (
                "a Gradian index of another configuration" if "checkpoints" in old else "a one-checkpoint Gradian index"
            )
            raise ConfigError(
                f"index.path {str(root)!r} holds {what}, not checkpoints of this job; choose another index.path or pass index.overwrite=true to replace it"
            )
        root.remove_index(holds_index=old is not None)
        old = None
    group = root.open_group("a")
    group.require_group(GROUP)
    entries = [e for e in (old or {}).get("checkpoints", []) if int(e["step"]) != int(step)]
    weights = (meta.get("model") or {}).get("weights_sha256")  # which checkpoint a query's weights are
    entries.append(
        {
            "step": int(step),
            "lr": lr,
            "group": checkpoint_group(step),
            "complete": bool(complete),
            "weights_sha256": weights,
        }
    )
    entries.sort(key=lambda e: e["step"])
    newest = meta if int(step) >= entries[-1]["step"] else dict((old or meta))
    group.attrs[ATTRIBUTE] = {
        **newest,
        "format_version": FORMAT_VERSION,
        "checkpoints": entries,
        "complete": all(e["complete"] for e in entries),
    }
    return f"{str(root).rstrip('/')}/{checkpoint_group(step)}"


def _rows_layout(meta: Dict[str, Any]) -> Tuple[Any, ...]:
    # What every checkpoint of one index shares: its identity but the model's name, which may
    # differ (a base and its fine-tune), and the row count.
    shared = {k: v for k, v in identity(meta).items() if k != "model"}
    return tuple(json.dumps(v, sort_keys=True, default=str) for v in (shared, meta.get("num_rows")))


def checkpoint_weights(entries: Sequence[Dict[str, Any]], which: Any) -> List[Tuple[Dict[str, Any], float]]:
    """The checkpoints a query scores with, and their weights.

    `which`: "last" (the newest checkpoint, weight 1), "all", or a list of steps. With more than
    one, each checkpoint's scores are weighted by its learning rate as in TracIn-CP and LESS, or
    equally when any of them has no recorded learning rate (an index built from saved models).
    The weights are scaled to sum to 1 (the ranking is the same; a cosine score stays in [-1, 1]).
    """
    by_step = {int(e["step"]): e for e in entries}
    if which == "last":
        chosen = [entries[-1]]
    elif which == "all":
        chosen = list(entries)
    else:
        steps = [int(s) for s in (which if isinstance(which, (list, tuple)) else [which])]
        missing = [s for s in steps if s not in by_step]
        if missing or not steps:
            raise ConfigError(
                f"setting 'query.checkpoints'={which!r} names steps {missing} that the index does not hold; use last, all, or a list of its steps {sorted(by_step)}"
            )
        chosen = [by_step[s] for s in steps]
    if len(chosen) == 1:
        return [(chosen[0], 1.0)]
    lrs = [e.get("lr") for e in chosen]
    if any(lr is None for lr in lrs) or sum(float(lr) for lr in lrs) <= 0:
        return [(e, 1.0 / len(chosen)) for e in chosen]
    zero = [int(e["step"]) for e, lr in zip(chosen, lrs) if float(lr) == 0]
    if zero:  # said, not changed: a segment trained at rate 0 does add nothing
        # stacklevel=1, from here: one place, so a query that weighs its checkpoints several times says it once.
        warnings.warn(
            f"query.checkpoints={which!r} sums checkpoints {zero}, whose recorded learning rate is 0: they add nothing to the scores (GradientIndexer before segment rates recorded the next step's rate, 0 after a decay to 0); rebuild the index with gradian index and model.checkpoints, or list the steps to sum in query.checkpoints",
            stacklevel=1,
        )
    total = sum(float(lr) for lr in lrs)
    return [(e, float(lr) / total) for e, lr in zip(chosen, lrs)]
