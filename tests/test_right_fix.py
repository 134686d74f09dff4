"""Issue 42's items 9-13: each mistake gets a line naming what is wrong and a fix that works, the
Python API takes what its names promise, and a run prints Gradian's lines and nothing else.

| case (issue 42)                                          | test                                                        |
|----------------------------------------------------------|-------------------------------------------------------------|
| (9) a local model folder that does not exist             | test_a_missing_model_folder_says_no_such_folder             |
| (9) data.prompt_field naming a column the file lacks     | test_a_mapped_field_the_file_lacks_is_named_with_the_columns |
| (9) a JSONL file given as model.name_or_path             | test_a_data_file_given_as_the_model_says_it_is_data         |
| (9) a user folder without an index at index.path         | test_a_user_folder_at_index_path_suggests_a_path_that_works |
| (9) the same, for a checkpointed index (model.checkpoints) | test_a_user_folder_at_a_checkpointed_index_path_suggests_a_path_that_works |
| (9) a DatasetDict split that is not there                | test_a_wrong_split_suggests_a_split_that_loads              |
| (10) JsonlDataset("small.jsonl", tokenizer, 64)          | test_jsonl_dataset_takes_a_path_as_its_name_says            |
| (10) the README shows how to build one                   | test_the_readme_builds_a_jsonl_dataset_and_its_loader       |
| (11) Lightning's device lines, LeafSpec, cli.py:111 warnings | test_a_run_prints_gradians_lines_and_nothing_else       |
| (11) a stale .gradian-lock after every run               | test_the_lock_file_protects_a_live_writer_and_goes_with_it, test_a_lock_taken_on_a_file_removed_meanwhile_is_taken_again |
| (12) settings and file errors before torch imports      | test_settings_and_file_errors_come_before_torch_imports; benchmarks/perf/startup.py |
| (13) configs/smollm2.yaml, tests/smollm2.py               | test_the_example_config_names_the_hub_model_and_no_path_outside_a_clone |
"""

import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from conftest import ROWS, write_jsonl

from gradian_lightning.cli import main
from gradian_lightning.data_sources import open_rows
from gradian_lightning.errors import DataError
from gradian_lightning.hub import check_model_source
from gradian_lightning.specs import Fields

PROMPT_ROWS = [r for r in ROWS if "prompt" in r]


def one_error_line(capsys, *argv):
    """Run `gradian argv`; (exit status, the one `gradian ...: error:` line it printed)."""
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("gradian ")]
    assert len(lines) == 1, err
    return code, lines[0]


def test_a_missing_model_folder_says_no_such_folder(tmp_path, capsys):
    data = write_jsonl(tmp_path / "small.jsonl", PROMPT_ROWS)
    for missing in (f"{tmp_path}/nomodel", "./nomodel", "~/no/such/model/here"):
        code, line = one_error_line(
            capsys, "index", f"model.name_or_path={missing}", f"data.train={data}", f"index.path={tmp_path / 'ix'}"
        )
        assert code == 2
        assert f"setting 'model.name_or_path'={missing!r}: no such folder" in line, line
        assert "Repo id" not in line and "HuggingFaceTB/SmolLM2-135M-Instruct" in line
    assert not (tmp_path / "ix").exists()
    check_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub name is for from_pretrained to find


def test_a_data_file_given_as_the_model_says_it_is_data(tmp_path, capsys):
    data = write_jsonl(tmp_path / "small.jsonl", PROMPT_ROWS)
    code, line = one_error_line(
        capsys, "index", f"model.name_or_path={data}", f"data.train={data}", f"index.path={tmp_path / 'ix'}"
    )
    assert code == 2
    assert f"setting 'model.name_or_path'={str(data)!r} is a file, not a model folder" in line, line
    assert "a data file goes in data.train" in line and "not a valid JSON file" not in line


def test_a_mapped_field_the_file_lacks_is_named_with_the_columns(tmp_path):
    data = write_jsonl(tmp_path / "small.jsonl", PROMPT_ROWS)
    with pytest.raises(DataError) as refused:
        open_rows(str(data), Fields(prompt="question"))
    line = str(refused.value)
    assert "\n" not in line
    assert "no column 'question' (data.prompt_field)" in line, line
    assert "['completion', 'id', 'prompt']" in line and "data.prompt_field=prompt" in line
    assert len(open_rows(str(data), Fields(prompt="prompt"))) == len(PROMPT_ROWS)  # the fix it names works


def test_a_wrong_split_suggests_a_split_that_loads(tmp_path):
    saved = tmp_path / "small_dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(PROMPT_ROWS)}).save_to_disk(str(saved))
    with pytest.raises(DataError) as refused:
        open_rows(f"{saved}:test", Fields())
    line = str(refused.value)
    assert f"'data.train'='{saved}:test'" in line and "no split 'test', only ['train']" in line, line
    suggested = line.rsplit("data.train=", 1)[1].split()[0].rstrip(";,.")
    assert suggested == f"{saved}:train"
    assert len(open_rows(suggested, Fields())) == len(PROMPT_ROWS)  # the fix it names works


def test_a_user_folder_at_index_path_suggests_a_path_that_works(tmp_path, saved_model, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "small.jsonl", PROMPT_ROWS)
    (tmp_path / "userdir").mkdir()
    (tmp_path / "userdir" / "notes.txt").write_text("mine")
    settings = [
        f"model.name_or_path={saved_model}",
        f"data.train={data}",
        "grads.max_seq_length=24",
        "grads.projection_dim=4",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    code, line = one_error_line(capsys, "index", *settings, "index.path=userdir")
    assert code == 2 and "'userdir'" in line and "notes.txt" in line, line
    assert "index.overwrite=true" not in line  # refused for this very folder (remove_index)
    suggested = line.rsplit("index.path=", 1)[1].split()[0].rstrip(";,.")
    assert main(["index", *settings, f"index.path={suggested}"]) == 0  # the fix it names works
    assert (tmp_path / "userdir" / "notes.txt").read_text() == "mine"


def test_a_user_folder_at_a_checkpointed_index_path_suggests_a_path_that_works(tmp_path):
    from gradian_lightning.errors import ConfigError
    from gradian_lightning.index.checkpoints import register_checkpoint

    (tmp_path / "userdir").mkdir()
    (tmp_path / "userdir" / "notes.txt").write_text("mine")
    meta = {"fingerprint": "f", "num_rows": 4, "width": 8, "spec": {}}
    with pytest.raises(ConfigError) as refused:
        register_checkpoint(tmp_path / "userdir", 0, None, meta, complete=False)
    line = str(refused.value)
    assert "notes.txt" in line and "index.overwrite=true" not in line, line
    suggested = line.rsplit("index.path=", 1)[1].split()[0]
    assert register_checkpoint(suggested, 0, None, meta, complete=False)  # the fix it names works
    assert (tmp_path / "userdir" / "notes.txt").read_text() == "mine"


def test_jsonl_dataset_takes_a_path_as_its_name_says(tmp_path, tokenizer):
    from gradian_lightning.data import JsonlDataset, read_jsonl

    data = write_jsonl(tmp_path / "small.jsonl", ROWS)
    from_path = JsonlDataset(str(data), tokenizer, 64)
    from_rows = JsonlDataset(read_jsonl(data), tokenizer, 64)
    assert len(from_path) == len(ROWS) and from_path.examples == from_rows.examples
    assert JsonlDataset(data, tokenizer, 64).examples == from_rows.examples  # a Path as well as a str
    assert from_path.source == str(data)  # row errors name the file
    with pytest.raises(DataError, match=r"data file '.*nothere.jsonl' does not exist"):
        JsonlDataset(str(tmp_path / "nothere.jsonl"), tokenizer, 64)
    with pytest.raises(DataError, match=r"takes a JSONL file's path or a list of row dicts, and row 1 is a str"):
        JsonlDataset(["small.jsonl"], tokenizer, 64)


def test_the_readme_builds_a_jsonl_dataset_and_its_loader(tmp_path, tokenizer, monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b.split("\n", 1)[1] for b in readme.split("```python")[1:] if "JsonlDataset(" in b)
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "my_train.jsonl", ROWS)
    scope = {"tokenizer": tokenizer}
    exec(block.split("```", 1)[0], scope)
    batch = next(iter(scope["train_loader"]))
    assert batch["index"].tolist() == [0, 1, 2, 3] and batch["input_ids"].shape == batch["labels"].shape


def test_the_example_config_names_the_hub_model_and_no_path_outside_a_clone():
    from gradian_lightning.config import load_config

    root = Path(__file__).resolve().parents[1]
    assert (
        load_config(root / "configs" / "smollm2.yaml", []).model.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    readable = [
        *root.glob("configs/*.yaml"),
        root / "README.md",
        *root.glob("docs/**/*.md"),
        *root.glob("examples/*.py"),
        root / "benchmarks" / "common.py",
    ]
    for path in readable:
        text = path.read_text()
        assert "make-smollm2" not in text and "../shared" not in text, path  # not in a clone
    import smollm2

    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in smollm2.__doc__ and "make-smollm2" not in smollm2.__doc__


def test_the_lock_file_protects_a_live_writer_and_goes_with_it(tmp_path):
    from gradian_lightning.errors import ConfigError
    from gradian_lightning.index.location import LOCK_FILE, Location

    hold = (
        "import sys; from gradian_lightning.index.location import Location; "
        f"loc = Location({str(tmp_path / 'ix')!r}); lock = loc.writer_lock(); print('held', flush=True); "
        "sys.stdin.readline(); loc.unlock(lock, refused=False); print('released', flush=True); sys.stdin.readline()"
    )
    first = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"is being written by another gradian process \(pid {first.pid}\)"):
            Location(tmp_path / "ix").writer_lock()
        assert (tmp_path / "ix" / LOCK_FILE).is_file()  # the refused writer took nothing away
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.stdout.readline().strip() == "released"  # the first writer closed, its process alive
        assert list((tmp_path / "ix").iterdir()) == []  # no stale lock file
        second = Location(tmp_path / "ix")
        lock = second.writer_lock()
        assert lock is not None and (tmp_path / "ix" / LOCK_FILE).read_text() == str(os.getpid())
        second.unlock(lock, refused=False)
    finally:
        first.communicate("\n")


def test_a_lock_taken_on_a_file_removed_meanwhile_is_taken_again(tmp_path, monkeypatch):
    import fcntl

    from gradian_lightning.index import location

    # The race unlock's removal opens: another writer opened the lock file, then the first removed
    # it before this one's flock. That flock succeeds on a file no longer at the path; the writer
    # must lock the path's file instead, or a third writer could lock a new file beside it.
    loc, real_flock, removed = location.Location(tmp_path / "ix"), fcntl.flock, []

    def flock_after_removal(handle, how):
        if not removed:
            removed.append(True)
            (tmp_path / "ix" / location.LOCK_FILE).unlink()
        return real_flock(handle, how)

    monkeypatch.setattr(location.fcntl, "flock", flock_after_removal)
    lock = loc.writer_lock()
    assert removed and loc._holds(lock)
    assert os.stat(tmp_path / "ix" / location.LOCK_FILE).st_ino == os.fstat(lock.fileno()).st_ino
    loc.unlock(lock, refused=False)
    assert not (tmp_path / "ix" / location.LOCK_FILE).exists()


def test_a_run_prints_gradians_lines_and_nothing_else(tmp_path, saved_model):
    # A real process: Lightning's log handlers and Python's warning display are set up as a user's are.
    data = write_jsonl(tmp_path / "small.jsonl", PROMPT_ROWS)
    common = [
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "grads.max_seq_length=24",
        "grads.projection_dim=4",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    script = (
        "import sys, json; from gradian_lightning.cli import main; "
        f"assert main(['index', 'data.train={data}', *{common!r}]) == 0; "
        f"open({str(data)!r}, 'a').write(json.dumps({{'prompt': 'what city ?', 'completion': ' lima'}}) + '\\n'); "
        f"assert main(['query', 'data.train={data}', 'query.data={data}', *{common!r}]) == 0"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    for noise in ("GPU available", "TPU available", "LeafSpec", "cli.py", "UserWarning", "FutureWarning"):
        assert noise not in out, out
    said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert len(said) == 1 and said[0].startswith("gradian query: warning: row texts are not shown: the training data")
    assert os.listdir(tmp_path / "ix").count(".gradian-lock") == 0  # the lock goes with its writer


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["index", "data.train=missing.jsonl"], "data file 'missing.jsonl' does not exist; check data.train"),
        (["index", "data.train=rows.txt"], "the file type .txt is not one gradian reads"),
        (["index", "data.train=rows.jsonl", "model.name_or_path=./nomodel"], "'./nomodel': no such folder"),
        (["index", "data.train=rows.jsonl", "model.name_or_path=rows.jsonl"], "is a file, not a model folder"),
        (["index", "data.train=rows.jsonl", "index.path=rows.jsonl"], "'index.path'='rows.jsonl' is a file"),
        (["index", "data.train=rows.jsonl", "grads.projection_dim=-3"], "'grads.projection_dim'=-3 is not allowed"),
        (["query", "query.data=missing.jsonl"], "data file 'missing.jsonl' does not exist; check query.data"),
        (["query", "query.data=rows.jsonl", "index.path=nothere"], "'index.path'='nothere': nothing is there"),
        (["plan", "data.train=missing.jsonl"], "data file 'missing.jsonl' does not exist; check data.train"),
        (
            ["validate", "data.train=rows.jsonl", "query.data=gone.jsonl"],
            "'gone.jsonl' does not exist; check query.data",
        ),
        # A required setting left unset is a settings error too: named before any heavy import.
        (["query", "model.name_or_path=???", "query.data=rows.jsonl"], "setting 'model.name_or_path' is required"),
        (["plan", "model.name_or_path=???"], "setting 'model.name_or_path' is required"),
        (["report", "query.data=rows.jsonl"], "setting 'query.output' is required"),
        (["validate", "data.train=rows.jsonl"], "setting 'query.data' is required"),
    ],
)
def test_settings_and_file_errors_come_before_torch_imports(tmp_path, argv, expected):
    # In a process of its own: a test process has torch imported already.
    write_jsonl(tmp_path / "rows.jsonl", PROMPT_ROWS)
    (tmp_path / "rows.txt").write_text("x")
    (tmp_path / "model").mkdir()
    args = [*argv[:1], "model.name_or_path=model", *argv[1:]]
    script = (
        "import sys; from gradian_lightning.cli import main; code = main(sys.argv[1:]); "
        "heavy = [m for m in ('torch', 'lightning', 'transformers', 'datasets', 'zarr') if m in sys.modules]; "
        "print(code, heavy)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert expected in done.stderr, done.stderr
    assert done.stdout.strip() == "2 []", done.stdout  # the error, and none of those modules imported
