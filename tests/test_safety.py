"""Safe by default: nothing unpickled, and an index run writes only under index.path."""

import ast
from pathlib import Path

import zarr
from conftest import ROWS, write_jsonl

import gradian_lightning
from gradian_lightning.cli import main

PACKAGE = Path(gradian_lightning.__file__).parent
UNPICKLERS = {"pickle", "cPickle", "dill", "joblib", "cloudpickle", "shelve", "marshal"}


def test_nothing_in_the_package_unpickles():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                )
                offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in UNPICKLERS]
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if called.endswith("torch.load") or called == "load" and "weights_only" in kwargs:
                    if kwargs.get("weights_only") != "True":
                        offenders.append(f"{path.name}:{node.lineno} calls {called} without weights_only=True")
                if kwargs.get("allow_pickle") == "True" or kwargs.get("weights_only") == "False":
                    offenders.append(
                        f"{path.name}:{node.lineno} {called}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
                    )
                if kwargs.get("trust_remote_code") == "True":
                    offenders.append(f"{path.name}:{node.lineno} hard-codes trust_remote_code=True")
    assert not offenders, offenders


def files(root: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_index_writes_only_under_index_path_and_stores_no_objects(tmp_path, saved_model, monkeypatch):
    (tmp_path / "data").mkdir()
    data = write_jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # anything written relative to the working directory would show here
    before = {**files(tmp_path), **files(saved_model)}
    config = Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml"
    target = work / "out" / "ix"
    assert (
        main(
            [
                "index",
                str(config),
                f"model.name_or_path={saved_model}",
                f"data.train={data}",
                f"index.path={target}",
                "trainer.accelerator=cpu",
                "trainer.enable_progress_bar=false",
            ]
        )
        == 0
    )
    after = {**files(tmp_path), **files(saved_model)}
    changed = [p for p in after if before.get(p) != after[p]]
    assert changed and all(target in p.parents for p in changed), [str(p) for p in changed if target not in p.parents]
    assert not [p for p in before if p not in after]  # nothing deleted either
    group = zarr.open_group(str(target), mode="r")
    for name, array in group.arrays():  # numbers, booleans and UTF-8 strings: no object (pickle) codec
        assert array.dtype.kind in "fiubUT", f"{name}: {array.dtype}"
        assert "pickle" not in str(array.metadata.to_dict()).lower()
