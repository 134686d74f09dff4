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
    "perf.ann_search": "| clustered | 3,000 | ann |",
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
