"""Each benchmark script runs end to end at tiny size (`--smoke`) and writes its Markdown table.

These check that the scripts keep working, not their figures: timings here are meaningless.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from smollm2 import smollm2_dir

pytestmark = pytest.mark.slow  # every benchmark script end to end on small inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "capture_overhead": "| tiny | index down_proj |",
    "loss_memory": "| 2 | 32 | 25% |",
    "fidelity": "| 16 | float16 |",
    "index_size": "| all Linear |",
    "query_throughput": "| 8 |",
    "peer_bergson": "| gradian |",
    "loss_chunking": "| 2 | 32 | 8 |",
}
FIGURES = {"capture_overhead", "loss_chunking", "fidelity", "query_throughput"}  # these also draw a PNG


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_benchmark_smoke(name, tmp_path):
    if name in ("fidelity", "index_size", "peer_bergson"):
        smollm2_dir()  # these use SmolLM2's tokenizer even at tiny size
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / f"{name}.md").read_text()
    assert text.startswith("Command: `PYTHONPATH=. python -m benchmarks.") and "Machine:" in text
    assert SCRIPTS[name] in text, text
    if name in FIGURES:
        assert (tmp_path / f"{name}.png").read_bytes().startswith(b"\x89PNG")
