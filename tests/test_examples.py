"""The examples run end to end (their --smoke mode: the tiny Llama, in seconds)."""

import importlib.util
import re

import numpy as np
import pytest
from smollm2 import ROOT

from gradian_lightning import open_index


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_and_attribute_smoke(tmp_path, capsys):
    example = load_example("finetune_and_attribute")
    assert example.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # One index per validation run (2 epochs), each complete, of the LoRA matrices only.
    runs = re.findall(r"indexed at step (\d+): 120 rows -> (\S+)", out)
    assert [int(step) for step, _ in runs] == [8, 16]
    for _, path in runs:
        index = open_index(path)
        names = [m.name for m in index.meta.blocks]
        assert (
            index.meta.complete
            and len(names) == 8
            and all(re.search(r"\.(q|v)_proj\.lora_[AB]\.default$", n) for n in names)
        )
    # The table: each query, then its top 3 training rows; the bundled queries paraphrase one row each.
    tops = re.findall(r"^(q-\S+) .*\n +1 [+-]\d\.\d{4}  (\S+)", out, flags=re.M)
    assert len(tops) == 6
    assert sum(query[2:] == top for query, top in tops) >= 4, tops  # the planted source ranks first for most
    assert "indexed 2 times" in out


def test_hf_trainer_and_attribute_smoke(tmp_path, capsys):
    example = load_example("hf_trainer_and_attribute")
    assert example.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # One checkpoint per save (2 epochs of 8 steps) in one index, each with the mean learning rate of
    # its epoch's steps (linear decay from 1e-2), of the LoRA matrices only.
    assert [int(s) for s in re.findall(r"indexed at step (\d+) \(lr \S+\): 120 rows", out)] == [8, 16]
    index = open_index(tmp_path / "index")
    names = [m.name for m in index.meta.blocks]
    assert index.meta.complete and [e["step"] for e in index.checkpoints] == [8, 16]
    # Step s trained at 1e-2 · (1 - (s - 1) / 16); each checkpoint's sum weight is its steps' mean.
    rate = [1e-2 * (1 - (s - 1) / 16) for s in range(1, 17)]
    assert [e["lr"] for e in index.checkpoints] == pytest.approx([np.mean(rate[:8]), np.mean(rate[8:])])
    assert len(names) == 8 and all(re.search(r"\.(q|v)_proj\.lora_[AB]\.default$", n) for n in names)
    # The table: each query, then its top 3 training rows, scores summed over both checkpoints.
    tops = re.findall(r"^(q-\S+) .*\n +1 [+-]\d\.\d{4}  (\S+)", out, flags=re.M)
    assert len(tops) == 6
    assert sum(query[2:] == top for query, top in tops) >= 4, tops  # the planted source ranks first for most
    assert "indexed 2 checkpoints" in out and re.search(r"indexing \d+\.\d s: \d+% on top of training", out)
