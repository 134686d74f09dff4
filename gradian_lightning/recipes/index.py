"""The `gradian index` recipe as plain functions: config -> model, data, Trainer -> index.

Everything the CLI does is here, so a notebook can do the same:
    cfg = load_config("configs/smollm2.yaml", ["data.train=my.jsonl"])
    summary = run_index(cfg)
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import TQDMProgressBar
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from gradian_lightning.callback import GradientIndexer
from gradian_lightning.config import require_for
from gradian_lightning.data import IGNORE_INDEX, Fields, TokenizedRows, collate, tokenize_row
from gradian_lightning.data_sources import describe_source, ids_of, open_rows, streamed_rows
from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.hub import load_model_and_tokenizer, normalized_name, pad_token_id
from gradian_lightning.index.layout import IndexMeta, stored_meta
from gradian_lightning.index.location import Location
from gradian_lightning.index.writer import StoredIds
from gradian_lightning.interrupts import RANK_ZERO_LOGGERS, keyboard_interrupt
from gradian_lightning.recipes.plan import format_index_start, index_layout
from gradian_lightning.saved_models import load_saved_model, saved_models
from gradian_lightning.specs import IndexSpec


class CausalLMModule(L.LightningModule):
    """The smallest LightningModule around a Hugging Face model: validation does nothing itself,
    so the only work per batch is the indexer's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def validation_step(self, batch: Dict[str, Any], batch_idx: int) -> None:
        return None


class _NoAdvert(logging.Filter):
    """Drops Lightning's advert for its cloud logger, printed by every Trainer made without one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


for _name_ in RANK_ZERO_LOGGERS:
    logging.getLogger(_name_).addFilter(_NoAdvert())


def validate_or_interrupt(trainer: L.Trainer, module: L.LightningModule, loader: DataLoader) -> None:
    """`trainer.validate`, with Ctrl-C raised as the KeyboardInterrupt it was (interrupts.py)."""
    with keyboard_interrupt():
        trainer.validate(module, dataloaders=loader, verbose=False)


class IndexProgressBar(TQDMProgressBar):
    """Lightning's progress bar, with the indexer's numbers (gradian_rows, gradian_rows_per_s,
    gradian_eta_s) on the validation bar: `trainer.validate` has no training bar, which is where
    Lightning puts logged metrics."""

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        super().on_validation_batch_end(trainer, pl_module, *args, **kwargs)
        if not trainer.sanity_checking and not trainer.training:
            self.val_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Close the bars (ending their line), so that the error printed next has a line of its own.
        for bar in (self._val_progress_bar, getattr(self, "_train_progress_bar", None)):
            if bar is not None and not bar.disable:
                bar.leave = True
                bar.close()


def make_trainer(cfg: DictConfig, callbacks: list) -> L.Trainer:
    """A `lightning.Trainer` from `cfg.trainer` (passed as is) with quiet defaults for indexing."""
    user = OmegaConf.to_container(cfg.trainer, resolve=True)
    allowed = set(inspect.signature(L.Trainer.__init__).parameters) - {"self", "callbacks"}
    unknown = sorted(set(user) - allowed)
    if unknown:
        raise ConfigError(
            f"setting 'trainer.{unknown[0]}' is not a lightning.Trainer argument; see the Trainer's documentation for the names"
        )
    quiet = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False}
    if user.get("enable_progress_bar", True):
        callbacks = [*callbacks, IndexProgressBar()]
    try:
        return L.Trainer(callbacks=callbacks, **{**quiet, **user})
    except (ValueError, TypeError, MisconfigurationException) as err:
        # Lightning's message lists what it accepts but not which setting it was; find the key by
        # building a Trainer with each user setting alone (cheap: no model, no data).
        key = next((k for k in user if not _trainer_accepts(quiet, k, user[k])), next(iter(user), "?"))
        first = str(err).strip().splitlines()[0]
        raise ConfigError(
            f"setting 'trainer.{key}'={user.get(key)!r} is refused by lightning.Trainer ({first}); see the Trainer's documentation for the values it takes"
        ) from None


def _trainer_accepts(quiet: Dict[str, Any], key: str, value: Any) -> bool:
    try:
        L.Trainer(**{**quiet, key: value})
    except (ValueError, TypeError, MisconfigurationException):
        return False
    return True


def data_meta(cfg: DictConfig, source: Any, rows: Any) -> Dict[str, Any]:
    """The index's record of its data: the source ("path", resolved: a resume from another folder
    is the same job; None for a Python Dataset), its "fingerprint" (and a file's "sha256"), the
    column mapping where it is not the default, and max_seq_length."""
    fields = Fields.from_config(cfg.data)
    described = {k: v for k, v in describe_source(source, rows).items() if k != "num_rows"}
    mapped = {k: v for k, v in vars(fields).items() if v != getattr(Fields(), k)}
    return {**described, **({"fields": mapped} if mapped else {}), "max_seq_length": cfg.grads.max_seq_length}


def run_index(
    cfg: DictConfig, announce: Optional[Callable[[str], None]] = None, train: Any = None
) -> Optional[Dict[str, Any]]:
    """Index `cfg.data.train` (or `train`, a `datasets.Dataset`, from Python) into `cfg.index.path`. Returns what was written (`IndexSession.finish`'s
    summary); with `model.checkpoints`, one summary of the whole index with each checkpoint's under
    "checkpoints" and the whole index's bytes on disk.

    Under a multi-process strategy (trainer.strategy=ddp, num_nodes > 1) every process runs this and
    global rank 0 alone writes the index: it returns the summary, the other ranks None.
    `announce` (e.g. `print`) gets one line before the first batch: rows, modules, row width and
    the predicted size of the whole index, as `gradian plan` computes them.
    """
    require_for(cfg, "index", supplied=("data.train",) if train is not None else ())
    source = train if train is not None else cfg.data.train
    fields = Fields.from_config(cfg.data)
    rows = open_rows(source, fields)  # data mistakes fail before the model loads
    g, spec = cfg.grads, IndexSpec.from_config(cfg.grads)
    config = OmegaConf.to_container(cfg, resolve=True)
    # The spec is stored once, under "spec"; the config keeps what is not in it.
    config["grads"] = {k: v for k, v in config["grads"].items() if k not in spec.to_meta()}
    meta = {
        "config": config,
        "model": {"name_or_path": normalized_name(cfg.model.name_or_path), "revision": cfg.model.revision},
        "data": data_meta(cfg, source, rows),
    }
    # Appended rows without an id are numbered on from the index's rows (index/writer.py).
    first_id = appended_after(str(cfg.index.path), meta["data"]) if cfg.index.append else 0
    if first_id:  # a repeated id is refused before the index grows: a refused append changes no byte of it
        stored = Location(str(cfg.index.path)).open_group("r")
        StoredIds(stored, first_id, cfg.index.path).refuse(appended_ids(rows, fields, first_id))
    # Read forward with plain reads from here, and this Dataset's memory map closes with it: every
    # page read through a map stays in RSS (data_sources.StreamedRows).
    rows = streamed_rows(rows)
    # Steps and learning rates of model.checkpoints: a bad list fails before any model loads.
    checkpoints = saved_models(cfg.model.checkpoints or [])
    indexer = GradientIndexer(
        cfg.index.path,
        spec=spec,
        overwrite=cfg.index.overwrite,
        meta=meta,  # an s3:// or gs:// index.path whose filesystem is not installed fails here too
        rows_per_chunk=cfg.index.rows_per_chunk,
        checkpoints=bool(checkpoints),
        append=cfg.index.append,
        verbose=False,  # the CLI prints the summary
    )
    session = indexer.session
    trainer = make_trainer(cfg, [indexer])  # before the model loads: trainer.* mistakes fail fast
    # model.checkpoints: one index, one checkpoint per saved model, keyed by its step (saved_models.py).
    for run, saved in enumerate(checkpoints or [None]):
        model, tokenizer = load_saved_model(cfg.model, saved.entry) if saved else load_model_and_tokenizer(cfg.model)
        dataset = TokenizedRows(
            rows, tokenizer, g.max_seq_length, source=_name(source), fields=fields, first_id=first_id
        )
        if not run:  # before any batch runs: an index no row of which can be ranked is refused
            refuse_rows_that_rank_nothing(dataset)
        if not run and announce is not None and trainer.is_global_zero:  # before the launch: ranks > 0 know their rank
            layout = index_layout(model, spec, len(dataset))
            announce(
                format_index_start(len(dataset), layout, spec.storage_dtype, str(cfg.index.path), len(checkpoints) or 1)
            )
        loader = DataLoader(
            dataset,
            batch_size=g.batch_size,
            shuffle=False,
            collate_fn=partial(collate, pad_token_id=pad_token_id(tokenizer)),
        )
        if saved:
            session.checkpoint_as(saved.step, saved.lr)
        if run:
            trainer = make_trainer(cfg, [indexer])
        validate_or_interrupt(trainer, CausalLMModule(model), loader)
        if trainer.is_global_zero and len(session.summaries) != run + 1:
            raise GradianError(
                "indexing produced no summary; the validation loop did not run (check trainer.limit_val_batches)"
            )
    if not trainer.is_global_zero:
        return None
    warn_of_rows_cut_to_nothing(dataset, session.summaries[-1]["empty_rows"], first_id)
    if not checkpoints:
        return session.summaries[-1]
    return whole_index_summary(session.summaries, str(cfg.index.path))


def appended_after(path: str, data: Dict[str, Any]) -> int:
    """The row after which index.append puts `data`'s rows in the index at `path`: its last
    segment's start when that is `data` (a resumed or repeated append), else its row count."""
    if "{step}" in path or Location(path).is_empty():
        return 0
    stored = stored_meta(path)
    if stored is None:
        return 0
    meta = IndexMeta.from_attrs(stored, repr(path))
    last = meta.data_segments()[-1]
    return int(last["offset"]) if last["data"] == data else meta.num_rows


# A row with no supervised token within grads.max_seq_length has a zero gradient: it scores 0 for
# every query and is left out of ranking. At a tenth of the rows, one query in ten whose source is
# among them cannot find it (recall@k at most 0.9): a loss the user must hear of. Below it, a few
# over-long rows are usual in real data, and the summary already counts and names them.
EMPTY_ROWS_WARNING_SHARE = 0.1


def prompt_tokens(dataset: TokenizedRows, i: int) -> Optional[int]:
    """The tokens of row `i` before its first supervised token, untruncated (None: it has none)."""
    labels = tokenize_row(dataset.tokenizer, dataset.row(i), i, sys.maxsize).labels
    return next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), None)


def refuse_rows_that_rank_nothing(dataset: TokenizedRows) -> None:
    """`ConfigError` when no row of `dataset` keeps a supervised token within its max_seq_length:
    every row's gradient would be zero. Costs one row's tokenization when the first row has one."""
    if any(any(label != IGNORE_INDEX for label in dataset[i].labels) for i in range(len(dataset))):
        return
    cut = [n for n in (prompt_tokens(dataset, i) for i in range(len(dataset))) if n is not None]
    n, limit = len(dataset), dataset.max_seq_length
    if not cut:
        raise ConfigError(
            f"every one of the {n} rows of data.train has zero supervised tokens (empty completions, or messages without an assistant turn), so none could be ranked; give the rows a completion, an assistant message or text"
        )
    longest = max(cut)
    raise ConfigError(
        f"every one of the {n} rows of data.train has zero supervised tokens within grads.max_seq_length={limit}: the longest prompt is {longest} tokens, and each completion starts after the cut, so no row could be ranked; set grads.max_seq_length above {longest} (plus the completion tokens to keep), or shorten the prompts"
    )


def warn_of_rows_cut_to_nothing(dataset: TokenizedRows, empty_rows: List[int], offset: int) -> None:
    """Warn when at least `EMPTY_ROWS_WARNING_SHARE` of this run's rows (`dataset`, at index rows
    `offset`... of the index whose `empty_rows` the summary lists) have no supervised token."""
    mine = [i - offset for i in empty_rows if offset <= i < offset + len(dataset)]
    share = len(mine) / max(len(dataset), 1)
    if not mine or share < EMPTY_ROWS_WARNING_SHARE:
        return
    cut = [n for n in (prompt_tokens(dataset, i) for i in mine) if n is not None]
    advice = (
        f"the longest of their prompts is {max(cut)} tokens; set grads.max_seq_length above {max(cut)} (with index.overwrite=true to rebuild this index), or shorten those prompts"
        if cut
        else "they have empty completions; give them a completion, or leave them out"
    )
    warnings.warn(
        f"{len(mine)} of the {len(dataset)} rows of data.train ({100 * share:.0f}%) have zero supervised tokens within grads.max_seq_length={dataset.max_seq_length} and can never be ranked: {advice}",
        stacklevel=2,
    )


def appended_ids(rows: Any, fields: Fields, first_id: int) -> Iterator[str]:
    """The ids the rows of the Dataset `rows` get in an index they are appended to after
    `first_id` rows: their id column's, else (no column, or null) `first_id` + position, as
    `TokenizedRows` numbers them."""
    at = first_id
    for batch in ids_of(rows, fields):
        for value in batch:
            yield str(value) if value is not None else str(at)
            at += 1
    yield from (str(i) for i in range(at, first_id + len(rows)))  # the rows of a Dataset without an id column


def _name(source: Any) -> str:
    return str(source) if isinstance(source, (str, Path)) else "data.train"


def whole_index_summary(summaries: List[Dict[str, Any]], root: str) -> Dict[str, Any]:
    """One summary of a checkpointed index: every checkpoint's (oldest first) and the whole index's bytes."""
    return {
        "path": root,
        "complete": all(s["complete"] for s in summaries),
        "checkpoints": summaries,
        "bytes_on_disk": Location(root).bytes_on_disk(),
    }
