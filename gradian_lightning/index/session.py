"""`IndexSession`: one index written from batches of examples, with no framework around it.

    session = IndexSession(IndexSpec(), "runs/ix")     # the settings, checked
    session.bind(model)                                # the Hugging Face model: modules, projection, hooks
    session.begin(num_rows=len(dataset))               # opens, or resumes, the index: bool [N] rows to do
    for batch in loader:
        session.add(batch)                             # compute: GradientRows (gradients/batch.py) -> rows [B, D]
                                                       # write:   IndexWriter, rows at their dataset positions
    summary = session.finish()                         # or, after an exception, session.abort()

`GradientIndexer` (callback.py) maps Lightning's validation loop onto these calls. Under several
processes every rank computes its batches (`compute`), and rank 0 alone, which called `begin`,
writes them all (`write`).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from gradian_lightning.errors import ConfigError, DeviceOutOfMemoryError, GradianError
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.loss import supervised_targets
from gradian_lightning.gradients.memory import SUGGESTED_LOSS_CHUNK_TOKENS, fp32_logit_bytes, human_bytes
from gradian_lightning.index.checkpoints import register_checkpoint
from gradian_lightning.index.layout import fingerprint, identity
from gradian_lightning.index.location import Location
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.specs import IndexSpec, is_int
from gradian_lightning.versions import package_versions


@dataclass
class BatchRows:
    """One batch's rows as `IndexSession.compute` made them; B examples, D = the row width.

    index [B] int64 dataset positions; rows [B, D] float32 (zeros where not wanted); loss [B]
    float32 nats; supervised [B] and truncated [B] token counts (-1: unknown); wanted [B] bool,
    the rows still to write; ids [B] str.
    """

    index: torch.Tensor
    rows: torch.Tensor
    loss: torch.Tensor
    supervised: torch.Tensor
    truncated: torch.Tensor
    wanted: torch.Tensor
    ids: List[str]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Everything but the ids, for a collective (all_gather) across ranks."""
        return {k: v for k, v in vars(self).items() if k != "ids"}


class IndexSession:
    """Writes one index, or one checkpoint of a checkpointed index, per `begin` ... `finish`.

    Args:
        spec: how rows are made (specs.py); stored once in the index's metadata.
        path: index directory or fsspec URL; `{step}` in it is replaced by the step `begin` is given.
        overwrite: replace an index of another configuration found at the path (index/location.py:
            only an index or an empty folder is ever removed).
        rows_per_chunk: rows per stored grads chunk (default about 4 MiB): what a killed run loses at most.
        checkpoints: each `begin` adds checkpoint `step` to one index at `path` (index/checkpoints.py)
            instead of replacing it.
        append: `begin(num_rows)`'s rows go after the rows of the complete index at `path`, made
            with the same spec and weights (index/writer.py); positions in batches are of these rows.
        meta: plain JSON data stored in the index attributes, e.g. "data" {path, sha256,
            max_seq_length} and "config" (the CLI's).
        caller: what its errors call it, as the user made it (`GradientIndexer` passes its own name).

    Bad arguments are one `ConfigError` line, here, before any model exists.
    """

    def __init__(
        self,
        spec: IndexSpec,
        path: str | Path,
        *,
        overwrite: bool = False,
        rows_per_chunk: Optional[int] = None,
        checkpoints: bool = False,
        meta: Optional[Dict[str, Any]] = None,
        append: bool = False,
        caller: str = "IndexSession",
    ) -> None:
        _check_arguments(caller, path, overwrite, rows_per_chunk, checkpoints, meta, append)
        self.append, self.caller = append, caller
        self.spec, self.path_template = spec, str(path)
        self.overwrite, self.rows_per_chunk, self.checkpoints = overwrite, rows_per_chunk, checkpoints
        self.extra_meta = dict(meta or {})
        self.summaries: List[Dict[str, Any]] = []  # what each finish() wrote, oldest first
        self.gradient_rows: Optional[GradientRows] = None
        self._writer: Optional[IndexWriter] = None
        self._checkpoint: Optional[Tuple[str, int, Optional[float]]] = None
        self._label: Optional[Tuple[int, Optional[float]]] = None
        self.todo: Optional[np.ndarray] = None
        self._rows_done, self._rows_wanted, self._started = 0, 0, 0.0

    # -- the model -------------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> None:
        """Make rows with `model` (a Hugging Face causal LM, or a PEFT model) from now on: its
        selected modules, their Kronecker projection and the hooks that capture them (`GradientRows`)."""
        self.gradient_rows = GradientRows(model, self.spec)

    @property
    def model(self) -> Optional[nn.Module]:
        """The bound model (a PEFT model's base model), or None before `bind`."""
        return self.gradient_rows.model if self.gradient_rows is not None else None

    def checkpoint_as(self, step: int, lr: Optional[float] = None) -> None:
        """Key the next `begin` by `step` and `lr`, whatever its caller passes: a saved model
        indexed after its training (no optimizer) says here which step of training it was."""
        self._label = (int(step), lr)

    def path_at(self, step: int) -> str:
        """Where the index of `step` goes."""
        return self.path_template.format(step=step)

    def describe(self, num_rows: int, step: int) -> Dict[str, Any]:
        """The metadata of an index of `num_rows` rows made by the bound model at `step`."""
        given = self.extra_meta.get("model") or {}
        made = self.gradient_rows.describe(given.get("name_or_path"))
        # The weights digest is not in the identity: re-indexing a fit's later step, with other
        # weights, replaces the index of the same job.
        meta = {
            **self.extra_meta,
            "spec": self.spec.to_meta(),
            **made,
            "model": {**made["model"], "revision": given.get("revision")},
            "versions": package_versions(),
            "global_step": int(step),
            "num_rows": num_rows,
        }
        return {**meta, "fingerprint": fingerprint({**identity(meta), "num_rows": num_rows})}

    # -- one indexing run ------------------------------------------------------------------------
    def begin(self, num_rows: int, step: int = 0, lr: Optional[float] = None) -> np.ndarray:
        """Open the index of `num_rows` rows at `path_at(step)`, resuming one of the same job left
        unfinished there. Returns bool [num_rows]: the rows still to compute (`todo`)."""
        if self.model is None:
            raise GradianError("IndexSession.begin before bind(model): bind the model the rows are made with first")
        path = self.path_at(step)
        if self._label is not None:
            (step, lr), self._label = self._label, None
        meta = self.describe(num_rows, step)
        if self.checkpoints:
            meta["lr"] = lr
            self._checkpoint = (path, int(step), lr)
            path = register_checkpoint(path, step, lr, meta, complete=False, overwrite=self.overwrite)
        width, dtype = self.gradient_rows.projector.width, self.spec.storage_dtype
        self._writer = IndexWriter(
            path, num_rows, width, dtype, meta, self.overwrite, self.rows_per_chunk, append=self.append
        )
        self.expect(self._writer.todo)
        return self.todo

    def expect(self, todo: np.ndarray) -> None:
        """Take `todo` (bool [N]) as the rows this run computes: what `begin` returned, on rank 0,
        or what it broadcast to this rank."""
        self.todo = todo
        self._rows_done, self._rows_wanted = 0, int(np.count_nonzero(todo))
        self._started = time.perf_counter()

    def compute(self, batch: Dict[str, Any], forward_context: Optional[ContextManager] = None) -> BatchRows:
        """The rows of one collated batch (`input_ids`, `attention_mask`, `labels` [B, T], `index`
        [B], optional `id`, `truncated_tokens`), on the batch's device, for the rows `todo` wants.

        `forward_context` wraps forward and backward (e.g. Lightning's autocast). The model's
        parameters, their `.grad` and the caller's RNG are left as they were.
        """
        if not isinstance(batch, dict) or "index" not in batch:
            raise GradianError(
                f"{self.caller} needs dict batches with an 'index' entry (dataset positions); use gradian_lightning.data.collate or add batch['index']"
            )
        index = batch["index"]
        device = batch["input_ids"].device
        if self.todo is None:
            raise _not_open("compute")
        wanted = torch.as_tensor(self.todo[index.cpu().numpy()], device=index.device)
        size = batch["input_ids"].shape[0]
        rows = torch.zeros(size, self.gradient_rows.projector.width, dtype=torch.float32, device=device)
        losses = torch.zeros(size, dtype=torch.float32, device=device)
        if bool(wanted.any()):
            sub = {k: batch[k][wanted] for k in ("input_ids", "attention_mask", "labels") if k in batch}
            try:
                sub_rows, sub_losses = self.gradient_rows(sub, forward_context)
            except torch.OutOfMemoryError:
                raise self.out_of_memory(batch, wanted) from None
            except RuntimeError as err:  # MPS reports running out of memory as a plain RuntimeError
                if "out of memory" not in str(err).lower():
                    raise
                raise self.out_of_memory(batch, wanted) from None
            # Here, not inside the gradient run: `rows` may be an inference tensor, writable only in inference mode.
            rows[wanted], losses[wanted] = sub_rows, sub_losses
        return BatchRows(
            index=index,
            rows=rows,
            loss=losses,
            supervised=supervised_targets(batch["labels"]).sum(dim=1),
            truncated=batch.get("truncated_tokens", torch.full_like(index, -1)),
            wanted=wanted,
            ids=list(batch["id"]) if "id" in batch else [str(int(i)) for i in index],
        )

    def write(self, computed: BatchRows) -> None:
        """Hand the wanted rows of `computed` (one rank's, or every rank's gathered) to the writer."""
        if self._writer is None:
            raise _not_open("write")
        keep = computed.wanted.cpu().numpy()
        self._writer.write(
            computed.index.cpu().numpy()[keep],
            computed.rows[computed.wanted].cpu(),
            computed.loss[computed.wanted].cpu(),
            computed.supervised[computed.wanted].cpu(),
            computed.truncated[computed.wanted].cpu(),
            [i for i, k in zip(computed.ids, keep) if k],
        )
        self._rows_done += int(keep.sum())

    def add(self, batch: Dict[str, Any], forward_context: Optional[ContextManager] = None) -> None:
        """`compute` then `write`: one batch in one process."""
        self.write(self.compute(batch, forward_context))

    def progress(self) -> Dict[str, float]:
        """Rows written this run, rows per second, and seconds left at that rate."""
        rate = self._rows_done / max(time.perf_counter() - self._started, 1e-9)
        left = max(self._rows_wanted - self._rows_done, 0)
        return {
            "gradian_rows": float(self._rows_done),
            "gradian_rows_per_s": rate,
            "gradian_eta_s": left / rate if rate > 0 else float("inf"),
        }

    def finish(self) -> Dict[str, Any]:
        """Write what is buffered, the row statistics and the flags; returns what was written
        (`summarize`, plus the rows computed this run and the step), also kept in `summaries`."""
        writer, self._writer, self.todo = self._writer, None, None
        if writer is None:
            raise _not_open("finish")
        complete = self._close(writer)
        summary = {**summarize(writer, complete), "computed_rows": self._rows_done, "step": writer.step}
        self.summaries.append(summary)
        return summary

    def abort(self) -> None:
        """After an exception: keep every row computed so far (a rerun resumes from them) and let
        go of the index. Does nothing when no run is open; never raises over the exception that
        brought the caller here, but warns when the rows could not be kept."""
        writer, self._writer, self.todo = self._writer, None, None
        if writer is None:
            return
        try:
            self._close(writer)
        except Exception as err:
            warnings.warn(f"the index at {str(writer.path)!r} could not keep its last rows ({err})", stacklevel=2)

    def _close(self, writer: IndexWriter) -> bool:
        complete = writer.close()
        if self._checkpoint is not None:
            (root, step, lr), self._checkpoint = self._checkpoint, None
            register_checkpoint(root, step, lr, writer.attrs, complete=complete)
        return complete

    def out_of_memory(self, batch: Dict[str, Any], wanted: torch.Tensor) -> DeviceOutOfMemoryError:
        """The one-line error for an accelerator OOM in this batch: what it held and what to lower."""
        n_supervised = int(supervised_targets(batch["labels"][wanted]).sum())
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        vocab = getattr(head, "out_features", None) or getattr(getattr(self.model, "config", None), "vocab_size", None)
        max_len = (self.extra_meta.get("data") or {}).get("max_seq_length")  # known when run from a config
        chunk = self.spec.loss_chunk_tokens
        peak = f"{human_bytes(fp32_logit_bytes(n_supervised, vocab, chunk))}" if vocab else "unknown (vocab unknown)"
        rows = batch["index"][wanted]
        # The third lever, named only when it is off and would bound this batch's logits.
        lever = SUGGESTED_LOSS_CHUNK_TOKENS
        third = (
            f"or set grads.loss_chunk_tokens={lever} (the same rows; the fp32 logits then need at most {human_bytes(fp32_logit_bytes(lever, vocab))} whatever the batch); "
            if chunk is None and vocab and n_supervised > lever
            else ""
        )
        return DeviceOutOfMemoryError(
            f"device out of memory indexing rows {int(rows.min())}-{int(rows.max())}: a batch of {int(wanted.sum())} rows "
            f"(grads.max_seq_length={max_len if max_len is not None else 'unknown'}, padded length {batch['input_ids'].shape[1]}) "
            f"holds {n_supervised} supervised tokens × vocab {vocab}, so its fp32 logits alone need {peak} (the loss writes their gradient into them; a 16-bit head adds half that again, on top of weights and activations; gradian plan predicts the whole peak); "
            "lower grads.batch_size first (the peak is linear in it; it costs only wall time), then grads.max_seq_length (it can cut completions); "
            f"{third}grads.storage_dtype, grads.module_filter and grads.projection_dim shrink the index on disk, not this tensor (docs/faq/out-of-memory.md)"
        )


def _not_open(call: str) -> GradianError:
    return GradianError(
        f"IndexSession.{call} outside begin() ... finish(): call begin(num_rows) first (on every rank but 0: expect(todo))"
    )


def _check_arguments(
    caller: str, path: Any, overwrite: Any, rows_per_chunk: Any, checkpoints: Any, meta: Any, append: Any
) -> None:
    """The session's own arguments, each refused in one `ConfigError` line (the spec checks itself)."""
    rules = {
        "path": (
            path,
            isinstance(path, (str, Path)) and bool(str(path).strip()),
            "a non-empty directory path (str or Path)",
        ),
        "overwrite": (overwrite, isinstance(overwrite, bool), "True or False"),
        "rows_per_chunk": (
            rows_per_chunk,
            rows_per_chunk is None or (is_int(rows_per_chunk) and rows_per_chunk >= 1),
            "None or an integer >= 1",
        ),
        "checkpoints": (checkpoints, isinstance(checkpoints, bool), "True or False"),
        "append": (
            append,
            isinstance(append, bool) and not (append and (overwrite is True or checkpoints is True)),
            "True or False, and False with overwrite=True or checkpoints=True",
        ),
        "meta": (meta, meta is None or isinstance(meta, dict), "None or a dict of JSON data"),
    }
    for name, (value, ok, allowed) in rules.items():
        if not ok:
            raise ConfigError(f"{caller}({name}={value!r}) is not allowed; use {allowed}")
    try:
        str(path).format(step=0)
    except (KeyError, IndexError, ValueError):
        raise ConfigError(
            f"{caller}(path={str(path)!r}): the only placeholder a path may hold is {{step}}; write other braces twice ({{{{ and }}}})"
        ) from None
    try:
        json.dumps(meta or {}, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"{caller}(meta=...) cannot be stored in the index attributes ({err}); keep it to dicts, lists, strings, numbers, booleans and None"
        ) from None
    # An s3:// or gs:// path without its filesystem, or a local path that is a file, fails here.
    Location(str(path).format(step=0)).check_creatable()


def summarize(writer: IndexWriter, complete: bool) -> Dict[str, Any]:
    """What one indexing run wrote: counts of rows, truncation, empty and non-finite rows, bytes."""
    group = writer.group
    written = group["complete"][:]
    truncated = group["truncated_tokens"][:]
    empty = np.flatnonzero((group["supervised_tokens"][:] == 0) & written)
    nonfinite = np.flatnonzero(~group["finite"][:] & written)
    named = np.union1d(empty[:20], nonfinite[:20])  # the CLI names the first 20 of each
    return {
        "path": str(writer.path),
        "complete": complete,
        "rows": int(written.sum()),
        "num_rows": writer.num_rows,
        "bytes_on_disk": writer.path.bytes_on_disk(),
        "kept_rows": writer.kept_rows,
        "grads_bytes": int(group["grads"].nbytes),
        "truncated_rows": int(((truncated > 0) & written).sum()),
        "empty_rows": [int(i) for i in empty],
        "nonfinite_rows": [int(i) for i in nonfinite],
        "ids": dict(zip((int(i) for i in named), (str(v) for v in group["id"].oindex[named]))) if len(named) else {},
    }
