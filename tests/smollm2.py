"""The real SmolLM2-135M-Instruct, built offline by ../shared/models/make-smollm2.sh and cached."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILDER = ROOT.parent / "shared" / "models" / "make-smollm2.sh"
CACHE = Path(os.environ.get("GRADIAN_SMOLLM2", Path.home() / ".cache" / "gradian" / "smollm2-135m-instruct"))


def smollm2_dir() -> Path:
    """The model directory, built on first use; skips the test with the reason when it cannot be."""
    if (CACHE / "model.safetensors").is_file() and (CACHE / "tokenizer.json").is_file():
        return CACHE
    if not BUILDER.is_file() or shutil.which("bash") is None:
        pytest.skip(f"SmolLM2 builder {BUILDER} is not available")
    done = subprocess.run(
        ["bash", str(BUILDER), str(CACHE)], capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}
    )
    if done.returncode != 0:
        pytest.skip(
            f"SmolLM2 builder failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
        )
    return CACHE
