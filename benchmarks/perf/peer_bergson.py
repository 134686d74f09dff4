"""Side-by-side with EleutherAI's bergson (PyPI), on the same model, rows, modules and stored width.

bergson goes into its own virtualenv, made here (never a project dependency): `python -m venv`
from the base interpreter, then `pip install torch==<this torch> bergson==2.5.1`, which takes the
local CPU torch wheel. bergson's dependencies pull in torchvision/torchaudio builds whose compiled
ops do not load against that torch and make `import transformers` fail; bergson itself never
imports them, so they are uninstalled again.

Both tools run as their CLIs (`gradian index`, `bergson build`), each run a fresh process tree,
the tools alternating, with the same OMP_NUM_THREADS; the ratios are gradian / bergson of the
medians. Settings are matched:

- rows: the first 8 and all 120 rows of the quickstart train set (two sizes, so that the cost of
  each further batch shows apart from the fixed cost of a run), rewritten as one-turn chats
  (`messages`: the prompt as the user turn, the completion as the assistant's). bergson renders prompt/completion rows through
  the tokenizer's chat template and gradian does not, so on the same prompt/completion file bergson
  would run 3× the tokens (48 against 16 on SmolLM2's template, which adds a system prompt); as
  chats both render the same template and run the same tokens, supervising the assistant turn;
- the model in float32 on the CPU, loss summed over the supervised tokens (bergson's
  `--loss_reduction sum`), the same documents per batch (bergson's `--max_batch_size`, with a token
  budget that never splits it further);
- `--model smollm2` (the default): SmolLM2-135M-Instruct at today's gradian defaults, every
  layer's MLP (gate, up, down: 90 modules), k = 32, int8 rows, batches of 4; bergson on the same
  90 modules (its `--filter_modules` excludes the attention projections and the head) at
  `--projection_dim 32`, which projects each module's gradient on both sides to 32 × 32, the same
  1,024 numbers a module as gradian's Kronecker projection; bergson stores them in the model's
  dtype (float32, 4 bytes a number: it has no storage dtype of its own), gradian as int8 plus one
  float32 scale per module block;
- `--model tiny`: the earlier comparison's random-init Llama (hidden 128, 4 layers, SmolLM2's
  tokenizer), down_proj, k = 16, float32 rows on both sides, batches of 32.

After each tool's first run the script checks what it stored: the same module names, k² numbers
a module, one row per input row; the table gives each side's stored bytes a row.

    PYTHONPATH=. python -m benchmarks.perf.peer_bergson                  # SmolLM2, 8 and 120 rows, 3 runs each
    PYTHONPATH=. python -m benchmarks.perf.peer_bergson --model tiny
    PYTHONPATH=. python -m benchmarks.perf.peer_bergson --smoke --out /tmp/x      # gradian side only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

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
BERGSON_VERSION = "2.5.1"  # pinned: the figures name the version they measured


@dataclass(frozen=True)
class Setting:
    """One side-by-side: gradian's `grads.*` and the bergson flags that store the same numbers."""

    caption: str
    module_filter: str  # gradian's grads.module_filter
    bergson_exclude: str  # bergson's --filter_modules: comma-separated globs to EXCLUDE
    projection_dim: int  # k: both store k × k numbers a module
    storage_dtype: str  # gradian's grads.storage_dtype (bergson stores the model's dtype, float32)
    batch: int  # documents per batch, both tools
    token_batch: int  # bergson's --token_batch_size: at most the model's context, above batch × longest row


SETTINGS = {
    "smollm2": Setting(
        "SmolLM2-135M-Instruct (float32), every layer's MLP (gate_proj, up_proj, down_proj: 90 modules), k = 32, "
        "gradian int8 rows (today's defaults: grads.module_filter=mlp, projection_dim=32, storage_dtype=int8), "
        "batches of 4 (gradian's default grads.batch_size)",
        module_filter="mlp",
        bergson_exclude="*self_attn*,lm_head",
        projection_dim=32,
        storage_dtype="int8",
        batch=4,
        token_batch=2048,
    ),
    "tiny": Setting(
        "Tiny random-init Llama (hidden {hidden}, {layers} layers, SmolLM2 tokenizer, vocab 49152), down_proj, k = 16, "
        "float32 rows on both sides, batches of 32",
        module_filter="down_proj",
        bergson_exclude="*self_attn*,*gate_proj,*up_proj,lm_head",
        projection_dim=16,
        storage_dtype="float32",
        batch=32,
        token_batch=1024,  # bergson refuses a token budget above the model's context (1,024 here)
    ),
}


def ensure_venv(venv: Path) -> str:
    """Create the peer virtualenv with bergson if it is not there; returns bergson's version."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "bergson").is_file():
        import torch

        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", torch_pin, f"bergson=={BERGSON_VERSION}"], check=True
        )
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"], check=True)
    out = subprocess.run(
        [str(python), "-m", "pip", "show", "bergson"], capture_output=True, text=True, check=True
    ).stdout
    version = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Version"))
    if version != BERGSON_VERSION:
        raise SystemExit(
            f"peer_bergson: error: {venv} holds bergson {version}, not {BERGSON_VERSION}; delete that folder (it is remade) or set GRADIAN_PEER_VENV to another"
        )
    return version


def make_tiny_model_dir(where: Path, hidden: int, layers: int) -> Path:
    """A random-init Llama with SmolLM2's tokenizer (and chat template), saved for `from_pretrained`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2))
    model = tiny_llama(vocab_size=len(tokenizer), hidden=hidden, layers=layers)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def write_chat_rows(source: Path, out: Path, rows: int) -> int:
    """Rewrite the first `rows` prompt/completion JSONL rows of `source` as one-turn chats (`messages`:
    user = prompt, assistant = completion), keeping each row's id; returns the number written."""
    lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()][:rows]
    with out.open("w") as f:
        for row in lines:
            turns = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
            f.write(json.dumps({"id": row["id"], "messages": turns}) + "\n")
    return len(lines)


def gradian_command(model_dir: Path, data: Path, out: Path, config: Path, setting: Setting) -> List[str]:
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  enable_progress_bar: false\n")
    return [
        sys.executable,
        "-m",
        "gradian_lightning.cli",
        "index",
        str(config),
        f"model.name_or_path={model_dir}",
        "model.dtype=float32",
        f"data.train={data}",
        f"grads.module_filter={setting.module_filter}",
        f"grads.projection_dim={setting.projection_dim}",
        f"grads.storage_dtype={setting.storage_dtype}",
        f"grads.batch_size={setting.batch}",
        f"index.path={out}",
        "index.overwrite=true",
    ]


def bergson_command(venv: Path, model_dir: Path, data: Path, out: Path, setting: Setting) -> List[str]:
    return [
        str(venv / "bin" / "bergson"),
        "build",
        str(out),
        "--model",
        str(model_dir),
        "--dataset",
        str(data),
        "--conversation_column",
        "messages",
        "--projection_dim",
        str(setting.projection_dim),
        "--filter_modules",
        setting.bergson_exclude,
        "--precision",
        "fp32",
        "--loss_reduction",
        "sum",
        "--max_batch_size",
        str(setting.batch),
        "--token_batch_size",
        str(setting.token_batch),
        "--nproc_per_node",
        "1",
        "--overwrite",
        "true",
    ]


def gradian_stored(out: Path) -> Dict[str, Any]:
    """What a gradian index holds: {modules: {name: numbers}, rows, dtype, row_bytes}; row_bytes is
    the bytes a row of the gradient arrays (`grads` values plus int8's per-module `scales`)."""
    import numpy as np

    from gradian_lightning.index.reader import IndexReader

    reader = IndexReader(out)
    rows, width = reader.grads.shape
    scales = len(reader.module_blocks) * 4 if reader.storage_dtype == "int8" else 0  # one float32 a module block
    return {
        "modules": {b.name: int(np.prod(b.shape)) for b in reader.module_blocks},
        "rows": int(rows),
        "dtype": reader.storage_dtype,
        "row_bytes": int(width * np.dtype(reader.storage_dtype).itemsize + scales),
    }


def bergson_stored(out: Path) -> Dict[str, Any]:
    """What a bergson index holds, from its info.json and gradients.bin (same keys as `gradian_stored`)."""
    info = json.loads((out / "info.json").read_text())
    rows = int(info["num_grads"])
    return {
        "modules": {name: int(n) for name, n in info["grad_sizes"].items()},
        "rows": rows,
        "dtype": info["base_dtype"],
        "row_bytes": (out / "gradients.bin").stat().st_size // rows,
    }


def check_same_numbers(gradian: Dict[str, Any], bergson: Dict[str, Any], rows: int, k: int) -> None:
    """Both indexes hold `rows` rows of the same modules, k² numbers each (bergson names modules
    from inside the base model, without gradian's leading `model.`)."""
    names = {name.removeprefix("model."): n for name, n in gradian["modules"].items()}
    problems = []
    if set(names) != set(bergson["modules"]):
        problems.append(
            f"modules differ: gradian only {sorted(set(names) - set(bergson['modules']))[:4]}, bergson only {sorted(set(bergson['modules']) - set(names))[:4]}"
        )
    if {n for n in names.values()} | {n for n in bergson["modules"].values()} != {k * k}:
        problems.append(f"numbers a module are not all {k * k}")
    if gradian["rows"] != rows or bergson["rows"] != rows:
        problems.append(f"rows: gradian {gradian['rows']}, bergson {bergson['rows']}, input {rows}")
    if problems:
        raise SystemExit("peer_bergson: error: the two indexes do not hold the same numbers: " + "; ".join(problems))


def run_side_by_side(args: argparse.Namespace, setting: Setting, env: Dict[str, str], tmp: Path) -> Dict[str, Any]:
    """Alternating fresh-process runs of each tool at each row count; returns {runs: {"tool@rows":
    [measure]}, stored: {tool: what its first run at the most rows stored}, rows: [row counts]}."""
    tools = ["gradian"] if args.smoke else ["gradian", "bergson"]
    if args.model == "smollm2" and not args.smoke:
        if not (SMOLLM2 / "model.safetensors").is_file():
            raise SystemExit(
                f"peer_bergson: error: SmolLM2 not found at {SMOLLM2}; save HuggingFaceTB/SmolLM2-135M-Instruct (model and tokenizer, save_pretrained) there, or set GRADIAN_SMOLLM2 to a folder holding it"
            )
        model_dir = SMOLLM2
    else:
        model_dir = make_tiny_model_dir(tmp / "model", args.hidden, args.layers)
    data = {n: tmp / f"chats-{n}.jsonl" for n in args.rows}
    counts = [write_chat_rows(DATA, data[n], n) for n in args.rows]
    if counts != list(args.rows):
        raise SystemExit(f"peer_bergson: error: --rows {args.rows}: {DATA.name} has only {max(counts)} rows")
    runs: Dict[str, List[Dict[str, Any]]] = {f"{t}@{n}": [] for t in tools for n in args.rows}
    stored: Dict[str, Dict[str, Any]] = {}
    for r in range(args.repeats):
        for n in args.rows:
            for tool in tools if r % 2 == 0 else tools[::-1]:
                out = tmp / f"{tool}-{n}-{r}"
                cmd = (
                    gradian_command(model_dir, data[n], out, tmp / "gradian.yaml", setting)
                    if tool == "gradian"
                    else bergson_command(Path(args.venv), model_dir, data[n], out, setting)
                )
                result = measure_command(cmd, env=env, cwd=tmp)
                if result["rc"] != 0:
                    raise SystemExit(f"{tool} failed (exit {result['rc']}):\n{result['stderr']}")
                result["bytes"] = bytes_on_disk(out)
                if n == max(args.rows) and tool not in stored:
                    stored[tool] = (gradian_stored if tool == "gradian" else bergson_stored)(out)
                print(
                    f"{tool}, {n} rows, run {r}: {result['wall_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU, peak RSS {fmt_bytes(result['peak_rss'])}, {fmt_bytes(result['bytes'])} on disk",
                    flush=True,
                )
                runs[f"{tool}@{n}"].append({k: result[k] for k in KEYS})
                shutil.rmtree(out, ignore_errors=True)
    if "bergson" in stored:
        check_same_numbers(stored["gradian"], stored["bergson"], max(args.rows), setting.projection_dim)
    for held in stored.values():  # checked: keep the count, not the names
        held["modules"] = len(held["modules"])
    return {"runs": runs, "stored": stored, "rows": list(args.rows), "tools": tools}


KEYS = ("wall_s", "cpu_s", "peak_rss", "bytes")


def medians(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, float]]:
    """{"tool@rows": {measure: median over the repeats}}."""
    return {key: {k: statistics.median(x[k] for x in runs[key]) for k in KEYS} for key in runs}


def tables(measured: Dict[str, Any], batch: int) -> List[Dict[str, Any]]:
    """Per tool and row count the medians; with both tools, the gradian / bergson ratios at each row
    count; with two row counts, what each further batch of `batch` rows cost (the difference of the
    medians over the difference in batches), which leaves out the fixed cost of a run."""
    med, stored, rows, tools = medians(measured["runs"]), measured["stored"], measured["rows"], measured["tools"]
    header = [
        "tool",
        "rows",
        "wall s",
        "CPU s",
        "peak RSS",
        "stored gradients: dtype, bytes a row",
        "whole index on disk",
    ]
    out = [
        {
            "header": header,
            "rows": [
                [
                    t,
                    n,
                    f"{med[f'{t}@{n}']['wall_s']:.1f}",
                    f"{med[f'{t}@{n}']['cpu_s']:.1f}",
                    fmt_bytes(med[f"{t}@{n}"]["peak_rss"]),
                    f"{stored[t]['dtype']}, {stored[t]['row_bytes']:,}",
                    fmt_bytes(med[f"{t}@{n}"]["bytes"]),
                ]
                for n in rows
                for t in tools
            ],
        }
    ]
    if "bergson" not in tools:
        return out
    row_ratio = f"{stored['gradian']['row_bytes'] / stored['bergson']['row_bytes']:.2f}"
    ratios = []
    for n in rows:
        g, b = med[f"gradian@{n}"], med[f"bergson@{n}"]
        ratios.append([n, *(f"{g[k] / b[k]:.2f}" for k in KEYS[:3]), row_ratio, f"{g['bytes'] / b['bytes']:.2f}"])
    out.append(
        {
            "header": ["gradian / bergson at rows", "wall time", "CPU time", "peak RSS", "bytes a row", "whole index"],
            "rows": ratios,
        }
    )
    if len(rows) == 2:
        lo, hi = rows
        batches = -(-hi // batch) - -(-lo // batch)
        each = {
            t: {k: (med[f"{t}@{hi}"][k] - med[f"{t}@{lo}"][k]) / batches for k in ("wall_s", "cpu_s")} for t in tools
        }
        out.append(
            {
                "title": f"Each further batch of {batch} rows, from the {lo}-row to the {hi}-row runs ({batches} batches):",
                "header": ["", "wall s a batch", "CPU s a batch"],
                "rows": [
                    *([t, f"{each[t]['wall_s']:.2f}", f"{each[t]['cpu_s']:.2f}"] for t in tools),
                    [
                        "gradian / bergson",
                        f"{each['gradian']['wall_s'] / each['bergson']['wall_s']:.2f}",
                        f"{each['gradian']['cpu_s'] / each['bergson']['cpu_s']:.2f}",
                    ],
                ],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SETTINGS), default="smollm2")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tool, alternating (medians)")
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[8, 120],
        help="the first N rows of the quickstart train set, one or two counts (default 8 120: two counts also give each further batch's cost)",
    )
    parser.add_argument("--hidden", type=int, default=128, help="--model tiny only")
    parser.add_argument("--layers", type=int, default=4, help="--model tiny only")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS for both tools (default 1: the machine is shared)"
    )
    parser.add_argument("--venv", default=str(VENV))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="gradian side only, the tiny model with 2 layers, one run: seconds (no venv is made)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.layers, args.repeats, args.rows = "tiny", 2, 1, [16]
    if not 1 <= len(args.rows) <= 2 or sorted(set(args.rows)) != args.rows:
        raise SystemExit(f"peer_bergson: error: --rows {args.rows}: give one or two increasing row counts")
    setting = SETTINGS[args.model]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": str(args.threads),
    }
    version: Optional[str] = None if args.smoke else ensure_venv(Path(args.venv))
    with tempfile.TemporaryDirectory() as tmp:
        measured = run_side_by_side(args, setting, env, Path(tmp))
    text = (
        setting.caption.format(hidden=args.hidden, layers=args.layers)
        + f"; the first {' and '.join(map(str, measured['rows']))} rows of {DATA.relative_to(ROOT)} as one-turn chats, the same tokens through the same chat template on both sides; "
        f"float32 model on the CPU, loss summed over the assistant turn's tokens; OMP_NUM_THREADS={args.threads}; "
        f"medians of {args.repeats} alternating fresh-process runs a tool, whole process (CPU: user + system of the process tree; peak RSS: its largest process)."
        + (
            f"\nbergson {version} in its own virtualenv; both stored the same modules and k² = {setting.projection_dim**2:,} numbers a module (checked)."
            if version
            else ""
        )
    )
    name = "peer_bergson" if args.model == "tiny" else f"peer_bergson.{args.model}"
    write_result(
        name,
        text,
        tables(measured, setting.batch),
        args.out,
        bergson=version,
        runs=measured["runs"],
        stored=measured["stored"],
    )


if __name__ == "__main__":
    main()
