"""Where the peak RSS of a small `gradian index` goes, stage by stage, against the plain process (issue 42, item 7).

A fresh process runs `gradian index` (the CLI's own `main`, at its defaults) on the first `--rows`
quickstart train rows, with probes wrapped around the recipe's steps that read, at each stage, the
process's RSS (VmRSS), its peak so far (VmHWM) and glibc's live heap (`mallinfo2`: bytes allocated
and not yet freed, mapped chunks included):
  - imports:       gradian, torch, Lightning and transformers imported, nothing read;
  - data opened:   `open_rows` done (a `.jsonl` file read by gradian, any other by `datasets`; the checks);
  - model loaded:  `from_pretrained` done (safetensors weights are memory-mapped: not yet read);
  - first batch:   before the first `IndexSession.compute` (the weights read, in part, by the digest);
  - batch N:       after each batch's rows are computed and written;
  - closed:        after `IndexWriter.close` (row statistics written).
The plain forward+backward process of `capture_overhead --cli` over the same rows gives the peak
every stage is compared with (`share of plain`), and the live heap shows how much of RSS the
allocator holds without a live tensor in it (freed chunks glibc keeps in its heap).

    PYTHONPATH=. python -m benchmarks.perf.index_memory
    PYTHONPATH=. python -m benchmarks.perf.index_memory --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.common import ROOT, SMOLLM2, measure_command, write_result

STAGES_FILE = "GRADIAN_INDEX_MEMORY_STAGES"  # environment variable: where the child writes its stages


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _live_heap() -> int:
    """Bytes glibc's malloc has handed out and not had back (arena chunks in use + mapped chunks); -1 elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return -1
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in /proc/self/status")


def child() -> None:
    """Run `gradian index` with the arguments after `--child`, probing each stage (module docstring)."""
    stages: List[Dict[str, Any]] = []

    def probe(stage: str) -> None:
        stages.append({"stage": stage, "rss": _status("VmRSS"), "peak": _status("VmHWM"), "live_heap": _live_heap()})

    from gradian_lightning import cli
    from gradian_lightning.index import session, writer
    from gradian_lightning.recipes import index as recipe

    probe("imports")

    def wrapped(owner: Any, name: str, before: Any = None, after: Any = None) -> None:
        original = getattr(owner, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            if before:
                before()
            result = original(*args, **kwargs)
            if after:
                after()
            return result

        setattr(owner, name, run)

    batches = itertools.count(1)

    def before_compute() -> None:
        if stages[-1]["stage"] == "model loaded":  # the first batch: nothing probed since the load
            probe("first batch")

    wrapped(recipe, "open_rows", after=lambda: probe("data opened"))
    wrapped(recipe, "load_model_and_tokenizer", after=lambda: probe("model loaded"))
    wrapped(session.IndexSession, "compute", before=before_compute)
    wrapped(session.IndexSession, "write", after=lambda: probe(f"batch {next(batches)}"))
    wrapped(writer.IndexWriter, "close", after=lambda: probe("closed"))
    sys.argv = ["gradian", *sys.argv[sys.argv.index("--child") + 1 :]]
    code = cli.main()
    Path(os.environ[STAGES_FILE]).write_text(json.dumps({"rc": code, "stages": stages}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SMOLLM2), help="a local model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", type=int, default=64, help="quickstart train rows")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both processes")
    parser.add_argument("--set", nargs="*", default=[], help="more `gradian index` settings, e.g. grads.recompute=none")
    parser.add_argument("--tag", default=None, help="results/index_memory.TAG.json instead of index_memory.json")
    parser.add_argument("--smoke", action="store_true", help="4 rows in batches of 2: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.batch_size = 4, 2

    from gradian_lightning.recipes.quickstart import __file__ as quickstart

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        lines = (Path(quickstart).parent / "train.jsonl").read_text().splitlines()[: args.rows]
        data.write_text("\n".join(lines) + "\n")
        plain_cmd = [sys.executable, "-m", "benchmarks.perf.capture_overhead", "--child", "--model", "smollm2"]
        plain_cmd += ["--data", str(data), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
        plain_cmd += ["--threads", str(args.threads)]
        plain = measure_command(plain_cmd, env={**env, "GRADIAN_SMOLLM2": args.model}, cwd=ROOT)
        if plain["rc"] != 0:
            raise SystemExit(f"the plain process failed:\n{plain['stderr']}")
        stages_file = Path(tmp) / "stages.json"
        index_cmd = [sys.executable, "-m", "benchmarks.perf.index_memory", "--child", "index"]
        index_cmd += [f"model.name_or_path={args.model}", f"data.train={data}", f"index.path={Path(tmp) / 'index'}"]
        index_cmd += [f"grads.batch_size={args.batch_size}", f"grads.max_seq_length={args.seq_len}", *args.set]
        indexed = measure_command(index_cmd, env={**env, STAGES_FILE: str(stages_file)}, cwd=ROOT)
        if indexed["rc"] != 0 or not stages_file.is_file():
            raise SystemExit(f"gradian index failed (exit {indexed['rc']}):\n{indexed['stderr']}")
        stages = json.loads(stages_file.read_text())["stages"]

    def mib(n: int) -> str:
        return f"{n / 2**20:,.0f} MiB"

    def share(n: int) -> str:
        return f"{n / plain['peak_rss']:.2f}"

    rows = [["plain forward+backward process (its peak)", "", mib(plain["peak_rss"]), "", "1.00"]]
    for s in stages:
        heap = mib(s["live_heap"]) if s["live_heap"] >= 0 else "n/a"
        rows.append([s["stage"], mib(s["rss"]), mib(s["peak"]), heap, share(s["peak"])])
    rows.append(
        ["gradian index process (its peak, watcher)", "", mib(indexed["peak_rss"]), "", share(indexed["peak_rss"])]
    )
    settings = " ".join(args.set) or "its defaults"
    text = (
        f"`gradian index` at {settings} on the first {args.rows} quickstart train rows, batches of {args.batch_size}, "
        f"at most {args.seq_len} tokens, against the plain forward+backward process over the same rows; "
        f"OMP_NUM_THREADS={args.threads}; one run of each. RSS and peak so far (VmRSS, VmHWM) after each stage; live heap: "
        "glibc's bytes in use (mallinfo2), the rest of the heap's RSS being freed chunks it keeps."
    )
    header = ["stage", "RSS", "peak so far", "live heap", "peak / plain peak"]
    name = "index_memory" + (f".{args.tag}" if args.tag else "")
    write_result(
        name, text, [{"title": "", "header": header, "rows": rows}], args.out, stages=stages, plain=plain["peak_rss"]
    )


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    else:
        main()
