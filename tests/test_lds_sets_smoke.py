"""benchmarks/studies/lds_sets end to end at tiny size (`--smoke`): each kind's rows, models,
indexes, retrained subsets and scorers; a rerun resumes from the kept training runs.

These check that the pipeline works and what the sets are built to be, not the figures."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from smollm2 import smollm2_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run_kind(kind, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "benchmarks.studies.lds_sets.run", kind, "--smoke"]
    command += ["--work", str(tmp_path / "work"), "--results", str(tmp_path / "results")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(next((tmp_path / "results").glob(f"{kind}-*-smoke.json")).read_text())


@pytest.mark.parametrize("kind", ["facts", "shared", "format"])
def test_a_tiny_set_runs_end_to_end(kind, tmp_path):
    printed, result = run_kind(kind, tmp_path)
    assert result["num_subsets"] == 5 and result["repeats"] == 2
    assert "| query.* settings | projected k16-float16 (1 seeds) |" in printed and "| BM25 | words |" in printed
    exact = result["indexes"]["exact"]["scorers"]
    assert [s["name"] for s in exact][:3] == [
        "precondition=none, score=inner",
        "precondition=none, normalize=row",
        "precondition=none, normalize=module",
    ]
    assert all(np.isfinite(s["centred_lds"]) and 0 <= s["mrr"] <= 1 for s in exact)
    queries = [json.loads(line) for line in (tmp_path / "work" / "queries.jsonl").read_text().splitlines()]
    train = (tmp_path / "work" / "train.jsonl").read_text()
    words = lambda text: set(re.findall(r"[a-z]+", text.lower()))  # noqa: E731
    if kind == "format":  # a query shares no word with any training row, so BM25 has nothing to rank by
        assert all(not (words(q["prompt"] + q["completion"]) & words(train)) for q in queries)
        assert np.isnan(result["bm25"]["lds"])
    if kind == "shared":  # every query ends in the sign-off, half the training rows do
        assert all("keeper of the old records" in q["completion"] for q in queries)
        assert train.count("keeper of the old records") == len(train.splitlines()) // 2
    if kind == "facts":  # a rerun trains nothing again and gives the same figures
        kept = {p: p.stat().st_mtime_ns for p in (tmp_path / "work" / "runs" / "subsets").glob("*.json")}
        assert len(kept) == 10  # 5 subsets × 2 repeats
        again = run_kind(kind, tmp_path)[1]
        assert {p: p.stat().st_mtime_ns for p in kept} == kept
        assert again["indexes"] == result["indexes"]


def test_the_smollm2_set_runs_end_to_end(tmp_path):
    smollm2_dir()
    printed, result = run_kind("smollm2", tmp_path)
    assert result["spec"]["exact_filter"] == ["*.layers.2[89].mlp.*"]
    assert all(np.isfinite(s["lds"]) for s in result["indexes"]["exact"]["scorers"])
