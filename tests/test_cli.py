import zarr
from conftest import ROWS, write_jsonl

from gradian_lightning.cli import main
from gradian_lightning.gradients.memory import human_bytes


def test_index_end_to_end_on_a_saved_tiny_model(tmp_path, saved_model, capsys):
    data = write_jsonl(
        tmp_path / "train.jsonl", ROWS + [{"prompt": "the capital", "completion": " " + " ".join(["one"] * 40)}]
    )
    argv = [
        "index",
        "configs/smollm2.yaml",
        f"model.name_or_path={saved_model}",
        f"data.train={data}",
        f"index.path={tmp_path / 'ix'}",
        "grads.max_seq_length=24",
        "grads.batch_size=3",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # before the first batch: rows, modules, row width and the predicted size: the bytes of the arrays it then wrote
    # (rows, norms and statistics, uncompressed; the per-row flags and zarr's metadata are not counted)
    rows, modules = len(ROWS) + 1, 2 * 3  # the default filter: gate, up and down projections of 2 layers
    width = modules * 32 * 32  # the default projection_dim, 32
    group = zarr.open_group(str(tmp_path / "ix"))
    written = sum(group[name].nbytes for name in ("grads", "norms", "scales"))
    written += sum(a.nbytes for a in group["statistics"].array_values())
    assert "whitened_norms" in group["statistics"].array_keys()
    assert (
        out.splitlines()[0]
        == f"gradian index: {rows} rows × {modules} modules, row width {width:,} (int8) -> {human_bytes(written)} predicted for {tmp_path / 'ix'}"
    )
    assert f"{len(ROWS) + 1}/{len(ROWS) + 1} rows written" in out and "(complete)" in out
    assert "completions cut by grads.max_seq_length: 1 (12.5%)" in out
    grads = zarr.open_group(str(tmp_path / "ix"))["grads"]
    assert grads.shape == (len(ROWS) + 1, width) and str(grads.dtype) == "int8"
    meta = zarr.open_group(str(tmp_path / "ix")).attrs["gradian"]
    # Each setting is stored once: the spec's under "spec", the rest of grads.* in the config.
    assert meta["config"]["grads"] == {"batch_size": 3, "max_seq_length": 24}
    assert meta["spec"]["storage_dtype"] == "int8" and meta["spec"]["projection_dim"] == 32
    assert not {"projection", "indexer", "identity", "storage_dtype"} & set(meta)


def test_errors_are_one_line_and_exit_2(tmp_path, saved_model, capsys):
    assert main(["index", "configs/smollm2.yaml", "grads.batch_size=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradian index: error: setting 'grads.batch_size'=0") and "\n" not in err
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert (
        main(
            [
                "index",
                "configs/smollm2.yaml",
                f"model.name_or_path={saved_model}",
                f"data.train={data}",
                "grads.module_filter=nothing_like_this",
                f"index.path={tmp_path / 'ix'}",
            ]
        )
        == 2
    )
    assert "pattern 'nothing_like_this' matches no nn.Linear or Conv1D module" in capsys.readouterr().err
    assert (
        main(["index", "configs/smollm2.yaml", f"model.name_or_path={tmp_path / 'no-model'}", f"data.train={data}"])
        == 2
    )
    assert "setting 'model.name_or_path'" in capsys.readouterr().err
    assert main(["index", "configs/smollm2.yaml", f"data.train={data}", "trainer.max_epoch=1"]) == 2
    assert "'trainer.max_epoch' is not a lightning.Trainer argument" in capsys.readouterr().err
