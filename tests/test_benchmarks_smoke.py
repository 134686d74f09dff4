"""Each benchmark script runs end to end at tiny size (`--smoke`) and writes its JSON result.

These check that the scripts keep working, not their figures: timings here are meaningless.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from smollm2 import smollm2_dir

from benchmarks.common import render_result

pytestmark = pytest.mark.slow  # every benchmark script end to end on small inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {  # module -> a row its smoke table must hold
    "perf.capture_overhead": "| tiny | index down_proj |",
    "perf.loss_memory": "| 2 | 32 | 25% |",
    "perf.loss_chunking": "| 2 | 32 | 8 |",
    "perf.query_throughput": "| 8 |",
    "perf.ann_search": "| clustered | 3,000 | 8 | ann |",
    "perf.report_cost": "| tiny | 12 | 2 |",
    "perf.index_size": "| all Linear |",
    "perf.dask_engine": "| dask (dask_topk) |",
    "perf.data_memory": "| 2,000 |",
    "perf.startup": "| missing data file |",
    "perf.index_memory": "| first batch |",
    "perf.exact_pass": "| capture (GradientRows, k = 32) |",
    "perf.peer_bergson": "| gradian |",
    "perf.peer_kronfluence": "| exact |",
    "studies.fidelity": "| 16 | float16 |",
    "studies.lds": "| fact, fine-tuned, base+ft | k = 16, defaults (auto) |",
}
STUDY_FILES = {
    "perf.peer_kronfluence": "peer_kronfluence.fact.json",
    "studies.lds": "seeds.fact.json",
    "perf.ann_search": "ann_search.clustered.json",  # one result file per --data
}
NEEDS_SMOLLM2_TOKENIZER = {"perf.index_memory", "perf.index_size", "perf.peer_bergson", "studies.fidelity"}


def run_smoke(module: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.parametrize("module", sorted(SCRIPTS))
def test_benchmark_smoke(module, tmp_path):
    if module in NEEDS_SMOLLM2_TOKENIZER:
        smollm2_dir()
    done = run_smoke(module, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    if module in STUDY_FILES:  # LDS studies: their own result shape, rendered by their report()
        assert json.loads((tmp_path / STUDY_FILES[module]).read_text())
        assert SCRIPTS[module] in done.stdout, done.stdout[-3000:]
        return
    result = json.loads((tmp_path / f"{module.split('.')[-1]}.json").read_text())
    text = render_result(result)
    assert text.startswith(f"Command: `PYTHONPATH=. python -m benchmarks.{module} --smoke") and "Machine:" in text
    assert SCRIPTS[module] in text, text
    if module == "perf.capture_overhead":
        assert (tmp_path / "capture_overhead.png").read_bytes().startswith(b"\x89PNG")


def test_ann_search_measures_an_existing_index_with_real_query_rows(tmp_path, saved_model):
    """ann_search's --index mode: an index built by `gradian index` and queries made by the model,
    exact scan and ANN at two settings; 40 rows of k = 4 (96 wide), so every row is a candidate at 100 and recall is 1."""
    from conftest import WORDS, tiny_settings, write_jsonl

    from gradian_lightning.recipes.index import run_index

    rows = [
        {"id": f"r{i}", "prompt": f"what is {WORDS[i]} ?", "completion": f" {WORDS[i + 1]} {WORDS[(3 * i) % 50]} ."}
        for i in range(40)
    ]
    train, asked = write_jsonl(tmp_path / "train.jsonl", rows), write_jsonl(tmp_path / "q.jsonl", rows[5:9])
    run_index(tiny_settings(saved_model, train, tmp_path / "ix"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    args = ["--index", tmp_path / "ix", "--query-data", asked, "--model", saved_model, "--settings", "8:100,1:2"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.perf.ann_search", "--smoke", "--out", tmp_path, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "ann_search.real.json").read_text())
    assert result["settings"] == [[8, 100], [1, 2]] and result["recall_at_10"][0] == 1.0
    assert result["recall_at_10"][1] < 1  # one list probed, 2 candidates: the settings reach the search
    text = render_result(result)
    assert "| real | 40 | 4 | ann | 8 / 100 |" in text and "40 × 96 int8 rows of a real model's gradients" in text, text


def test_ann_facts_rows_are_distinct_held_out_and_in_the_vocabulary(tmp_path):
    from benchmarks.perf.ann_facts import fact_pairs, known_names
    from gradian_lightning.recipes.quickstart.make_data import ATTRIBUTES

    vocab = {w: i for i, w in enumerate(["<unk>", "What", "The", "Ana", "Bo", "Cy", "Di"])}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    names = known_names(tmp_path)
    assert names == ["Ana", "Bo", "Cy", "Di"]
    train, asked = fact_pairs(names, 60, 8, seed=0)  # of 4 · 3 · 2 · 3 · 3 = 216 possible rows
    texts = [(r["prompt"], r["completion"]) for r in train + asked]
    assert len(set(texts)) == 68 and len({r["id"] for r in train + asked}) == 68
    spoken = {w for p, c in texts for w in (p + c).split() if w[:1].isupper()} - {"What", "Where", "Which", "In", "The"}
    assert spoken <= set(names)
    stated = {}  # one world: every row that states a person's attribute states the same value
    for _, completion in texts:
        for sentence in completion.strip(" .").split(" . "):
            (name,) = [w for w in sentence.split() if w in names]
            for attribute, (values, *_) in ATTRIBUTES.items():
                for value in set(sentence.split()) & set(values):
                    stated.setdefault((name, attribute), set()).add(value)
    assert len(stated) > 4 and all(len(v) == 1 for v in stated.values())
    with pytest.raises(SystemExit, match="at most 108"):
        fact_pairs(names, 100, 9, seed=0)
