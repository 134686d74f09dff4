"""The random training subsets of one validation run, and their measured query losses, on disk.

`output/plan.json` holds the subsets and the settings that drew them; `output/subsets/` one JSON file
per finished training run (subset m, repeat r). Each file is written to a temporary name and renamed,
so a killed run leaves only whole files: a rerun keeps them and trains the rest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from gradian_lightning.errors import ConfigError


def random_subsets(num_rows: int, num_subsets: int, alpha: float, seed: int) -> np.ndarray:
    """Bool [num_subsets, num_rows]: each row holds round(alpha * num_rows) rows drawn without replacement."""
    size = min(max(1, round(alpha * num_rows)), num_rows)
    rng = np.random.default_rng(seed)
    chosen = np.zeros((num_subsets, num_rows), dtype=bool)
    for m in range(num_subsets):
        chosen[m, rng.choice(num_rows, size=size, replace=False)] = True
    return chosen


def write_json_atomically(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, through a temporary file and a rename: never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)


class SubsetRuns:
    """The subsets of the run in `output` and the query losses measured so far.

    Creating it with `plan` (the settings that decide the subsets and what a loss means) either
    starts a run or resumes the one there; a run of other settings there is refused, naming them.
    """

    def __init__(self, output: str | Path, plan: Dict[str, Any], num_rows: int) -> None:
        self.output = Path(output)
        stored = self.output / "plan.json"
        if stored.is_file():
            old = json.loads(stored.read_text())
            differing = sorted(k for k in set(old["plan"]) | set(plan) if old["plan"].get(k) != plan.get(k))
            if differing:
                raise ConfigError(
                    f"setting 'validate.output'={str(self.output)!r} holds a validation run of other settings (differing: {', '.join(differing)}); rerun with its settings to resume it, or choose another validate.output"
                )
            self.subsets = np.asarray(old["subsets"], dtype=bool)
        else:
            self.subsets = random_subsets(num_rows, plan["num_subsets"], plan["alpha"], plan["seed"])
            write_json_atomically(stored, {"plan": plan, "subsets": self.subsets.astype(int).tolist()})
        self.repeats = int(plan["repeats"])

    @classmethod
    def existing(cls, output: str | Path) -> "SubsetRuns":
        """The run already in `output`, with the settings it was drawn with (for reading it back)."""
        stored = Path(output) / "plan.json"
        if not stored.is_file():
            raise ConfigError(
                f"setting 'validate.output'={str(output)!r} holds no validation run (no plan.json); run gradian validate with it first"
            )
        saved = json.loads(stored.read_text())
        return cls(output, saved["plan"], len(saved["subsets"][0]))

    def _path(self, m: int, r: int) -> Path:
        return self.output / "subsets" / f"subset-{m:03d}-repeat-{r}.json"

    def todo(self) -> List[tuple]:
        """(subset, repeat) pairs not yet trained, in order."""
        return [(m, r) for m in range(len(self.subsets)) for r in range(self.repeats) if not self._path(m, r).is_file()]

    def save(self, m: int, r: int, seed: int, query_loss: np.ndarray, seconds: float) -> None:
        """Record subset m's r-th training run: its seed and each query's summed loss [Q] (nats)."""
        write_json_atomically(
            self._path(m, r),
            {"subset": m, "repeat": r, "seed": seed, "seconds": seconds, "query_loss": [float(x) for x in query_loss]},
        )

    def losses(self) -> Optional[np.ndarray]:
        """Float64 [repeats, M, Q] of every query's loss under every run; None until all are done."""
        if self.todo():
            return None
        runs = [
            [json.loads(self._path(m, r).read_text())["query_loss"] for m in range(len(self.subsets))]
            for r in range(self.repeats)
        ]
        return np.asarray(runs, dtype=np.float64)
