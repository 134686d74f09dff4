"""Issue 30's last silent failures and tracebacks, each now one line or fixed."""

import os

import pytest
from conftest import ROWS, make_model, tiny_settings, write_jsonl

from gradian_lightning import GradientIndexer
from gradian_lightning.errors import ConfigError
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.query.rows import _other_weights
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.query import run_query


def settings(model, train, path, *extra):
    return tiny_settings(model, train, path, *extra)


def test_a_model_folder_without_a_tokenizer_is_refused(tmp_path, tokenizer):
    folder = tmp_path / "weights-only"
    make_model(len(tokenizer)).save_pretrained(folder)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"is a model folder without tokenizer files \(tokenizer.json, "):
        run_index(settings(folder, data, tmp_path / "ix"))
    assert not (tmp_path / "ix").exists()


def test_a_query_after_the_data_changed_says_so(tmp_path, saved_model):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    run_index(settings(saved_model, data, tmp_path / "ix"))
    write_jsonl(data, ROWS[::-1])  # edited after indexing: the stored positions no longer name these rows
    cfg = settings(saved_model, data, tmp_path / "ix", f"query.data={data}")
    with pytest.warns(
        UserWarning, match=r"row texts are not shown: the training data .*rows.jsonl' changed after it was indexed"
    ):
        answer = run_query(cfg)
    assert answer["train_rows"] is None


def test_index_path_at_a_file_or_an_uncreatable_place_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("notes")
    with pytest.raises(ConfigError, match=r"index.path'=.*afile' is a file; an index is a folder"):
        GradientIndexer(afile)
    with pytest.raises(ConfigError, match=r"afile/sub' lies under .*afile', a file"):
        GradientIndexer(afile / "sub")
    with pytest.raises(ConfigError, match=r"index.path'='/proc/gradian/ix' cannot be created \("):
        IndexWriter("/proc/gradian/ix", 4, 8, "float32", {})
    assert afile.read_text() == "notes"


def test_a_refused_run_leaves_no_lock_file(tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files that are not a Gradian index"):
        IndexWriter(foreign, 4, 8, "float32", {})
    assert os.listdir(foreign) == ["todo.txt"]
    IndexWriter(tmp_path / "ix", 4, 8, "float32", {"fingerprint": "a"}).close()
    with pytest.raises(ConfigError, match="another configuration"):
        IndexWriter(tmp_path / "ix", 4, 8, "float32", {"fingerprint": "b"})
    assert ".gradian-lock" not in os.listdir(tmp_path / "ix")  # neither the finished run nor the refused one left it


def test_the_weights_mismatch_names_no_missing_model():
    phrase = _other_weights("aaaa", "bbbb", None, {"global_step": 0})
    assert phrase.endswith("(weights digest aaaa here, bbbb in the index)")
    assert _other_weights("aaaa", "bbbb", "/m", {}).endswith("built from '/m')")


def test_index_prints_no_advert_and_a_late_error_on_its_own_line(tmp_path, tokenizer, capsys):
    from gradian_lightning.cli import main

    plain = tmp_path / "no-chat-template"
    make_model(len(tokenizer)).save_pretrained(plain)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)  # row 4 is a chat: found when it is tokenised
    argv = ["index", f"model.name_or_path={plain}", f"data.train={data}", f"index.path={tmp_path / 'ix'}"]
    assert main([*argv, "grads.projection_dim=4", "grads.batch_size=2", "trainer.accelerator=cpu"]) == 2
    err = capsys.readouterr().err
    assert "litlogger" not in err
    line = next(line for line in err.split("\n") if "error:" in line)
    assert line.startswith("gradian index: error: ") and "row 4: rows use 'messages'" in line


def test_an_error_closes_the_progress_bar_line():
    import io

    from tqdm import tqdm

    from gradian_lightning.recipes.index import IndexProgressBar

    screen = io.StringIO()
    bar = IndexProgressBar()
    bar._val_progress_bar = tqdm(total=None, desc="Validation", file=screen, leave=False)
    bar._val_progress_bar.update(3)
    bar.on_exception(None, None, RuntimeError("late"))
    assert screen.getvalue().rstrip(" ").endswith("\n")  # what is printed next starts a line of its own


def test_help_and_settings_errors_import_no_torch():
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from gradian_lightning.cli import main\n"
        "assert main(['index', 'grads.batch_size=0']) == 2\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'lightning', 'transformers', 'datasets') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
