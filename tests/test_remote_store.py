"""index.path as an fsspec URL (memory://, file://) through zarr's FsspecStore: write, resume, query; bad URLs in one line."""

import shutil
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROWS, write_jsonl
from test_bad_input import index_args, run

from gradian_lightning import open_index
from gradian_lightning.config import load_config
from gradian_lightning.errors import ConfigError
from gradian_lightning.index.location import Location, missing_filesystem
from gradian_lightning.recipes.index import run_index

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml"


def index_config(model_dir, data, path, *more):
    return load_config(
        CONFIG,
        [
            f"model.name_or_path={model_dir}",
            f"data.train={data}",
            f"index.path={path}",
            "grads.batch_size=2",
            "index.rows_per_chunk=2",
            "grads.storage_dtype=float32",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false",
            *more,
        ],
    )


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_url_index_resumes_and_queries_like_a_local_one(tmp_path, saved_model, monkeypatch, scheme):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # `Path("file:///x")` would have written under the working directory
    url = f"memory://gradian-test-{uuid.uuid4().hex}/ix" if scheme == "memory" else f"file://{tmp_path}/deep/ix"
    reference = run_index(index_config(saved_model, data, tmp_path / "local"))
    # Stop after 2 of 4 batches, as a killed run would (its rows in whole chunks), then resume.
    first = run_index(index_config(saved_model, data, url, "trainer.limit_val_batches=2"))
    assert not first["complete"] and first["rows"] == 4 and first["kept_rows"] == 0
    second = run_index(index_config(saved_model, data, url))
    assert second["complete"] and second["kept_rows"] == 4 and second["computed_rows"] == len(ROWS) - 4
    assert second["path"] == url and second["bytes_on_disk"] > 0
    assert list(cwd.iterdir()) == []
    if scheme == "file":
        assert (tmp_path / "deep" / "ix" / "zarr.json").is_file()
    local, remote = open_index(tmp_path / "local"), open_index(url)
    assert reference["complete"] and remote.meta.complete and remote.column("complete").all()
    torch.testing.assert_close(remote.rows(slice(None)), local.rows(slice(None)), rtol=1e-5, atol=1e-6)
    assert list(remote.column("id")) == list(local.column("id"))
    queries = local.rows([0, 2, 5]) + 0.01
    assert torch.equal(remote.topk(queries, k=4).indices, local.topk(queries, k=4).indices)


def test_protocol_without_a_filesystem_is_one_line(tmp_path, saved_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    argv = index_args(tmp_path, saved_model, data)
    code, _, err = run(capsys, *argv[:4], "index.path=nosuchfs://bucket/ix", *argv[5:])
    assert code == 2 and err == (
        "gradian index: error: setting 'index.path'='nosuchfs://bucket/ix': no filesystem for nosuchfs:// is usable here "
        "(fsspec knows no protocol 'nosuchfs'); install it, or use a local directory (`gradian doctor` lists the usable protocols)"
    )
    with pytest.raises(ConfigError, match="no filesystem for nosuchfs://"):
        open_index("nosuchfs://bucket/ix")
    if missing_filesystem("s3") is not None:  # the usual case here: s3fs is not a dependency
        with pytest.raises(ConfigError, match="s3fs"):
            Location("s3://bucket/ix")


def test_read_only_store_is_one_line(tmp_path, saved_model, capsys):
    """A zip archive opened through fsspec's zip:// filesystem is a real read-only store: it can be queried, not written."""
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert run(capsys, *index_args(tmp_path, saved_model, data))[0] == 0
    shutil.make_archive(str(tmp_path / "archive"), "zip", tmp_path / "ix")
    url = f"zip://::file://{tmp_path}/archive.zip"
    archived = open_index(url)
    assert archived.meta.complete and torch.equal(
        archived.rows(slice(None)), open_index(tmp_path / "ix").rows(slice(None))
    )
    argv = index_args(tmp_path, saved_model, data)
    code, _, err = run(capsys, *argv[:4], f"index.path={url}", *argv[5:], "index.overwrite=true")
    assert code == 2 and err.startswith(f"gradian index: error: setting 'index.path'='{url}' cannot be written (")
    assert err.endswith("point index.path at a writable directory or bucket")
