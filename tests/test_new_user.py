"""Issue 19's new-user trial, one test per case: nothing on disk is lost, and each bad input is one line.

| case (issue 19)                                         | test                                                      |
|---------------------------------------------------------|-----------------------------------------------------------|
| (1) index.path=. index.overwrite=true                   | test_overwrite_refuses_the_working_folder                 |
| (1) overwrite of a folder that is not an index          | test_overwrite_refuses_a_folder_that_is_not_an_index      |
| (1) overwrite of an index holding the user's files      | test_overwrite_refuses_an_index_folder_with_other_files   |
| (1) a metadata read that fails                          | test_a_failed_metadata_read_is_reported_not_taken_for_absent |
| (1) overwrite of a real index still works               | test_overwrite_replaces_an_index_of_another_configuration |
| (2) doctor without the cluster extra                    | tests/test_doctor.py, .ci/bare-install                    |
| (3) the fine-tuned weights, another path, the base      | test_a_query_is_matched_to_the_index_by_its_weights_not_its_path |
| (3) weights of another checkpoint                       | test_a_query_with_an_earlier_checkpoints_weights_is_told_which_checkpoint |
| (3) ./x vs x, another working folder                    | test_a_relative_data_path_resumes_from_another_folder     |
| (4) querying an unfinished index                        | test_an_unfinished_index_warns_and_says_how_many_rows_were_ranked |
| (5) disk full                                           | test_a_full_disk_is_one_line_and_a_rerun_resumes          |
| (5) two writers on one path                             | test_a_second_writer_is_refused_before_any_work           |
| (5) unwritable query.output                             | test_an_unwritable_output_fails_before_any_query_is_computed |
| (5) YAML top level a list, invalid YAML names its line  | test_a_bad_yaml_is_one_line_naming_where                  |
| (5) an unclosed list in an override                     | test_an_unclosed_list_in_an_override_is_one_line          |
| (5) trainer.precision=bf17 and other refused values     | test_a_trainer_value_lightning_refuses_names_the_key      |
| (5) PEFT example and benchmark plots without packages   | test_scripts_without_their_extra_refuse_in_one_line       |
| (5) Ctrl-C                                              | test_ctrl_c_says_a_rerun_resumes                          |
| (6) empty completion                                    | test_an_empty_completion_has_no_supervised_token          |
| (6) duplicate ids                                       | test_duplicate_ids_are_refused_and_integer_ids_kept       |
| (6) non-string ids, "prompt": null                      | test_rows_with_non_text_where_text_belongs_are_refused    |
| (6) an empty folder at index.path                       | test_an_empty_folder_is_a_place_for_a_new_index           |
| (6) "resumed" on a complete index; gradian_rows in index | test_gradian_index_shows_rows_on_its_progress_bar_and_a_rerun_says_already_complete |
| (6) s3/gs errors before the model loads                 | test_a_url_without_its_filesystem_fails_before_the_model_loads |
| (6) gradian query without a YAML                        | test_every_setting_may_be_an_override_without_a_yaml      |
| (6) the damping error's default                         | test_the_damping_error_names_the_real_default             |
| (6) validation dataloader, configs/ not in the wheel     | documented in README.md                                   |
"""

import numpy as np
import pytest
import torch
import zarr
from conftest import ROWS, write_jsonl

from gradian_lightning.cli import main
from gradian_lightning.errors import ConfigError, IndexFormatError, IndexWriteError
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
    assert read_meta(tmp_path / "ix").fingerprint == "f0"  # the old index is untouched


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
    assert read_meta(tmp_path / "ix").complete


def test_overwrite_replaces_an_index_of_another_configuration(tmp_path):
    fill(writer(tmp_path / "ix"))
    with pytest.raises(ConfigError, match="another configuration"):
        writer(tmp_path / "ix", seed=1)
    fill(writer(tmp_path / "ix", seed=1, overwrite=True))
    assert read_meta(tmp_path / "ix").fingerprint == "f1"
    assert np.array_equal(zarr.open_group(str(tmp_path / "ix"))["grads"][:], np.ones((4, 8), dtype=np.float32))


def test_overwrite_recomputes_an_index_of_the_same_settings(tmp_path, saved_model, tokenizer, capsys):
    """index.overwrite=true replaces a complete index of the same settings: new weights give new rows
    (it used to say "already complete" and keep the old ones). An unfinished one of the same
    settings and weights is resumed: the rows on disk are the rows it would compute."""
    from conftest import make_model, tiny_settings

    from gradian_lightning import open_index
    from gradian_lightning.recipes.index import run_index

    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    digest = lambda path: read_meta(path)["model"]["weights_sha256"]  # noqa: E731
    run_index(tiny_settings(saved_model, data, tmp_path / "ix"))
    old, was = open_index(tmp_path / "ix").rows(slice(None)), digest(tmp_path / "ix")
    make_model(len(tokenizer), seed=1).save_pretrained(saved_model)  # the model, trained on: other weights
    again = run_index(tiny_settings(saved_model, data, tmp_path / "ix", "index.overwrite=true"))
    assert again["complete"] and again["kept_rows"] == 0 and again["computed_rows"] == len(ROWS)
    fresh = run_index(tiny_settings(saved_model, data, tmp_path / "fresh"))
    assert torch.equal(open_index(tmp_path / "ix").rows(slice(None)), open_index(tmp_path / "fresh").rows(slice(None)))
    assert not torch.equal(open_index(tmp_path / "ix").rows(slice(None)), old)
    assert digest(tmp_path / "ix") == digest(tmp_path / "fresh") != was and fresh["complete"]
    # Unfinished, the same settings and weights: overwrite resumes it (what a rerun after Ctrl-C does).
    cut = run_index(tiny_settings(saved_model, data, tmp_path / "cut", "trainer.limit_val_batches=1"))
    assert not cut["complete"] and cut["rows"] > 0
    done = run_index(tiny_settings(saved_model, data, tmp_path / "cut", "index.overwrite=true"))
    assert done["complete"] and done["kept_rows"] == cut["rows"]
    assert torch.equal(open_index(tmp_path / "cut").rows(slice(None)), open_index(tmp_path / "fresh").rows(slice(None)))


def test_a_second_writer_is_refused_before_any_work(tmp_path):
    import subprocess
    import sys

    # The first writer is another process that holds the lock until it reads a line.
    hold = (
        "import sys; from gradian_lightning.index.location import Location; "
        f"lock = Location({str(tmp_path / 'ix')!r}).writer_lock(); print('held', flush=True); sys.stdin.readline()"
    )
    first = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"is being written by another gradian process \(pid {first.pid}\)"):
            writer(tmp_path / "ix")
        assert [p.name for p in (tmp_path / "ix").iterdir()] == [".gradian-lock"]  # refused before anything was made
    finally:
        first.communicate("\n")
    fill(writer(tmp_path / "ix"))  # the lock went with its process


def test_the_lock_file_is_not_taken_for_part_of_the_index(tmp_path):
    import warnings

    from gradian_lightning.index.location import LOCK_FILE
    from gradian_lightning.index.reader import IndexReader
    from gradian_lightning.query.precondition import build_preconditioner, counted_rows

    # zarr warns on every entry of the folder that is not a node when a group is listed; every
    # index, resume and query printed two lines of it about the lock file.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fill(writer(tmp_path / "ix"))
        resumed = writer(tmp_path / "ix")
        assert resumed.kept_rows == 4
        resumed.close()
        index = IndexReader(tmp_path / "ix")
        assert counted_rows(index) == 4
        assert build_preconditioner(index, "diag", 1.0) is not None
    assert not (tmp_path / "ix" / LOCK_FILE).exists()  # the lock goes with its writer (issue 42)
    assert [str(w.message) for w in caught if LOCK_FILE in str(w.message)] == []


def test_a_full_disk_is_one_line_and_a_rerun_resumes(tmp_path, monkeypatch):
    import errno

    w = IndexWriter(tmp_path / "ix", 4, 8, "float32", {"fingerprint": "f0", "modules": []}, rows_per_chunk=2)
    w.write([0, 1], torch.ones(2, 8), torch.zeros(2), torch.ones(2), torch.zeros(2), ["0", "1"])
    real = IndexWriter._set

    def full(self, name, where, values):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(IndexWriter, "_set", full)
    with pytest.raises(
        IndexWriteError, match=r"no space left .* \(2 of 4 rows are safely written\); free some space, then rerun"
    ):
        w.write([2, 3], torch.full((2, 8), 2.0), torch.zeros(2), torch.ones(2), torch.zeros(2), ["2", "3"])
    monkeypatch.setattr(IndexWriter, "_set", real)
    again = IndexWriter(tmp_path / "ix", 4, 8, "float32", {"fingerprint": "f0", "modules": []}, rows_per_chunk=2)
    assert again.kept_rows == 2 and again.todo.tolist() == [False, False, True, True]


def test_ctrl_c_says_a_rerun_resumes(monkeypatch, capsys):
    def interrupted(cfg, announce=None):
        raise KeyboardInterrupt

    monkeypatch.setattr("gradian_lightning.recipes.index.run_index", interrupted)
    assert main(["index", "model.name_or_path=x", "data.train=y"]) == 130
    assert (
        capsys.readouterr().err.strip()
        == "gradian index: interrupted: the rows written so far are kept; rerun the same command to resume from them"
    )


def test_ctrl_c_inside_lightning_is_gradians_line_and_exit_130(tmp_path, saved_model, monkeypatch, capsys, caplog):
    """Lightning catches KeyboardInterrupt itself, says "Detected KeyboardInterrupt" and calls
    sys.exit(1); gradian index says what troubleshooting.md promises and exits 130, and the rows
    written before the interrupt are kept for the rerun."""
    import signal

    from gradian_lightning.index.session import IndexSession

    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    argv = [
        "index",
        f"model.name_or_path={saved_model}",
        f"data.train={data}",
        f"index.path={tmp_path / 'ix'}",
        "grads.batch_size=2",
        "index.rows_per_chunk=2",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    real, calls = IndexSession.compute, []

    def interrupted_at_the_third_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(IndexSession, "compute", interrupted_at_the_third_batch)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert (
        "gradian index: interrupted: the rows written so far are kept; rerun the same command to resume from them"
        in err
    )
    assert "Detected KeyboardInterrupt" not in err + caplog.text
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Lightning's SIG_IGN is undone
    assert int(zarr.open_group(str(tmp_path / "ix"), mode="r")["complete"][:].sum()) == 4  # two batches
    monkeypatch.setattr(IndexSession, "compute", real)
    assert main(argv) == 0
    assert f"resumed: 4 rows kept from an interrupted run, {len(ROWS) - 4} computed now" in capsys.readouterr().out


def test_every_setting_may_be_an_override_without_a_yaml(tmp_path, saved_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(["index", f"data.train={data}", *common]) == 0
    assert main(["query", f"query.data={data}", "query.top_k=2", *common]) == 0
    assert "queries ranked against" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, expected",
    [
        ("- a\n- b\n", "holds a list at its top level; write sections of settings"),
        (
            "grads:\n  batch_size: 2\n  bad: [1, 2\n",
            "is not valid YAML (line 4, column 1: did not find expected ',' or ']', while parsing a flow sequence at line 3)",
        ),
    ],
)
def test_a_bad_yaml_is_one_line_naming_where(tmp_path, capsys, text, expected):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert main(["plan", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_an_unclosed_list_in_an_override_is_one_line(capsys):
    assert main(["plan", "grads.module_filter=[a,b"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "gradian plan: error: override 'grads.module_filter=[a,b': its value is not valid YAML (did not find expected ',' or ']'); close lists and quotes, e.g. grads.module_filter=[q_proj,v_proj]"
    )


@pytest.mark.parametrize("key, value", [("precision", "bf17"), ("devices", "-7"), ("strategy", "nonsense")])
def test_a_trainer_value_lightning_refuses_names_the_key(tmp_path, saved_model, capsys, key, value):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    code = main(
        [
            "index",
            f"model.name_or_path={saved_model}",
            f"data.train={data}",
            f"index.path={tmp_path / 'ix'}",
            "trainer.accelerator=cpu",
            f"trainer.{key}={value}",
        ]
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.count("\n") == 1
        and f"setting 'trainer.{key}'=" in err
        and "refused by lightning.Trainer" in err
    ), err
    assert not (tmp_path / "ix").exists()


def test_an_unwritable_output_fails_before_any_query_is_computed(tmp_path, saved_model, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(["index", f"data.train={data}", *common]) == 0
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder\n")
    computed = []
    monkeypatch.setattr("gradian_lightning.recipes.query.query_gradients", lambda *a, **k: computed.append(1))
    assert main(["query", f"query.data={data}", f"query.output={blocked / 'results.jsonl'}", *common]) == 2
    err = capsys.readouterr().err
    assert "setting 'query.output'=" in err and "cannot be written (FileExistsError" in err and not computed
    assert blocked.read_text() == "not a folder\n"


def test_an_unfinished_index_warns_and_says_how_many_rows_were_ranked(tmp_path, saved_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(["index", f"data.train={data}", "index.rows_per_chunk=2", *common]) == 0
    group = zarr.open_group(str(tmp_path / "ix"), mode="r+")
    group["complete"][2:] = False  # as a run killed after the first chunk leaves it
    group.attrs["gradian"] = {**group.attrs["gradian"], "complete": False}
    with pytest.warns(
        UserWarning, match=rf"is unfinished: 2 of {len(ROWS)} rows are written, and only those are ranked"
    ):
        assert (
            main(
                [
                    "query",
                    f"query.data={data}",
                    f"query.top_k={len(ROWS)}",
                    f"query.output={tmp_path / 'r.jsonl'}",
                    *common,
                ]
            )
            == 0
        )
    assert f"ranked against the 2 written rows (of {len(ROWS)}: the index is unfinished)" in capsys.readouterr().out
    ranked = [
        r["index"]
        for line in (tmp_path / "r.jsonl").read_text().splitlines()
        for r in __import__("json").loads(line)["results"]
    ]
    assert set(ranked) == {0, 1}


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"prompt": null, "completion": "x"}', "'prompt' is null; it must be a string"),
        ('{"text": 5}', "'text' is 5; it must be a string"),
        ('{"prompt": "a", "completion": "b", "id": [1, 2]}', "'id' is [1, 2]; it must be a string or an integer"),
        ('{"prompt": "a", "completion": "b", "id": null}', "'id' is null; it must be a string or an integer"),
        ('{"messages": [{"role": "user", "content": null}]}', "'messages' must be a list of"),
    ],
)
def test_rows_with_non_text_where_text_belongs_are_refused(tmp_path, line, expected):
    from gradian_lightning.data import read_jsonl
    from gradian_lightning.errors import DataError

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok", "completion": "fine", "id": "a"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"d\.jsonl row 2: {__import__('re').escape(expected)}"):
        read_jsonl(path)


def test_duplicate_ids_are_refused_and_integer_ids_kept(tmp_path, tokenizer):
    from gradian_lightning.data import JsonlDataset, read_jsonl
    from gradian_lightning.errors import DataError

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "id": "x"}\n{"text": "b", "id": 7}\n{"text": "c", "id": "x"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl row 3: id 'x' is also the id of row 1; .* each must be unique"):
        read_jsonl(path)
    path.write_text('{"text": "a", "id": "x"}\n{"text": "b", "id": 7}\n')
    assert [e.id for e in JsonlDataset(read_jsonl(path), tokenizer, 32)] == ["x", "7"]


def test_an_empty_completion_has_no_supervised_token(tokenizer):
    from gradian_lightning.data import IGNORE_INDEX, tokenize_row

    empty = tokenize_row(tokenizer, {"prompt": "Where does Renpe live ?", "completion": ""}, 0, 64)
    assert all(label == IGNORE_INDEX for label in empty.labels)
    one = tokenize_row(tokenizer, {"prompt": "Where does Renpe live ?", "completion": " lima"}, 0, 64)
    assert [t for t in one.labels if t != IGNORE_INDEX][-1] == tokenizer.eos_token_id  # EOS still follows a completion


def test_gradian_index_shows_rows_on_its_progress_bar_and_a_rerun_says_already_complete(tmp_path, saved_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = [
        "index",
        f"model.name_or_path={saved_model}",
        f"data.train={data}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "grads.batch_size=2",
    ]
    assert main(args) == 0
    out, err = capsys.readouterr()
    bar = (out + err).replace(".00", "")  # Lightning's bar writes to stdout
    assert f"gradian_rows={len(ROWS)}" in bar and "gradian_eta_s=" in bar
    assert "resumed" not in out and "already complete" not in out
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "already complete: an earlier run wrote every row, so nothing was computed" in out and "resumed" not in out


def test_a_url_without_its_filesystem_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    monkeypatch.setattr(
        "gradian_lightning.recipes.index.load_model_and_tokenizer", lambda *a: pytest.fail("model loaded")
    )
    monkeypatch.setitem(__import__("sys").modules, "gcsfs", None)
    assert main(["index", "model.name_or_path=anything", f"data.train={data}", "index.path=gs://bucket/ix"]) == 2
    assert "no filesystem for gs:// is usable here" in capsys.readouterr().err


def test_scripts_without_their_extra_refuse_in_one_line(monkeypatch):
    import runpy
    import sys

    from benchmarks.common import pyplot

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    monkeypatch.setitem(sys.modules, "peft", None)  # as an install without the extra lacks it
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(root / "examples" / "finetune_and_attribute.py"), run_name="example")
    assert (
        str(stop.value)
        == 'finetune_and_attribute.py: error: this LoRA example needs peft, which is not installed here; pip install "gradian-lightning[test]"'
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as stop:
        pyplot()
    assert str(stop.value).endswith(
        'error: drawing the benchmark\'s figure needs matplotlib, which is not installed here; pip install "gradian-lightning[bench]"'
    )


def _save_perturbed(source, target, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a training step's worth of change, everywhere
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def test_a_query_is_matched_to_the_index_by_its_weights_not_its_path(tmp_path, saved_model, tokenizer, capsys):
    import shutil

    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [f"index.path={tmp_path / 'ix'}", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]
    assert main(["index", f"model.name_or_path={saved_model}", f"data.train={data}", *common]) == 0
    copy = shutil.copytree(saved_model, tmp_path / "elsewhere" / "same-weights")
    assert (
        main(["query", f"model.name_or_path={copy}", f"query.data={data}", *common]) == 0
    )  # another path, same weights
    other = _save_perturbed(saved_model, tmp_path / "finetuned", tokenizer)
    capsys.readouterr()
    assert main(["query", f"model.name_or_path={other}", f"query.data={data}", *common]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("gradian ")]
    assert len(lines) == 1 and "the model's weights are not those the index was built with" in lines[0]


def test_a_query_with_an_earlier_checkpoints_weights_is_told_which_checkpoint(tmp_path, saved_model, tokenizer, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    finetuned = _save_perturbed(saved_model, tmp_path / "finetuned", tokenizer)
    common = [f"index.path={tmp_path / 'ix'}", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]
    assert (
        main(
            [
                "index",
                f"model.name_or_path={saved_model}",
                f"model.checkpoints=[{saved_model},{finetuned}]",
                f"data.train={data}",
                *common,
            ]
        )
        == 0
    )
    capsys.readouterr()
    # The base model against the newest checkpoint (query.checkpoints=last): refused, with the step it matches.
    assert (
        main(["query", f"model.name_or_path={saved_model}", f"query.data={data}", "query.checkpoints=last", *common])
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "they are the weights of its checkpoint at step 0: score with that checkpoint (query.checkpoints=[0]" in err
    ), err


def test_a_relative_data_path_resumes_from_another_folder(tmp_path, saved_model, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    write_jsonl(work / "train.jsonl", ROWS)
    common = [
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    monkeypatch.chdir(work)
    assert main(["index", "data.train=./train.jsonl", *common]) == 0
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["index", f"data.train={work / 'train.jsonl'}", *common]) == 0  # the same job: nothing to redo
    assert "already complete" in capsys.readouterr().out


def test_the_damping_error_names_the_real_default():
    from gradian_lightning.specs import DEFAULT_DAMPING, QuerySpec

    with pytest.raises(ConfigError, match=rf"; {DEFAULT_DAMPING} is the default\)$"):
        QuerySpec(damping=-1.0)
    assert DEFAULT_DAMPING == QuerySpec().damping == 1.0
