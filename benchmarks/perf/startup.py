"""Start-up to the first check: how long `gradian` takes to report a mistake, per kind of mistake.

Each case is one fresh `python -m gradian_lightning.cli ...` process (run through `runpy` so that it
can say, at exit, whether torch was imported); the cases are interleaved `--repeats` times, the
order rotated every repeat, and the medians of wall time and CPU time (user + system, the
process's own, from `getrusage` of the reaped child) reported. Settings and file mistakes are checked before torch,
Lightning, transformers, datasets or zarr import (cli.check_before_torch); the last case, a
`grads.module_filter` that matches no module of a tiny saved Llama, can only be found with the
model loaded and is there to show what the start-up costs when everything imports.

    PYTHONPATH=. python -m benchmarks.perf.startup
    PYTHONPATH=. python -m benchmarks.perf.startup --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

from benchmarks.common import ROOT, write_result

# Runs the CLI as `python -m gradian_lightning.cli` does, then prints (last line, stdout) whether torch was imported.
_CHILD = (
    "import json, runpy, sys\n"
    "sys.argv = ['gradian', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('gradian_lightning.cli', run_name='__main__')\n"
    "except SystemExit as stop:\n"
    "    code = stop.code\n"
    "print(json.dumps({'rc': code, 'torch': 'torch' in sys.modules}))\n"
)
TARGET_S = 1.0  # issue 42: settings and file errors reported in under a second


def cases(folder: Path) -> Dict[str, List[str]]:
    """Each mistake -> its `gradian` arguments (run in `folder`, which holds rows.jsonl and model/)."""
    return {
        "a setting's value (grads.projection_dim=-3)": ["index", "model.name_or_path=model", "grads.projection_dim=-3"],
        "missing data file": ["index", "model.name_or_path=model", "data.train=missing.jsonl"],
        "missing model folder": ["index", "model.name_or_path=./nomodel", "data.train=rows.jsonl"],
        "data file as the model": ["index", "model.name_or_path=rows.jsonl", "data.train=rows.jsonl"],
        "index.path is a file": ["index", "model.name_or_path=model", "data.train=rows.jsonl", "index.path=rows.jsonl"],
        "query: nothing at index.path": [
            "query",
            "model.name_or_path=model",
            "query.data=rows.jsonl",
            "index.path=nothere",
        ],
        "needs the model (module_filter matches nothing)": [
            "index",
            "model.name_or_path=model",
            "data.train=rows.jsonl",
            "grads.module_filter=nothing_like_this",
            "trainer.accelerator=cpu",
        ],
    }


def run_once(args: Sequence[str], cwd: Path) -> Dict[str, float]:
    """One fresh process: wall seconds, CPU seconds (user + system), exit code, whether torch was imported."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # the reaped children's CPU, summed
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    said = json.loads(done.stdout.strip().splitlines()[-1])
    err = done.stderr
    return {
        "wall_s": wall,
        "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "rc": said["rc"],
        "torch": said["torch"],
        "error": err.strip().splitlines()[-1] if err.strip() else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one repeat: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.repeats = 1

    from benchmarks.common import tiny_llama
    from gradian_lightning.recipes.quickstart import word_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = [{"id": f"r{i}", "prompt": f"what is {i} ?", "completion": f" {i} is a number ."} for i in range(8)]
        (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tokenizer = word_tokenizer(json.dumps(r) for r in rows)
        tiny_llama(len(tokenizer), hidden=32, layers=2).save_pretrained(folder / "model")
        tokenizer.save_pretrained(folder / "model")
        runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in cases(folder)}
        names = list(runs)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                runs[name].append(run_once(cases(folder)[name], folder))
    table_rows = []
    for name, measured in runs.items():
        wall = statistics.median(m["wall_s"] for m in measured)
        cpu = statistics.median(m["cpu_s"] for m in measured)
        torch_imported = "yes" if any(m["torch"] for m in measured) else "no"
        codes = sorted({m["rc"] for m in measured})
        table_rows.append(
            [name, f"`gradian {' '.join(cases(Path('.'))[name])}`", f"{wall:.2f}", f"{cpu:.2f}", torch_imported, codes]
        )
    before_torch = [m for name, ms in runs.items() if "needs the model" not in name for m in ms]
    worst_wall = max(statistics.median(m["wall_s"] for m in runs[n]) for n in names if "needs the model" not in n)
    text = (
        f"One fresh process per case and run, {args.repeats} interleaved run(s) each, medians; in a folder holding "
        "rows.jsonl (8 rows) and model/ (a tiny saved Llama). CPU is the process's own user + system time. "
        f"Target: settings and file errors under {TARGET_S:.0f} s. Slowest median wall time of those: {worst_wall:.2f} s; "
        f"torch imported by any of them: {'yes' if any(m['torch'] for m in before_torch) else 'no'}."
    )
    header = ["mistake", "command", "wall s", "CPU s", "torch imported", "exit"]
    write_result("startup", text, [{"header": header, "rows": table_rows}], args.out, runs=runs)


if __name__ == "__main__":
    main()
