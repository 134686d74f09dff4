"""Shared pieces of the benchmark scripts: machine description, fresh-subprocess runs, peak RSS,
models and synthetic batches, and Markdown tables. Plain Python; no timing assertions anywhere.

Every script prints its tables and writes them, with the command and the machine, to
`benchmarks/results/<name>.json` (or `--out DIR`); `python -m benchmarks.tables` renders them into RESULTS.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SMOLLM2 = Path(os.environ.get("GRADIAN_SMOLLM2", Path.home() / ".cache" / "gradian" / "smollm2-135m-instruct"))


def largest_fp32_vocab_tensor(vocab: int, parameters: set) -> Any:
    """A torch dispatch mode recording, in `.nbytes`, the largest fp32 tensor made while it is active
    whose last dimension is `vocab` (the loss's logit-sized tensors); storages in `parameters`
    (data pointers of the weights and their views) are not counted."""
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestVocabTensor(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in pytree.tree_leaves(result):
                if (
                    isinstance(t, torch.Tensor)
                    and t.dtype == torch.float32
                    and t.dim() >= 1
                    and t.shape[-1] == vocab
                    and t.untyped_storage().data_ptr() not in parameters
                ):
                    self.nbytes = max(self.nbytes, t.numel() * 4)
            return result

    return LargestVocabTensor()


def machine() -> Dict[str, str]:
    """What the figures were measured on: cores, CPU model, RAM, date (UTC), versions."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        kib = int(
            next(
                line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
            ).split()[1]
        )
        ram = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "ram": ram,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit or "unknown",
    }


def machine_line(info: Optional[Dict[str, str]] = None) -> str:
    m = info or machine()
    return f"{m['nproc']} cores ({m['cpu']}), {m['ram']} RAM, torch {m['torch']}, Python {m['python']}, commit {m['commit']}, {m['date']}"


def peak_rss_bytes() -> int:
    """This process's peak resident set size since start (or since `reset_peak_rss`), bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_rise(run: Any) -> int:
    """Bytes by which the process's peak RSS rises above its current RSS while `run()` runs."""
    import gc

    gc.collect()
    start = current_rss_bytes()
    reset_peak_rss()
    run()
    return peak_rss_bytes() - start


def run_child(module: str, args: Sequence[str], timeout: float = 3600, flag: str = "--child") -> Dict[str, Any]:
    """Run `python -m module --child args...` (or another `flag`) in a fresh process; its last stdout line is JSON.

    Returns that JSON plus `process_wall_s` (whole-process wall time seen from here, seconds).
    """
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", module, flag, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def batch_clock(starts: List[float]) -> Any:
    """A Lightning callback appending to `starts` the time (s, `time.perf_counter`) at which each
    training or validation batch begins, after the device has finished the batch before it (CUDA
    kernels run asynchronously, so without the synchronisation a batch's time would land on another)."""
    import lightning as L
    import torch

    class BatchStarts(L.Callback):
        def _start(self, trainer: Any) -> None:
            device = trainer.strategy.root_device
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            starts.append(time.perf_counter())

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self._start(trainer)

        def on_validation_batch_start(self, trainer: Any, *args: Any) -> None:
            self._start(trainer)

    return BatchStarts()


def steady_step_s(starts: Sequence[float], loop_s: float, batches: int) -> float:
    """Seconds per batch between the second batch's start and the last's (`batch_clock`): not the
    first (it pages the weights in, and Lightning sets up before it) nor the last (an index is
    closed after it), so this is what each further batch costs; `loop_s / batches` when there are
    fewer than three batches."""
    return (starts[-1] - starts[1]) / (len(starts) - 2) if len(starts) > 2 else loop_s / batches


def emit(result: Dict[str, Any]) -> None:
    """The child's answer to `run_child`: one JSON line on stdout."""
    print(json.dumps(result), flush=True)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(
    name: str, text: str, tables: Sequence[Dict[str, Any]], out: Optional[str] = None, **measured: Any
) -> Path:
    """Write `<out>/<name>.json` (default benchmarks/results): the command that ran, the machine, a
    caption, the tables (each {"title", "header", "rows"}) and any raw figures in `measured`; print
    its Markdown. `python -m benchmarks.tables` renders RESULTS.md's blocks from these files."""
    directory = Path(out) if out else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    result = {"command": command_line(), "machine": machine_line(), "text": text, "tables": list(tables), **measured}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(render_result(result))
    print(f"(written to {path})")
    return path


def render_result(result: Dict[str, Any]) -> str:
    """The Markdown of one result file: command, machine, caption, then each table under its title."""
    parts = [f"Command: `{result['command']}`", f"Machine: {result['machine']}", result["text"].strip()]
    for t in result["tables"]:
        parts += ([t["title"]] if t.get("title") else []) + [table(t["header"], t["rows"])]
    return "\n\n".join(p for p in parts if p)


def command_line() -> str:
    """The command this process was started with, as a reader re-runs it from the repository root."""
    return "PYTHONPATH=. python -m " + " ".join(
        [Path(sys.argv[0]).with_suffix("").resolve().relative_to(ROOT).as_posix().replace("/", "."), *sys.argv[1:]]
    )


def tiny_llama(vocab_size: int = 2048, hidden: int = 128, layers: int = 4, seed: int = 0):
    """A random-init Llama, the "tiny" benchmark model (float32, eval mode), built as the quickstart builds its own."""
    from gradian_lightning.recipes.quickstart import tiny_llama as build

    return build(vocab_size, hidden, layers, seed, max_positions=1024).eval()


def smollm2(layers: Optional[int] = None):
    """SmolLM2-135M-Instruct (float32, eval mode), optionally only its first `layers` decoder layers."""
    from transformers import AutoModelForCausalLM

    if not (SMOLLM2 / "model.safetensors").is_file():
        raise SystemExit(
            f"SmolLM2 not found at {SMOLLM2}; save HuggingFaceTB/SmolLM2-135M-Instruct (model and tokenizer, save_pretrained) there, or set GRADIAN_SMOLLM2 to a folder holding it"
        )
    kwargs = {} if layers is None else {"num_hidden_layers": layers}
    import torch

    return AutoModelForCausalLM.from_pretrained(str(SMOLLM2), dtype=torch.float32, **kwargs).eval()


def load_model(name: str, layers: Optional[int] = None):
    """`tiny` or `smollm2`."""
    if name == "tiny":
        return tiny_llama()
    if name == "smollm2":
        return smollm2(layers)
    raise SystemExit(f"unknown model {name!r}; use tiny or smollm2")


def synthetic_examples(
    num: int, seq_len: int, vocab_size: int, supervised_fraction: float = 0.5, seed: int = 0
) -> List[Any]:
    """`num` examples of exactly `seq_len` random tokens; the last `supervised_fraction` is supervised."""
    import torch

    from gradian_lightning.data import IGNORE_INDEX, Example

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (num, seq_len), generator=generator)
    prompt = seq_len - max(1, round(seq_len * supervised_fraction))
    out = []
    for i in range(num):
        row = ids[i].tolist()
        out.append(Example(i, f"ex{i}", row, [IGNORE_INDEX] * prompt + row[prompt:], 0))
    return out


def write_synthetic_index(
    path: Path,
    rows: int,
    width: int,
    generator: Any,
    modules: int = 16,
    scale_rows: bool = False,
    each_chunk: Optional[Callable[[int, int, Any], None]] = None,
) -> Any:
    """A complete float16 index of `rows` × `width` N(0, 1) values in `modules` equal blocks, written
    chunk by chunk through `IndexWriter`, as the query benchmarks read it; with `scale_rows` each row is
    scaled by a U(0, 1) factor (so row norms differ). `each_chunk(lo, hi, values)` sees every chunk's
    float32 values [hi - lo, width] as written. Returns the opened index."""
    import torch

    from gradian_lightning import open_index
    from gradian_lightning.index.writer import IndexWriter

    blocks = [{"name": f"m{i}", "offset": i * (width // modules), "size": width // modules} for i in range(modules)]
    writer = IndexWriter(path, rows, width, "float16", {"fingerprint": "bench", "modules": blocks})
    for lo in range(0, rows, writer.chunk):
        hi = min(lo + writer.chunk, rows)
        values = torch.randn(hi - lo, width, generator=generator)
        if scale_rows:
            values = values * torch.rand(hi - lo, 1, generator=generator)
        ids = [str(i) for i in range(lo, hi)]
        writer.write(range(lo, hi), values, torch.zeros(hi - lo), torch.ones(hi - lo), torch.zeros(hi - lo), ids)
        if each_chunk is not None:
            each_chunk(lo, hi, values)
    assert writer.close()
    return open_index(path)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_MEASURE = (
    "import json, resource, subprocess, sys, time\n"
    "start = time.perf_counter()\n"
    "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "wall = time.perf_counter() - start\n"
    "usage = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "rss, cpu = usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime\n"
    "print(json.dumps({'rc': done.returncode, 'wall_s': wall, 'cpu_s': cpu, 'peak_rss': rss, 'stdout': done.stdout[-3000:], 'stderr': done.stderr[-6000:]}))\n"
)


def measure_command(
    cmd: Sequence[str], env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None
) -> Dict[str, Any]:
    """Run `cmd` under a fresh watcher process: wall time (s), CPU time of all its processes (user +
    system, s), peak RSS of its largest process (bytes), exit code and output tails. The watcher is new, so no earlier run's peak leaks in."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def bytes_on_disk(path: Path) -> int:
    """Sum of the sizes of the files under `path`, bytes."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (benchmarks run headless); without the `bench`
    extra, the script stops with one line naming it."""
    from gradian_lightning.errors import MissingExtraError
    from gradian_lightning.extras import require_extra

    try:
        matplotlib = require_extra("matplotlib", "bench", "drawing the benchmark's figure")
    except MissingExtraError as err:
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: {err}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
