"""Bad input gets one clear line and loses nothing; NaN never lands in the index silently."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from conftest import ROWS, make_model, write_jsonl

from gradian_lightning import open_index
from gradian_lightning.cli import main
from gradian_lightning.data import read_jsonl
from gradian_lightning.errors import DataError
from gradian_lightning.gradients.memory import fp32_logit_bytes


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("gradian ")]
    assert len(lines) == (code != 0), err  # an error is exactly one line
    return code, out, lines[0] if lines else ""


def index_args(tmp_path, model_dir, data, *more):
    return [
        "index",
        "configs/smollm2.yaml",
        f"model.name_or_path={model_dir}",
        f"data.train={data}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        *more,
    ]


def test_undecodable_data_file(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="cannot be read as UTF-8 text"):
        read_jsonl(bad)


def test_projection_dim_wider_than_a_module(tmp_path, saved_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    code, _, err = run(capsys, *index_args(tmp_path, saved_model, data, "grads.projection_dim=1000"))
    assert (
        code == 2
        and "setting 'grads.projection_dim'=1000 exceeds module 'model.layers.0.mlp.gate_proj' (64×32); use at most 32"
        in err
    )


def test_bad_data_loses_no_existing_index(tmp_path, saved_model, capsys):
    good = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert run(capsys, *index_args(tmp_path, saved_model, good))[0] == 0
    before = open_index(tmp_path / "ix").rows(slice(None))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "the sky"}\n{"text": "the sea"\n')
    code, _, err = run(capsys, *index_args(tmp_path, saved_model, broken))
    assert (
        code == 2
        and err
        == f"gradian index: error: {broken}:2: malformed JSON (Expecting ',' delimiter); each line must be one JSON object"
    )
    after = open_index(tmp_path / "ix")
    assert after.meta.complete and torch.equal(after.rows(slice(None)), before)


def test_model_that_needs_remote_code_says_to_trust_it(tmp_path, saved_model, capsys):
    custom = tmp_path / "custom"
    shutil.copytree(saved_model, custom)
    (custom / "config.json").write_text(
        '{"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}}'
    )
    (custom / "configuration_x.py").write_text("raise SystemExit('remote code ran')\n")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    for command in ("index", "plan"):
        code, _, err = run(
            capsys,
            command,
            "configs/smollm2.yaml",
            f"model.name_or_path={custom}",
            f"data.train={data}",
            f"index.path={tmp_path / 'ix'}",
        )
        assert (
            code == 2
            and f"model {str(custom)!r} ships its own code; if you trust it, pass model.trust_remote_code=true" in err
        )
    assert not (tmp_path / "ix").exists()


def test_nonfinite_gradients_are_counted_named_and_not_stored(tmp_path, tokenizer, capsys):
    model = make_model(len(tokenizer))
    cairo = tokenizer.convert_tokens_to_ids("cairo")
    with torch.no_grad():
        model.model.embed_tokens.weight[cairo] = float("nan")  # only the row that contains "cairo" sees it
    model_dir = tmp_path / "nan-model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = ROWS[:3] + [{"id": "broken", "prompt": "what city ?", "completion": " cairo"}] + ROWS[3:]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    code, out, _ = run(capsys, *index_args(tmp_path, model_dir, data, "grads.batch_size=3"))
    assert code == 0
    assert "rows with NaN/inf gradients (stored as zeros, excluded from ranking): 1 -> rows 3 (id 'broken')" in out
    index = open_index(tmp_path / "ix")
    assert np.flatnonzero(~index.column("finite")).tolist() == [3]
    grads = index.rows(slice(None))
    assert (
        torch.isfinite(grads).all() and grads[3].abs().sum() == 0 and (grads[[0, 1, 2, 4]].abs().sum(dim=1) > 0).all()
    )


def test_accelerator_oom_becomes_one_line_with_the_levers(tmp_path, saved_model, tokenizer, capsys, monkeypatch):
    import gradian_lightning.index.session as session

    calls = []

    own_call = session.GradientRows.__call__

    def out_of_memory(self, batch, *args, **kwargs):
        calls.append(batch)
        if len(calls) == 2:  # the second batch fails, as a long batch would
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return own_call(self, batch, *args, **kwargs)

    monkeypatch.setattr(session.GradientRows, "__call__", out_of_memory)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    code, _, err = run(
        capsys, *index_args(tmp_path, saved_model, data, "grads.batch_size=3", "grads.max_seq_length=20")
    )
    assert code == 2
    failed = calls[1]["labels"]
    n_supervised = int((failed[:, 1:] != -100).sum())
    vocab = len(tokenizer)
    want_bytes = fp32_logit_bytes(n_supervised, vocab)
    from gradian_lightning.gradients.memory import human_bytes

    assert err.startswith(
        "gradian index: error: device out of memory indexing rows 3-5: a batch of 3 rows (grads.max_seq_length=20, padded length"
    )
    assert (
        f"holds {n_supervised} supervised tokens × vocab {vocab}, so its fp32 logits alone need {human_bytes(want_bytes)}"
        in err
    )
    levers = [
        "lower grads.batch_size first",
        "then grads.max_seq_length",
        "grads.storage_dtype, grads.module_filter and grads.projection_dim shrink the index on disk, not this tensor",
    ]
    assert all(lever in err for lever in levers) and err.index(levers[0]) < err.index(levers[1])
    # nothing lost: the first batch's rows are kept for the rerun, the index is not marked complete
    group = zarr.open_group(str(tmp_path / "ix"))
    assert group.attrs["gradian"]["complete"] is False


def test_other_runtime_errors_pass_through(tmp_path, saved_model, capsys, monkeypatch):
    import gradian_lightning.index.session as session

    def broken(*args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(session.GradientRows, "__call__", broken)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        main(index_args(tmp_path, saved_model, data))


@pytest.mark.parametrize("chunk", [None, 64])
def test_out_of_memory_names_the_loss_chunk_lever_when_it_is_off(tmp_path, model, chunk):
    from gradian_lightning import IndexSession, IndexSpec
    from gradian_lightning.gradients.memory import human_bytes

    session = IndexSession(IndexSpec(loss_chunk_tokens=chunk), tmp_path / "ix")
    session.bind(model)
    labels = torch.randint(3, 40, (2, 300))
    batch = {"input_ids": labels.clone(), "labels": labels, "index": torch.tensor([7, 8])}
    err = str(session.out_of_memory(batch, torch.tensor([True, True])))
    vocab = model.config.vocab_size
    if (
        chunk is None
    ):  # 598 supervised tokens: the logits need 598 × vocab × 4 bytes, 256 tokens at a time would need less
        assert f"fp32 logits alone need {human_bytes(fp32_logit_bytes(598, vocab))}" in err
        assert (
            f"or set grads.loss_chunk_tokens=256 (the same rows; the fp32 logits then need at most {human_bytes(fp32_logit_bytes(256, vocab))} whatever the batch)"
            in err
        )
    else:  # already chunked: the logits are the chunk's, and the lever is not offered again
        assert (
            f"fp32 logits alone need {human_bytes(fp32_logit_bytes(64, vocab))}" in err
            and "grads.loss_chunk_tokens=256" not in err
        )


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
def test_an_impossible_index_path_is_refused_before_the_model_loads(tmp_path, saved_model, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before index.path was checked")

    monkeypatch.setattr("gradian_lightning.recipes.index.load_model_and_tokenizer", no_model)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    argv = index_args(tmp_path, saved_model, data)
    code, _, err = run(capsys, *argv[:4], "index.path=/proc/gradian-test/ix", *argv[5:])
    assert code == 2 and err.startswith(
        "gradian index: error: setting 'index.path'='/proc/gradian-test/ix' cannot be created ("
    )
    assert err.endswith("point index.path at a folder you can write")
    assert not Path("/proc/gradian-test").exists()


def long_prompt_rows(lengths):
    """Rows whose prompt is `n` words (n tokens for the test tokenizer, which adds no BOS) and whose
    completion, one word, comes after them."""
    from conftest import WORDS

    return [
        {"id": f"long{i}", "prompt": " ".join(WORDS[j % 40] for j in range(n)), "completion": " paris"}
        for i, n in enumerate(lengths)
    ]


def test_an_index_that_can_rank_nothing_is_refused_before_the_model_runs(
    tmp_path, saved_model, tokenizer, capsys, monkeypatch
):
    rows = long_prompt_rows([30, 41, 26])
    longest = max(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows)
    assert longest == 41
    data = write_jsonl(tmp_path / "train.jsonl", rows)

    def no_rows(*args, **kwargs):
        raise AssertionError("a batch ran before the data was checked")

    monkeypatch.setattr("gradian_lightning.index.session.IndexSession.compute", no_rows)
    code, _, err = run(capsys, *index_args(tmp_path, saved_model, data, "grads.max_seq_length=24"))
    assert code == 2
    assert (
        "every one of the 3 rows of data.train has zero supervised tokens within grads.max_seq_length=24: "
        f"the longest prompt is {longest} tokens" in err
    )
    assert f"set grads.max_seq_length above {longest}" in err
    assert not (tmp_path / "ix").exists()  # nothing was written


def test_a_large_share_of_rows_cut_to_nothing_is_a_warning_with_the_same_advice(tmp_path, saved_model):
    from conftest import tiny_settings

    from gradian_lightning.recipes.index import run_index

    rows = ROWS[:6] + long_prompt_rows([30, 27])  # 2 of 8 rows: 25%
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.warns(UserWarning) as caught:
        summary = run_index(tiny_settings(saved_model, data, tmp_path / "ix"))
    assert summary["empty_rows"] == [6, 7]
    said = [str(w.message) for w in caught if "zero supervised tokens" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        "2 of the 8 rows of data.train (25%) have zero supervised tokens within grads.max_seq_length=24 "
        "and can never be ranked: the longest of their prompts is 30 tokens"
    )
    assert "set grads.max_seq_length above 30" in said[0]
    # Below the share (1 of 12, 8%): the summary's count, no warning.
    few = write_jsonl(
        tmp_path / "few.jsonl",
        ROWS[:6] + [dict(r, id=f"b{i}") for i, r in enumerate(ROWS[:5])] + long_prompt_rows([30]),
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert len(run_index(tiny_settings(saved_model, few, tmp_path / "few"))["empty_rows"]) == 1
