"""The two settings objects: `IndexSpec` (how rows are made) and `QuerySpec` (how they are scored).

Each is a frozen dataclass that checks itself once, when it is made: the `grads.*` and `query.*`
config sections (config.py), `GradientIndexer`'s arguments and `Index.topk`'s all become one of
these, so every setting has one check and one default. An index stores its `IndexSpec` once, under
"spec" in its metadata (index/layout.py); the fingerprint, query rows and `gradian plan` read it
from there or from the config, never from a second copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from gradian_lightning.errors import ConfigError

STORAGE_DTYPES = ("float32", "float16", "bfloat16", "int8")
# What the indexing backward recomputes instead of keeping (gradients/recompute.py; costs: benchmarks/RESULTS.md §1).
RECOMPUTE = ("mlp", "layers", "none")
# Every decoder layer's MLP block, named by its role: the linear maps inside it are selected
# (capture.py), whatever an architecture calls them. Measured best (benchmarks/RANKING.md).
DEFAULT_MODULE_FILTER = ("mlp",)
# auto: cosine on the index's rows; under the exact pass what query/exact_scoring.py's estimator
# says (with factors, a cosine is taken in the preconditioner's metric).
SCORES = ("auto", "cosine", "inner")
NORMALIZE = ("auto", "module", "row")
# auto: fisher where the index kept the k²×k² second moments and counted at least k² rows, ekfac
# below that, diag where it kept none (query/precondition.py; the N sweep of benchmarks/studies/lds_sets).
PRECONDITIONS = ("auto", "none", "diag", "fisher", "ekfac", "kfac")
# index: score the stored projected rows (fast, any N); exact: re-read every training row and score
# it against full-space query gradients (query/exact.py, query/exact_scoring.py).
# auto: exact while the training rows' supervised tokens, times the checkpoints summed and the
# selected weights, are within
# query.exact_budget (and nothing asks for the index path), index past it (query/exact_scoring.py).
METHODS = ("auto", "index", "exact")
# query.exact_budget's default, in (supervised tokens + the pass's fixed cost, 1,100 tokens) x
# checkpoints x selected weights (about the multiply-adds of the pass): 3e10 keeps every tiny LDS
# set of issue 41 (up to 4,096 rows of a 2-layer model: 49 K MLP weights and its output head's 31-47 K, 5
# checkpoints) on the exact pass and sends SmolLM2-135M (79.6 M MLP and 28.3 M head weights) to the index whatever its rows: there the exact pass costs
# ~90 ms a token and checkpoint on one CPU thread plus ~100 s of eigendecompositions a checkpoint,
# and a 2-checkpoint query over 80 rows peaked at 22 GB (benchmarks/studies/lds_sets/README.md).
EXACT_BUDGET = 3e10
# What each method can precondition with: the index's row statistics, or full-space factors.
INDEX_PRECONDITIONS = ("auto", "none", "diag", "fisher", "ekfac")
EXACT_PRECONDITIONS = ("auto", "none", "kfac", "ekfac")
# exact: scan every row; ann: candidates from FAISS indexes, re-scored exactly; auto: ann past a
# measured row count (query/ann.py).
SEARCHES = ("exact", "ann", "auto")
DEFAULT_DAMPING = 1.0


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise `ConfigError` in the one format every setting's refusal has."""
    if not ok:
        raise ConfigError(f"setting '{key}'={value!r} is not allowed; use {allowed}")


def field_names(spec: type) -> Tuple[str, ...]:
    """The settings of a spec dataclass (`IndexSpec`, `QuerySpec`), in declaration order."""
    return tuple(f.name for f in fields(spec))


def spec_from_arguments(
    spec: type, caller: str, values: Sequence[Any], settings: Dict[str, Any], own: Sequence[str]
) -> Any:
    """`spec(*values, **settings)` for a `caller` that takes the spec's settings as its own
    arguments (`GradientIndexer`, `Index.topk`) beside the arguments named in `own`. An unknown
    keyword, a setting given twice or too many positional values is one `ConfigError` line that
    lists the valid names; the spec checks the values."""
    names = field_names(spec)
    unknown = [k for k in settings if k not in names] + [n for n in names[: len(values)] if n in settings]
    if unknown or len(values) > len(names):
        what = f"{unknown[0]}=..." if unknown else f"{len(values)} settings after the first argument"
        raise ConfigError(
            f"{caller}({what}) is not allowed: a name unknown, given twice or past the last setting; use {', '.join(own)}, or the {spec.__name__} settings {', '.join(names)} (in this order when positional), each once"
        )
    return spec(*values, **settings)


def plain(value: Any) -> Any:
    """An omegaconf node (ListConfig, DictConfig) as plain Python data; anything else as it is."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value


def module_patterns(value: Any) -> Tuple[str, ...]:
    """`grads.module_filter` (one pattern or a list of them) as a tuple of non-empty, stripped patterns."""
    value = plain(value)
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(p, str) and p.strip() for p in items):
        raise ConfigError(
            f"setting 'grads.module_filter'={value!r}: must be a module name pattern or a list of them, e.g. down_proj or [q_proj, v_proj]"
        )
    return tuple(p.strip() for p in items)


@dataclass(frozen=True)
class IndexSpec:
    """How an index's rows are made: the `grads.*` settings that `GradientIndexer` and `query_gradients` share.

    module_filter: name patterns of the Linear modules captured (`capture.select_modules`).
    projection_dim: k, rows per Kronecker factor (row width k² per module); None = exact gradients.
    storage_dtype: float32, float16, bfloat16 or int8 (one float32 scale per module block), the
        encoding of the stored rows (index/layout.py).
    seed: the projection's seed.
    recompute: what the backward runs again instead of keeping (gradients/recompute.py); memory only.
    loss_chunk_tokens: supervised tokens the output head and fp32 loss take at a time; memory only.

    The last two change peak memory and time, never the rows, so they are not part of the index's
    identity (`rows_identity`): an index resumes under other values of them.
    """

    module_filter: Tuple[str, ...] = DEFAULT_MODULE_FILTER
    # k = 32 in int8, and what it was measured against: docs/configuration.md, "Choosing the scoring".
    projection_dim: Optional[int] = 32
    storage_dtype: str = "int8"
    seed: int = 0
    recompute: str = "mlp"
    loss_chunk_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "module_filter", module_patterns(self.module_filter))
        dim, chunk = self.projection_dim, self.loss_chunk_tokens
        check(
            dim is None or (is_int(dim) and dim >= 1),
            "grads.projection_dim",
            dim,
            "an integer >= 1, or null for exact gradients",
        )
        check(
            self.storage_dtype in STORAGE_DTYPES, "grads.storage_dtype", self.storage_dtype, " or ".join(STORAGE_DTYPES)
        )
        check(is_int(self.seed), "grads.seed", self.seed, "an integer")
        check(self.recompute in RECOMPUTE, "grads.recompute", self.recompute, " or ".join(RECOMPUTE))
        check(
            chunk is None or (is_int(chunk) and chunk >= 1),
            "grads.loss_chunk_tokens",
            chunk,
            "an integer >= 1, or null for the whole batch at once",
        )

    @classmethod
    def from_config(cls, grads: Any) -> "IndexSpec":
        """The spec of a `grads.*` config section (its other keys, batch_size and max_seq_length, are the data's)."""
        return cls(**{f.name: plain(grads[f.name]) for f in fields(cls)})

    def to_meta(self) -> Dict[str, Any]:
        """Plain JSON data, as stored under "spec" in an index's metadata."""
        return {**asdict(self), "module_filter": list(self.module_filter)}

    def rows_identity(self) -> Dict[str, Any]:
        """What of the spec the row values depend on, in the form the fingerprint hashes
        (layout.identity) and a refusal to resume names ("projection.dim"); the module filter
        counts through the modules it selected."""
        return {
            "projection": {
                "kind": "kronecker_gaussian" if self.projection_dim else "exact",
                "dim": self.projection_dim,
                "seed": self.seed,
            },
            "storage_dtype": self.storage_dtype,
        }


# The IndexSpec settings that change memory and time only, never a row; every other one decides the rows.
MEMORY_SETTINGS = ("recompute", "loss_chunk_tokens")
ROW_SETTINGS = tuple(name for name in field_names(IndexSpec) if name not in MEMORY_SETTINGS)


@dataclass(frozen=True)
class QuerySpec:
    """How query rows score an index's rows: the `query.*` settings that both engines (local, Dask) take.

    top_k: rows kept per query, best first; "all" scores every row (what `gradian validate` needs).
    bottom_k: the most negative rows kept per query ("opponents"); 0 = none.
    score: "cosine", "inner" (dot product, after the preconditioner) or "auto": cosine on the
        index's rows; under the exact pass query/exact_scoring.py's choice (with factors, the
        cosine is taken in the preconditioner's metric, a whitened cosine).
    normalize: what cosine scales to unit norm: "module" (each module's block), "row", or "auto":
        row where the preconditioner is fisher, module otherwise (query/precondition.py: why).
    precondition: "auto", "none", "diag", "fisher" or "ekfac" on the index's rows
        (query/precondition.py); "auto", "none", "kfac" or "ekfac" (full-space factors) under the
        exact pass (query/exact_scoring.py).
    damping: added to the preconditioner, relative to the mean eigenvalue of each module's second moment.
    checkpoints: "all", "last" or a list of steps: whose scores are summed (index/checkpoints.py).
    search: "exact" (scan every row), "ann" (candidates from FAISS indexes, re-scored exactly) or
        "auto" (ann from a measured row count on); query/ann.py.
    ann_candidates: rows each ANN shard proposes per query, all re-scored exactly.
    ann_nprobe: IVF lists searched per shard and query (more: better recall, slower).
    ann_sketch_dim: width the rows as compared are count-sketched to before FAISS indexes them
        (wider rows only).
    ann_shard_rows: rows per ANN shard, each one FAISS index built and searched on its own.
    method: "index" (score the stored projected rows), "exact" (re-read every training row and
        score it against full-space query gradients: query/exact_scoring.py) or "auto": exact while
        the index's supervised tokens x checkpoints summed x selected weights are at most `exact_budget`.
    exact_budget: method=auto's budget for the exact pass, in (supervised training tokens + its
        fixed cost, 1,100 tokens) x checkpoints x the selected modules' weights.
    horizon: the exact pass's factors as approximate unrolling over a training time h >= 0 (in
        units of 1 / the mean eigenvalue), null for the influence function (H + λI)⁻¹ at
        `damping`, or "auto": what precondition=auto chooses, the influence function otherwise.
    """

    top_k: Any = 10
    bottom_k: int = 0
    score: str = "auto"
    normalize: str = "auto"
    precondition: str = "auto"
    damping: float = DEFAULT_DAMPING
    checkpoints: Any = "all"
    search: str = "exact"
    ann_candidates: int = 100
    ann_nprobe: int = 32
    ann_sketch_dim: int = 512
    ann_shard_rows: int = 1_000_000
    method: str = "auto"
    horizon: Any = "auto"
    exact_budget: float = EXACT_BUDGET

    def __post_init__(self) -> None:
        steps = plain(self.checkpoints)
        object.__setattr__(self, "checkpoints", tuple(steps) if isinstance(steps, list) else steps)
        k = self.top_k
        check(k == "all" or (is_int(k) and k >= 1), "query.top_k", k, 'an integer >= 1, or "all" for every row')
        check(is_int(self.bottom_k) and self.bottom_k >= 0, "query.bottom_k", self.bottom_k, "an integer >= 0")
        check(self.score in SCORES, "query.score", self.score, " or ".join(SCORES))
        check(self.normalize in NORMALIZE, "query.normalize", self.normalize, " or ".join(NORMALIZE))
        check(self.precondition in PRECONDITIONS, "query.precondition", self.precondition, " or ".join(PRECONDITIONS))
        check(
            isinstance(self.damping, (int, float)) and not isinstance(self.damping, bool) and self.damping >= 0,
            "query.damping",
            self.damping,
            f"a number >= 0 (relative to the mean eigenvalue; {DEFAULT_DAMPING} is the default)",
        )
        steps = self.checkpoints
        check(
            steps in ("last", "all") or (isinstance(steps, tuple) and steps and all(is_int(s) for s in steps)),
            "query.checkpoints",
            plain(steps) if not isinstance(steps, tuple) else list(steps),
            "last, all or a list of checkpoint steps",
        )
        check(self.search in SEARCHES, "query.search", self.search, " or ".join(SEARCHES))
        check(
            not (self.search == "ann" and k == "all"),
            "query.search",
            self.search,
            "exact (or auto) with query.top_k=all: the ANN search proposes candidates for a top-k, not every row",
        )
        for key in ("ann_candidates", "ann_nprobe", "ann_sketch_dim", "ann_shard_rows"):
            value = getattr(self, key)
            check(is_int(value) and value >= 1, f"query.{key}", value, "an integer >= 1")
        self._check_method()

    def forced_method(self) -> Optional[str]:
        """Under method=auto, the method a setting only one of them has asks for: "index" for diag,
        fisher, module cosine or the ANN search, else "exact" for kfac or a horizon number; else None."""
        if self.precondition in ("diag", "fisher") or self.normalize == "module" or self.search == "ann":
            return "index"
        if self.precondition == "kfac" or (is_number(self.horizon) and self.precondition != "none"):
            return "exact"
        return None

    def _check_method(self) -> None:
        """The settings that depend on query.method: each refused in one line naming the fix."""
        check(self.method in METHODS, "query.method", self.method, " or ".join(METHODS))
        check(
            is_number(self.exact_budget) and self.exact_budget >= 0,
            "query.exact_budget",
            self.exact_budget,
            f"a number >= 0 ((supervised training tokens + 1,100) x checkpoints x selected weights; {EXACT_BUDGET:g} is the default)",
        )
        # auto's settings must make sense for the method they ask for (index where none asks).
        method = (self.forced_method() or "index") if self.method == "auto" else self.method
        horizon = self.horizon
        number = is_number(horizon)
        check(
            horizon in ("auto", None) or (number and horizon >= 0),
            "query.horizon",
            horizon,
            "auto, null (the influence function) or a number >= 0 (approximate unrolling)",
        )
        if method == "index":
            check(
                self.precondition in INDEX_PRECONDITIONS,
                "query.precondition",
                self.precondition,
                f"{' or '.join(INDEX_PRECONDITIONS)} on the index's rows; kfac is the exact pass's (query.method=exact)",
            )
            check(
                not number,
                "query.horizon",
                horizon,
                "auto or null under query.method=index; a horizon unrolls the exact pass's factors: set query.method=exact",
            )
            return
        check(
            self.precondition in EXACT_PRECONDITIONS,
            "query.precondition",
            self.precondition,
            f"{' or '.join(EXACT_PRECONDITIONS)} under query.method=exact (diag and fisher precondition the index's projected rows: set query.method=index for them)",
        )
        check(
            self.normalize != "module",
            "query.normalize",
            self.normalize,
            "auto or row under query.method=exact, whose cosine is of the whole row",
        )
        check(
            not (number and self.precondition == "none"),
            "query.horizon",
            horizon,
            "auto or null with query.precondition=none; a horizon unrolls factors: set query.precondition=ekfac (or kfac, auto)",
        )
        check(
            self.search != "ann",
            "query.search",
            self.search,
            "exact (or auto) under query.method=exact, which scores every row itself",
        )

    @classmethod
    def from_config(cls, query: Any) -> "QuerySpec":
        """The spec of a `query.*` config section (its other keys say where results go and which engine runs)."""
        return cls(**{f.name: plain(query[f.name]) for f in fields(cls)})

    def rows_wanted(self, num_rows: int) -> int:
        """How many rows the top list holds for an index of `num_rows`: top_k, or all of them."""
        return num_rows if self.top_k == "all" else int(self.top_k)


@dataclass(frozen=True)
class Fields:
    """Which column holds each part of a row (the `data.*_field` settings): a Hugging Face
    dataset's `question`/`answer` columns are `Fields(prompt="question", completion="answer")`."""

    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    text: str = "text"
    id: str = "id"

    @classmethod
    def from_config(cls, data_cfg: Any) -> "Fields":
        """From the `data.*_field` settings of a config's `data` section."""
        return cls(**{f.name: str(data_cfg[f"{f.name}_field"]) for f in fields(cls)})

    def row(self, raw: Dict[str, Any]) -> Dict[str, Any]:
        """The row under gradian's names (prompt, completion, messages, text, id), nulls dropped."""
        return {f.name: raw[col] for f in fields(self) if raw.get(col := getattr(self, f.name)) is not None}
