"""Side-by-side with EleutherAI's bergson (PyPI), on the same tiny model and data.

bergson goes into its own virtualenv, made here (never a project dependency): `python -m venv`
from the base interpreter, then `pip install torch==<this torch> bergson`, which takes the local
CPU torch wheel. bergson's dependencies pull in torchvision/torchaudio builds whose compiled ops do
not load against that torch and make `import transformers` fail; bergson itself never imports
them, so they are uninstalled again.

Settings are matched: the same random-init Llama (SmolLM2's tokenizer and vocab) saved as a
local directory, the same prompt/completion JSONL (gradian's quickstart train set), down_proj of
every layer, projection_dim 16, fp32 model and fp32 stored gradients (bergson stores gradients in
the model's dtype), loss summed over completion tokens, documents batched 32 at a time. Each run is
a fresh process tree, the tools alternate, and the ratios are gradian / bergson.

    PYTHONPATH=. python -m benchmarks.perf.peer_bergson
    PYTHONPATH=. python -m benchmarks.perf.peer_bergson --smoke --out /tmp/x      # gradian side only
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.common import (
    ROOT,
    SMOLLM2,
    bytes_on_disk,
    fmt_bytes,
    measure_command,
    tiny_llama,
    write_result,
)

VENV = Path(os.environ.get("GRADIAN_PEER_VENV", Path.home() / ".cache" / "gradian" / "bench-peer-venv"))
DATA = ROOT / "gradian_lightning" / "recipes" / "quickstart" / "train.jsonl"
BATCH = 32
# bergson's filter_modules is a comma-separated list of globs to EXCLUDE; this leaves down_proj.
BERGSON_EXCLUDE = "*q_proj,*k_proj,*v_proj,*o_proj,*gate_proj,*up_proj"


def ensure_venv(venv: Path) -> str:
    """Create the peer virtualenv with bergson if it is not there; returns bergson's version."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "bergson").is_file():
        import torch

        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}", "bergson"],
            check=True,
        )
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"], check=True)
    out = subprocess.run(
        [str(python), "-m", "pip", "show", "bergson"], capture_output=True, text=True, check=True
    ).stdout
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Version"))


def make_model_dir(where: Path, hidden: int, layers: int) -> Path:
    """A random-init Llama with SmolLM2's tokenizer, saved for `from_pretrained`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2))
    model = tiny_llama(vocab_size=len(tokenizer), hidden=hidden, layers=layers)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def gradian_command(model_dir: Path, data: Path, out: Path, config: Path) -> List[str]:
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  enable_progress_bar: false\n")
    return [
        sys.executable,
        "-m",
        "gradian_lightning.cli",
        "index",
        str(config),
        f"model.name_or_path={model_dir}",
        f"data.train={data}",
        "grads.module_filter=down_proj",
        "grads.projection_dim=16",
        "grads.storage_dtype=float32",
        f"grads.batch_size={BATCH}",
        f"index.path={out}",
        "index.overwrite=true",
    ]


def bergson_command(venv: Path, model_dir: Path, data: Path, out: Path) -> List[str]:
    return [
        str(venv / "bin" / "bergson"),
        "build",
        str(out),
        "--model",
        str(model_dir),
        "--dataset",
        str(data),
        "--prompt_column",
        "prompt",
        "--completion_column",
        "completion",
        "--projection_dim",
        "16",
        "--filter_modules",
        BERGSON_EXCLUDE,
        "--precision",
        "fp32",
        "--loss_reduction",
        "sum",
        "--max_batch_size",
        str(BATCH),
        "--token_batch_size",
        "1024",
        "--nproc_per_node",
        "1",
        "--overwrite",
        "true",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS for both tools (default 1: the machine is shared)"
    )
    parser.add_argument("--venv", default=str(VENV))
    parser.add_argument(
        "--smoke", action="store_true", help="gradian side only, 2 layers, one run: seconds (no venv is made)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": str(args.threads),
    }
    tools = ["gradian"] if args.smoke else ["gradian", "bergson"]
    version = None if args.smoke else ensure_venv(Path(args.venv))
    runs: Dict[str, List[Dict[str, Any]]] = {t: [] for t in tools}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_model_dir(tmp / "model", args.hidden, 2 if args.smoke else args.layers)
        for r in range(1 if args.smoke else args.repeats):
            for tool in tools if r % 2 == 0 else tools[::-1]:
                out = tmp / f"{tool}-{r}"
                cmd = (
                    gradian_command(model_dir, DATA, out, tmp / "gradian.yaml")
                    if tool == "gradian"
                    else bergson_command(Path(args.venv), model_dir, DATA, out)
                )
                result = measure_command(cmd, env=env, cwd=tmp)
                if result["rc"] != 0:
                    raise SystemExit(f"{tool} failed (exit {result['rc']}):\n{result['stderr']}")
                result["bytes"] = bytes_on_disk(out)
                print(
                    f"{tool} run {r}: {result['wall_s']:.1f} s, peak RSS {fmt_bytes(result['peak_rss'])}, {fmt_bytes(result['bytes'])} on disk",
                    flush=True,
                )
                runs[tool].append(result)
                shutil.rmtree(out, ignore_errors=True)
    med = {t: {k: statistics.median(x[k] for x in runs[t]) for k in ("wall_s", "peak_rss", "bytes")} for t in tools}
    rows = [[t, f"{med[t]['wall_s']:.1f}", fmt_bytes(med[t]["peak_rss"]), fmt_bytes(med[t]["bytes"])] for t in tools]
    text = (
        f"Tiny random-init Llama (hidden {args.hidden}, {2 if args.smoke else args.layers} layers, SmolLM2 tokenizer, vocab 49152), "
        f"{DATA.relative_to(ROOT)} (120 prompt/completion rows), down_proj, projection_dim 16, fp32 rows, batches of {BATCH}; "
        f"OMP_NUM_THREADS={args.threads}; medians of {len(runs[tools[0]])} alternating runs, whole process.\n"
        + (f"bergson {version} in its own virtualenv ({args.venv})." if version else "")
    )
    tables = [{"header": ["tool", "wall s", "peak RSS", "bytes on disk"], "rows": rows}]
    if "bergson" in med:
        g, b = med["gradian"], med["bergson"]
        tables.append(
            {
                "header": ["gradian / bergson", "wall time", "peak RSS", "bytes on disk"],
                "rows": [
                    [
                        "ratio",
                        f"{g['wall_s'] / b['wall_s']:.2f}",
                        f"{g['peak_rss'] / b['peak_rss']:.2f}",
                        f"{g['bytes'] / b['bytes']:.2f}",
                    ]
                ],
            }
        )
    write_result("peer_bergson", text, tables, args.out)


if __name__ == "__main__":
    main()
