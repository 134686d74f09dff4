"""Issue 19's new-user trial, one test per case: nothing on disk is lost, and each bad input is one line.

| case                                               | test                                              |
|----------------------------------------------------|---------------------------------------------------|
| index.path=. index.overwrite=true                  | test_overwrite_refuses_the_working_folder         |
| overwrite on a folder that is not an index         | test_overwrite_refuses_a_folder_that_is_not_an_index |
| overwrite on an index holding the user's files     | test_overwrite_refuses_an_index_folder_with_other_files |
| a metadata read that fails                         | test_a_failed_metadata_read_is_reported_not_taken_for_absent |
| an empty folder at index.path                      | test_an_empty_folder_is_a_place_for_a_new_index   |
| overwrite of a real index                          | test_overwrite_replaces_an_index_of_another_configuration |
"""

import numpy as np
import pytest
import torch
import zarr
from conftest import ROWS, write_jsonl

from gradian_lightning.cli import main
from gradian_lightning.errors import ConfigError, IndexFormatError
from gradian_lightning.index.layout import read_meta
from gradian_lightning.index.writer import IndexWriter


def files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def writer(path, seed=0, overwrite=False, num_rows=4):
    return IndexWriter(path, num_rows, 8, "float32", {"fingerprint": f"f{seed}", "modules": []}, overwrite)


def fill(w):
    w.write(
        range(w.num_rows),
        torch.ones(w.num_rows, 8),
        torch.zeros(w.num_rows),
        torch.ones(w.num_rows),
        torch.zeros(w.num_rows),
        [str(i) for i in range(w.num_rows)],
    )
    assert w.close()


def test_overwrite_refuses_the_working_folder(tmp_path, saved_model, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    data = write_jsonl(work / "train.jsonl", ROWS)
    (work / "my.yaml").write_text("grads:\n  batch_size: 2\n")
    monkeypatch.chdir(work)
    before = files(tmp_path)
    for path in (".", str(work), str(tmp_path)):  # the working folder and a folder above it
        code = main(
            [
                "index",
                "my.yaml",
                f"model.name_or_path={saved_model}",
                f"data.train={data}",
                f"index.path={path}",
                "index.overwrite=true",
                "trainer.accelerator=cpu",
                "trainer.enable_progress_bar=false",
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and "the working folder or a folder above it" in err and "Traceback" not in err, err
        assert files(tmp_path) == before


def test_overwrite_refuses_a_folder_that_is_not_an_index(tmp_path):
    target = tmp_path / "stuff"
    target.mkdir()
    (target / "train.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"removes only a Gradian index or an empty folder.*train\.jsonl"):
        writer(target, overwrite=True)
    assert (target / "train.jsonl").read_text() == "{}\n"


def test_overwrite_refuses_an_index_folder_with_other_files(tmp_path):
    fill(writer(tmp_path / "ix"))
    (tmp_path / "ix" / "config.yaml").write_text("keep me\n")
    with pytest.raises(ConfigError, match=r"holds files that are not part of the index \(config\.yaml\)"):
        writer(tmp_path / "ix", seed=1, overwrite=True)
    assert (tmp_path / "ix" / "config.yaml").read_text() == "keep me\n"
    assert read_meta(tmp_path / "ix")["fingerprint"] == "f0"  # the old index is untouched


def test_a_failed_metadata_read_is_reported_not_taken_for_absent(tmp_path, monkeypatch):
    fill(writer(tmp_path / "ix"))
    before = files(tmp_path)

    def unreadable(self, mode="r"):
        raise OSError("connection reset by peer")

    monkeypatch.setattr("gradian_lightning.index.location.Location.open_group", unreadable)
    with pytest.raises(
        IndexFormatError, match=r"could not be read \(OSError: connection reset by peer\); nothing was changed"
    ):
        writer(tmp_path / "ix", seed=1, overwrite=True)
    assert files(tmp_path) == before


def test_an_empty_folder_is_a_place_for_a_new_index(tmp_path):
    (tmp_path / "ix").mkdir()
    fill(writer(tmp_path / "ix"))
    assert read_meta(tmp_path / "ix")["complete"]


def test_overwrite_replaces_an_index_of_another_configuration(tmp_path):
    fill(writer(tmp_path / "ix"))
    with pytest.raises(ConfigError, match="another configuration"):
        writer(tmp_path / "ix", seed=1)
    fill(writer(tmp_path / "ix", seed=1, overwrite=True))
    assert read_meta(tmp_path / "ix")["fingerprint"] == "f1"
    assert np.array_equal(zarr.open_group(str(tmp_path / "ix"))["grads"][:], np.ones((4, 8), dtype=np.float32))
