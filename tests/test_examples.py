"""examples/finetune_and_attribute.py runs end to end (its --smoke mode: the tiny Llama, in seconds)."""

import importlib.util
import re

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
