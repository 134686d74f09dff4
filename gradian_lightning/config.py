"""The settings schema: one structured config that is both the CLI's schema and the docs' source.

`load_config("configs/x.yaml", ["grads.batch_size=2"])` merges the schema defaults, the YAML file
and the dotlist overrides (in that order) with omegaconf, then checks every value. Anything wrong
fails here, before a model loads, with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gradian_lightning.errors import ConfigError
from gradian_lightning.specs import Fields, IndexSpec, QuerySpec, check

MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")
ENGINES = ("local", "dask")
# The fewest validate.num_subsets at which one query's rank correlation can differ from chance (5% level).
MIN_SUBSETS = 5


@dataclass
class ModelConfig:
    name_or_path: str = "???"  # a from_pretrained name or a local directory
    dtype: str = "float32"
    revision: Optional[str] = None
    trust_remote_code: bool = False
    # Saved checkpoints of this model (Hugging Face directories or Lightning .ckpt files), oldest
    # first, e.g. [base, fine-tuned]: `gradian index` indexes each as one checkpoint (a .ckpt at its
    # global step, with its learning rate; a directory one step after the entry before it:
    # saved_models.py), `gradian query` with query.checkpoints=all|[steps] makes the query rows with each.
    checkpoints: Optional[List[str]] = None


@dataclass
class DataSource:
    """The `data.*` key that says where the rows are; the rest of `data.*` is `Fields`' columns."""

    # What datasets reads (data_sources.py): a JSONL/JSON/parquet/arrow/CSV file (.gz too), a
    # save_to_disk folder, or a hub name:split; prompt/completion, messages or text rows, optional id.
    train: str = "???"


# data.prompt_field ... data.id_field: the column that holds each part of a row (specs.Fields), in
# data.train and query.data alike.
DataConfig = make_dataclass(
    "DataConfig", [(f"{f.name}_field", str, field(default=f.default)) for f in fields(Fields)], bases=(DataSource,)
)


@dataclass
class GradsData:
    """The `grads.*` keys that say how the data is batched; the rest of `grads.*` is `IndexSpec`'s fields."""

    batch_size: int = 4
    max_seq_length: int = 512


@dataclass
class IndexConfig:
    path: str = "gradian_index"
    overwrite: bool = False  # replace an index of another configuration found at path
    # Add data.train's rows after the rows of the index at path (same spec and weights), instead of replacing it.
    append: bool = False
    rows_per_chunk: Optional[int] = None  # rows per stored chunk; null: about 4 MiB of them


@dataclass
class QueryRun:
    """The `query.*` keys that say what is asked and where results go; the rest is `QuerySpec`'s fields."""

    data: Optional[str] = None
    engine: str = "local"  # "local": stream chunks in this process; "dask": score on a Dask cluster
    dask_scheduler: Optional[str] = None  # engine dask: scheduler address; null starts a LocalCluster
    output: Optional[str] = None
    # Each result row also gets its supervised tokens' terms of the score (query/token_scores.py).
    token_scores: bool = False


# Types omegaconf checks as they are; any other field type (a tuple, Any) is left to the spec's own check.
_PLAIN_TYPES = (int, float, bool, str, Optional[int], Optional[str], Optional[float])


def spec_section(name: str, spec: type, extra: type) -> type:
    """The structured-config dataclass of one section: `extra`'s fields, then every field of the
    spec dataclass `spec` with its default, so that a spec field is declared once, in specs.py.
    The spec checks the values (`IndexSpec.from_config`, `QuerySpec.from_config`)."""
    hints = typing.get_type_hints(spec)
    derived = []
    for f in fields(spec):
        kind = hints[f.name] if hints[f.name] in _PLAIN_TYPES else Any
        default = f.default
        if isinstance(default, (tuple, list)):  # a mutable default for omegaconf: a fresh list each time
            derived.append((f.name, kind, field(default_factory=lambda d=default: list(d))))
        else:
            derived.append((f.name, kind, field(default=default)))
    return make_dataclass(name, derived, bases=(extra,))


GradsConfig = spec_section("GradsConfig", IndexSpec, GradsData)
QueryConfig = spec_section("QueryConfig", QuerySpec, QueryRun)


@dataclass
class ReportConfig:
    """`gradian report`: one static HTML page of a query run (docs/report.md)."""

    output: Optional[str] = None  # the page; null: query.output with .html
    token_rows: int = 5  # the top rows (and opponents) of each query whose tokens are shaded


@dataclass
class ValidateConfig:
    """`gradian validate`: the Linear Datamodeling Score of the scoring on this data (docs/validate.md)."""

    num_subsets: int = 32  # M models, each fine-tuned on a random alpha-subset of data.train
    alpha: float = 0.5  # the fraction of training rows in each subset
    seed: int = 0  # draws the subsets; subset m's r-th training run is seeded seed + 1000 r + m
    repeats: int = 1  # training runs per subset with other seeds; >= 2 also measures the noise ceiling
    epochs: int = 2
    learning_rate: float = 1e-4
    batch_size: int = 8
    output: str = "runs/validate"  # per-subset query losses (kept, so a killed run resumes), LDS report
    # Each entry is a dict of query.* settings to score with, over the query.* settings above; [] or
    # null: the query.* settings alone.
    scorers: Any = None


def _default_trainer() -> Dict[str, Any]:
    return {"accelerator": "auto", "devices": 1}


@dataclass
class GradianConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    grads: GradsConfig = field(default_factory=GradsConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    query: QueryConfig = field(default_factory=QueryConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    # Handed to lightning.Trainer as keyword arguments, unchanged.
    trainer: Dict[str, Any] = field(default_factory=_default_trainer)


def _one_line(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = str(getattr(err, "msg", err)).splitlines()[0]
    return f"setting '{key}': {msg}"


def _yaml_problem(err: Exception, lines: bool = True) -> str:
    """A YAML parse error in one line: what, and (`lines`) where: the line where the construct
    began and the one where the parser gave up (PyYAML's marks count from 0)."""
    problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
    at, began = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    if not lines or at is None:
        return problem
    where = f"line {at.line + 1}, column {at.column + 1}: {problem}"
    if began is not None and began.line != at.line:
        where += f", {getattr(err, 'context', 'in what began')} at line {began.line + 1}"
    return where


def load_config(path: str | Path | None = None, overrides: List[str] | None = None) -> DictConfig:
    """Merge schema defaults, an optional YAML file and `key=value` overrides, then validate.

    Returns a read-only `DictConfig` typed by `GradianConfig`. Raises `ConfigError` with one line.
    """
    schema = OmegaConf.structured(GradianConfig)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass a YAML file such as configs/smollm2.yaml"
            )
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # yaml.YAMLError and friends: say which file and where
            raise ConfigError(f"config file {str(path)!r} is not valid YAML ({_yaml_problem(err)})") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(
                f"config file {str(path)!r} holds a {type(loaded).__name__.replace('Config', '').lower()} at its top level; write sections of settings (model:, data:, grads:, index:, query:, trainer:) as in configs/smollm2.yaml"
            )
        layers.append(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value; write e.g. grads.batch_size=2")
        try:
            OmegaConf.from_dotlist([item])
        except Exception as err:  # the value is YAML: an unclosed list or quote
            raise ConfigError(
                f"override {item!r}: its value is not valid YAML ({_yaml_problem(err, lines=False)}); close lists and quotes, e.g. grads.module_filter=[q_proj,v_proj]"
            ) from None
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides or [])))
        cfg = OmegaConf.merge(schema, *layers)
    except OmegaConfBaseException as err:
        raise ConfigError(_one_line(err)) from None
    check_settings(cfg)
    for layer in layers:
        _mark_given(cfg, layer)
    OmegaConf.set_readonly(cfg, True)
    return cfg


# The node flag that records a setting the YAML file or the command line gave (`is_given`).
_GIVEN = "gradian_given"


def _mark_given(cfg: DictConfig, layer: DictConfig) -> None:
    """Flag each `section.key` that `layer` (a YAML file or the overrides) sets in `cfg`."""
    for section, values in layer.items():
        if isinstance(values, DictConfig) and isinstance(cfg.get(section), DictConfig):
            for key in values:
                if key in cfg[section]:
                    cfg[section]._get_node(key)._set_flag(_GIVEN, True)


def is_given(cfg: DictConfig, key: str) -> bool:
    """Whether the dotted setting `key` was set by the YAML file or a `key=value` override that
    `load_config` read, rather than left at the schema's default. A query checks a `grads.*`
    setting against the index's stored spec only where it was given (recipes/query.py)."""
    section, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, section) if section else cfg
    return isinstance(node, DictConfig) and leaf in node and bool(node._get_node(leaf)._get_node_flag(_GIVEN))


def check_settings(cfg: DictConfig) -> None:
    """Check values omegaconf's types cannot express. Raises `ConfigError` with one line."""
    g = cfg.grads
    check(g.batch_size >= 1, "grads.batch_size", g.batch_size, "an integer >= 1")
    check(g.max_seq_length >= 2, "grads.max_seq_length", g.max_seq_length, "an integer >= 2")
    IndexSpec.from_config(g)  # the rest of grads.*
    check(cfg.model.dtype in MODEL_DTYPES, "model.dtype", cfg.model.dtype, " or ".join(MODEL_DTYPES))
    q = cfg.query
    QuerySpec.from_config(q)  # top_k ... checkpoints
    check(q.engine in ENGINES, "query.engine", q.engine, " or ".join(ENGINES))
    exact = q.method == "exact"
    check(
        not (exact and q.engine == "dask"),
        "query.engine",
        q.engine,
        "local under query.method=exact, whose pass re-reads the training data in this process; the Dask engine scores the stored rows (query.method=index)",
    )
    check(
        not (exact and q.token_scores),
        "query.token_scores",
        q.token_scores,
        "false under query.method=exact; token terms are of the stored rows' scores (query.method=index)",
    )
    check(
        cfg.index.rows_per_chunk is None or cfg.index.rows_per_chunk >= 1,
        "index.rows_per_chunk",
        cfg.index.rows_per_chunk,
        "an integer >= 1, or null for about 4 MiB per chunk",
    )
    check(
        bool(str(cfg.index.path).strip()),
        "index.path",
        cfg.index.path,
        "a directory path or fsspec URL for the zarr index",
    )
    check(
        not (cfg.index.append and cfg.index.overwrite),
        "index.append",
        cfg.index.append,
        "false with index.overwrite=true (appending keeps the index that overwriting replaces)",
    )
    for name in ("prompt", "completion", "messages", "text", "id"):
        value = cfg.data[f"{name}_field"]
        check(bool(str(value).strip()), f"data.{name}_field", value, "a column name")
    check(cfg.report.token_rows >= 0, "report.token_rows", cfg.report.token_rows, "an integer >= 0")
    v = cfg.validate
    # Below 5 points even a perfect Spearman correlation has p >= 2/4! = 0.083 under random scores
    # (two-sided), so no LDS printed could be told from chance; at 5 it is 2/5! = 0.017 (docs/validate.md).
    check(
        v.num_subsets >= MIN_SUBSETS,
        "validate.num_subsets",
        v.num_subsets,
        f"an integer >= {MIN_SUBSETS} (an LDS over fewer subsets cannot be told from random scores; 24 or more for a figure worth reporting)",
    )
    check(0 < v.alpha < 1, "validate.alpha", v.alpha, "a fraction between 0 and 1, such as 0.5")
    check(v.repeats >= 1, "validate.repeats", v.repeats, "an integer >= 1")
    check(v.epochs >= 1, "validate.epochs", v.epochs, "an integer >= 1")
    check(v.learning_rate > 0, "validate.learning_rate", v.learning_rate, "a number > 0")
    check(v.batch_size >= 1, "validate.batch_size", v.batch_size, "an integer >= 1")
    scorers = OmegaConf.to_object(v.scorers) if OmegaConf.is_config(v.scorers) else v.scorers
    check(
        scorers is None or (isinstance(scorers, list) and all(isinstance(s, dict) for s in scorers)),
        "validate.scorers",
        scorers,
        "a list of dicts of query.* settings, e.g. [{precondition: none}, {score: inner}]",
    )


# The settings each command needs. `gradian` checks them before torch imports (cli.py), the
# recipes again for Python callers (`require_for`).
REQUIRED_KEYS = {
    "index": ("model.name_or_path", "data.train"),
    "plan": ("model.name_or_path", "data.train"),
    "query": ("model.name_or_path", "query.data"),
    "report": ("model.name_or_path", "query.data", "query.output"),
    "validate": ("model.name_or_path", "data.train", "query.data"),
}


def require_for(cfg: DictConfig, command: str, supplied: Tuple[str, ...] = ()) -> None:
    """`require` of what `command` needs (`REQUIRED_KEYS`), less the keys a Python caller
    `supplied` as objects instead (e.g. index's `train` for data.train)."""
    require(cfg, *(k for k in REQUIRED_KEYS[command] if k not in supplied))


def require(cfg: DictConfig, *keys: str) -> None:
    """Fail with one line when a setting a command needs is unset (`???` or null)."""
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if OmegaConf.is_missing(node, leaf) or node[leaf] is None:
            raise ConfigError(f"setting '{key}' is required; add it to the YAML file or pass {key}=...")
