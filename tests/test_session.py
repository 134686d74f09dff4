"""`IndexSession` without Lightning, `GradientIndexer.on_exception`, and indexes of the metadata format before `spec`."""

import lightning as L
import pytest
import torch
import zarr
from test_callback import trainer
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, IndexSession, IndexSpec, open_index
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError, GradianError
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
    assert alone.meta.fingerprint == lightning.meta.fingerprint
    # The spec is stored once: no second copy for another reader to read.
    assert alone.meta.spec.to_meta() == {**SPEC.to_meta(), "module_filter": ["down_proj", "q_proj"]}
    assert not {"projection", "indexer", "identity", "storage_dtype"} & set(alone.meta.attrs)


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


def test_a_session_alone_names_itself_in_its_errors(tmp_path, model, dataset):
    """Made standalone, its argument and batch errors name IndexSession, the call the user wrote."""
    for kwargs, message in (
        ({"rows_per_chunk": 0}, "IndexSession(rows_per_chunk=0) is not allowed; use None or an integer >= 1"),
        ({"path": "runs/{name}"}, "IndexSession(path='runs/{name}'): the only placeholder a path may hold is {step}"),
        ({"meta": {"when": float("nan")}}, "IndexSession(meta=...) cannot be stored in the index attributes"),
    ):
        with pytest.raises(ConfigError) as err:
            IndexSession(SPEC, **{"path": tmp_path / "ix", **kwargs})
        assert str(err.value).startswith(message)
    session = IndexSession(SPEC, tmp_path / "ix")
    session.bind(model)
    session.begin(len(dataset))
    with pytest.raises(GradianError, match=r"^IndexSession needs dict batches with an 'index' entry"):
        session.add({"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(ConfigError, match=r"^GradientIndexer\(rows_per_chunk=0\) is not allowed"):
        GradientIndexer(tmp_path / "ix", rows_per_chunk=0)  # through the callback, the callback's name


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
    assert index.meta.complete
    torch.testing.assert_close(index.rows(slice(None)), exact_rows(model, dataset), rtol=1e-4, atol=1e-6)
