"""`IndexSession` without Lightning, `GradientIndexer.on_exception`, and indexes of the metadata format before `spec`."""

import lightning as L
import numpy as np
import pytest
import torch
import zarr
from test_callback import trainer
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, IndexSession, IndexSpec, open_index, query_gradients
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import GradianError
from gradian_lightning.gradients.batch import GradientRows
from gradian_lightning.gradients.capture import select_modules

SPEC = IndexSpec(module_filter=("down_proj", "q_proj"), projection_dim=4, storage_dtype="float32", seed=3)


class Validated(L.LightningModule):
    """Validation does nothing but, from batch `fail_at` on, raise: a run killed half-way."""

    def __init__(self, model, fail_at=None):
        super().__init__()
        self.model, self.fail_at = model, fail_at

    def validation_step(self, batch, batch_idx):
        if self.fail_at is not None and batch_idx >= self.fail_at:
            raise RuntimeError("killed in batch 2")


def validate(tmp_path, indexer, model, dataset, fail_at=None):
    trainer(tmp_path, [indexer]).validate(Validated(model, fail_at), dataloaders=loader(dataset), verbose=False)


def loader(dataset):
    return DataLoader(dataset, batch_size=2, collate_fn=collate)


def exact_rows(model, dataset):
    """The rows by the gradient path alone, one batch of every example: the independent reference."""
    modules = select_modules(model, SPEC.module_filter)
    with torch.enable_grad():
        rows, _ = GradientRows(model, IndexSpec(projection_dim=4, seed=3, recompute="none"), modules)(
            collate(dataset.examples)
        )
    return rows


@pytest.fixture
def dataset(tokenizer, rows):
    return JsonlDataset(rows, tokenizer, 64)


def test_a_session_alone_writes_what_the_callback_writes(tmp_path, model, dataset):
    session = IndexSession(SPEC, tmp_path / "alone")
    session.bind(model)
    todo = session.begin(len(dataset))
    assert todo.all() and len(todo) == len(dataset)
    for batch in loader(dataset):
        session.add(batch)
    summary = session.finish()
    assert summary["complete"] and summary["rows"] == summary["computed_rows"] == len(dataset)
    validate(tmp_path, GradientIndexer(tmp_path / "lightning", **SPEC.to_meta()), model, dataset)
    alone, lightning = open_index(tmp_path / "alone"), open_index(tmp_path / "lightning")
    torch.testing.assert_close(alone.rows(slice(None)), exact_rows(model, dataset), rtol=1e-4, atol=1e-6)
    assert torch.equal(alone.rows(slice(None)), lightning.rows(slice(None)))
    assert alone.meta["fingerprint"] == lightning.meta["fingerprint"]
    # The spec is stored once: no second copy for another reader to read.
    assert alone.meta["spec"] == {**SPEC.to_meta(), "module_filter": ["down_proj", "q_proj"]}
    assert not {"projection", "indexer", "identity", "storage_dtype"} & set(alone.meta)


def test_calls_out_of_order_are_one_line(tmp_path, model, dataset):
    session = IndexSession(SPEC, tmp_path / "ix")
    with pytest.raises(GradianError, match=r"^IndexSession.begin before bind\(model\)"):
        session.begin(3)
    session.bind(model)
    batch = next(iter(loader(dataset)))
    with pytest.raises(GradianError, match=r"^IndexSession.compute outside begin\(\) ... finish\(\)"):
        session.add(batch)
    session.begin(len(dataset))
    session.finish()
    with pytest.raises(GradianError, match=r"^IndexSession.finish outside begin\(\) ... finish\(\)"):
        session.finish()
    with pytest.raises(GradianError, match=r"^IndexSession.compute outside begin\(\) ... finish\(\)"):
        session.add(batch)


def test_an_exception_keeps_the_rows_computed_before_it_and_the_rerun_resumes(tmp_path, model, dataset):
    # One chunk holds every row, so nothing is flushed during the run: without on_exception -> abort(),
    # the rows of the batches before the failure would be lost with the writer's buffer.
    indexer = GradientIndexer(tmp_path / "ix", **SPEC.to_meta(), rows_per_chunk=len(dataset))
    with pytest.raises(RuntimeError, match="killed in batch 2"):
        validate(tmp_path, indexer, model, dataset, fail_at=2)
    group = zarr.open_group(str(tmp_path / "ix"), mode="r")
    assert group["complete"][:].tolist() == [True] * 4 + [False] * (len(dataset) - 4)
    assert group.attrs["gradian"]["complete"] is False
    validate(tmp_path, indexer, model, dataset)  # the same process: the aborted writer let go of its lock
    assert indexer.summary["kept_rows"] == 4 and indexer.summary["computed_rows"] == len(dataset) - 4
    index = open_index(tmp_path / "ix")
    assert index.meta["complete"]
    torch.testing.assert_close(index.rows(slice(None)), exact_rows(model, dataset), rtol=1e-4, atol=1e-6)


def as_written_before_spec(meta):
    """The metadata an index had before `spec` existed (gradian up to issue 20): the same settings,
    copied under "indexer", "projection", "identity" and a top-level "storage_dtype"."""
    old = {k: v for k, v in meta.items() if k != "spec"}
    spec = meta["spec"]
    projection = {"kind": "kronecker_gaussian", "dim": spec["projection_dim"], "seed": spec["seed"]}
    old["indexer"] = {
        "path": "ix",
        "module_filter": spec["module_filter"],
        "projection_dim": spec["projection_dim"],
        "storage_dtype": spec["storage_dtype"],
        "seed": spec["seed"],
        "dataloader_idx": 0,
    }
    old["projection"], old["storage_dtype"] = projection, spec["storage_dtype"]
    old["identity"] = {
        "model": meta["model"]["name_or_path"],
        "modules": meta["modules"],
        "projection": projection,
        "storage_dtype": spec["storage_dtype"],
        "data": meta.get("data"),
    }
    return old


def test_an_index_of_the_format_before_spec_is_read_queried_and_resumed(tmp_path, model, tokenizer, rows, dataset):
    validate(tmp_path, GradientIndexer(tmp_path / "ix", **SPEC.to_meta()), model, dataset)
    new = open_index(tmp_path / "ix")
    want_rows, want_queries = new.rows(slice(None)), query_gradients(new, model, tokenizer, rows[:2])
    group = zarr.open_group(str(tmp_path / "ix"), mode="r+")
    group.attrs["gradian"] = as_written_before_spec(dict(group.attrs["gradian"]))
    old = open_index(tmp_path / "ix")
    assert old.storage_dtype == "float32" and "spec" not in old.meta
    assert torch.equal(old.rows(slice(None)), want_rows)
    assert torch.equal(query_gradients(old, model, tokenizer, rows[:2]), want_queries)
    top = old.topk(want_queries, k=len(rows), precondition="none")
    np.testing.assert_array_equal(top.indices, new.topk(want_queries, k=len(rows), precondition="none").indices)
    # The same job by this gradian: the fingerprint is the same, so the index is resumed, not refused.
    indexer = GradientIndexer(tmp_path / "ix", **SPEC.to_meta())
    validate(tmp_path, indexer, model, dataset)
    assert indexer.summary["kept_rows"] == len(dataset) and indexer.summary["computed_rows"] == 0
