"""Index size: bytes per row for each module_filter × projection_dim × storage_dtype.

Real rows: SmolLM2-135M-Instruct loss gradients of the first `--rows` quickstart train rows,
captured once for every Linear (inputs and output-gradients per token) and projected for each
setting from those factors. Each setting is written with `IndexWriter` (index/layout.py: the grads array is stored without a
compressor, the per-row arrays with zarr's default), and measured on disk:
  - raw bytes/row     = width × itemsize (what the row is before compression),
  - grads bytes/row   = on-disk bytes of the grads array / rows,
  - index bytes/row   = on-disk bytes of the whole index (ids, losses, flags, metadata) / rows,
  - compression ratio = raw / grads on disk.

    PYTHONPATH=. python -m benchmarks.perf.index_size
    PYTHONPATH=. python -m benchmarks.perf.index_size --smoke --out /tmp/x

With `--statistics N,N,...` (results/index_statistics.json): the row statistics against the rows
they are of, at SmolLM2's default layout (90 MLP modules, k = 32: blocks of 1,024, int8): for each
row count N, N synthetic N(0, 1) rows written with `IndexWriter`, then its `close()` timed (the
statistics and whitened norms, index/statistics.py) and the statistics group's bytes on disk set
against the rows' raw bytes. Below k² = 1,024 rows the statistics keep the thin eigendecomposition
(N vectors a module), from k² rows the full one.

    PYTHONPATH=. python -m benchmarks.perf.index_size --statistics 16,64,256,1023,1024
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional

from benchmarks.common import SMOLLM2, bytes_on_disk, write_result
from benchmarks.studies.fidelity import DIMS, DTYPES, QUICKSTART, projected_rows
from gradian_lightning.index.layout import NUMPY_DTYPE

FILTERS = {
    "down_proj": ["down_proj"],
    "all MLP": ["gate_proj", "up_proj", "down_proj"],
    "all Linear": ["*.layers.*"],
}  # every decoder Linear; lm_head (tied to the embedding) left out


def statistics_against_rows(counts: List[int], out: Optional[str], modules: int = 90, size: int = 1024) -> None:
    """Close time and statistics bytes against the rows' bytes (module docstring, `--statistics`)."""
    import time

    import torch

    from gradian_lightning.index.writer import IndexWriter

    blocks = [{"name": f"m{i}", "offset": i * size, "size": size} for i in range(modules)]
    width, generator, rows = modules * size, torch.Generator().manual_seed(0), []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            path = Path(tmp) / f"rows-{n}"
            writer = IndexWriter(path, n, width, "int8", {"fingerprint": "bench", "modules": blocks})
            for lo in range(0, n, writer.chunk):
                hi = min(lo + writer.chunk, n)
                ids = [str(i) for i in range(lo, hi)]
                values = torch.randn(hi - lo, width, generator=generator)
                writer.write(
                    range(lo, hi), values, torch.zeros(hi - lo), torch.ones(hi - lo), torch.zeros(hi - lo), ids
                )
            start, cpu = time.perf_counter(), time.process_time()
            assert writer.close()
            close, cpu = time.perf_counter() - start, time.process_time() - cpu
            stats, raw = bytes_on_disk(path / "statistics"), n * width
            vectors = writer.group["statistics"]["eigvecs"].shape[2]
            rows.append(
                [
                    n,
                    vectors,
                    f"{close:.1f}",
                    f"{cpu:.1f}",
                    f"{stats / 1e6:.1f}",
                    f"{raw / 1e6:.1f}",
                    f"{stats / raw:.1f}",
                ]
            )
            print(rows[-1], flush=True)
            shutil.rmtree(path)
    load = os.getloadavg()
    text = (
        f"{modules} modules of {size} values (SmolLM2's MLP at k = 32), int8, N(0, 1) rows; close timed in one process "
        f"(wall, and CPU: user + system, what the load takes least away from), 1 torch thread; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on 2 cores."
    )
    header = [
        "rows",
        "eigenvectors a module",
        "close s (wall)",
        "close s (CPU)",
        "statistics MB on disk",
        "rows MB (raw)",
        "statistics / rows",
    ]
    write_result("index_statistics", text, [{"header": header, "rows": rows}], out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--statistics", default=None, help="comma-separated row counts: statistics against rows")
    parser.add_argument("--smoke", action="store_true", help="tiny Llama, 4 rows: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.statistics:
        import torch

        torch.set_num_threads(1)
        return statistics_against_rows([int(n) for n in args.statistics.split(",")], args.out)

    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from gradian_lightning.data import read_jsonl
    from gradian_lightning.gradients.capture import select_modules
    from gradian_lightning.index.writer import IndexWriter

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2))
    if args.smoke:
        from benchmarks.common import tiny_llama

        model, dims, n, label = (
            tiny_llama(vocab_size=len(tokenizer), hidden=64, layers=2),
            (4, 16),
            4,
            "tiny random-init Llama (hidden 64, 2 layers)",
        )
    else:
        from benchmarks.common import smollm2

        model, dims, n, label = smollm2(), DIMS, args.rows, "SmolLM2-135M-Instruct"
    train = read_jsonl(QUICKSTART / "train.jsonl")[:n]
    rows, codec = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for filter_name, patterns in FILTERS.items():
            modules = select_modules(model, patterns)
            for dim, (projected, _) in projected_rows(model, tokenizer, train, modules, dims).items():
                for dtype in DTYPES:
                    path = Path(tmp) / f"{filter_name}-{dim}-{dtype}".replace(" ", "_")
                    writer = IndexWriter(path, n, projected.shape[1], dtype, {"fingerprint": "bench"})
                    k = projected.shape[0]
                    writer.write(
                        range(k), projected, torch.zeros(k), torch.ones(k), torch.zeros(k), [f"r{i}" for i in range(k)]
                    )
                    assert writer.close()
                    codec = codec or writer.group["grads"].compressors
                    raw = projected.shape[1] * np.dtype(NUMPY_DTYPE[dtype]).itemsize
                    grads = bytes_on_disk(path / "grads") / n
                    total = bytes_on_disk(path) / n
                    rows.append(
                        [
                            filter_name,
                            len(modules),
                            dim,
                            dtype,
                            projected.shape[1],
                            raw,
                            f"{grads:.0f}",
                            f"{total:.0f}",
                            f"{raw / grads:.3f}",
                        ]
                    )
    text = f"{label}, {n} quickstart train rows (real gradients), zarr default codec for grads: {codec}."
    header = [
        "module_filter",
        "modules",
        "projection_dim",
        "storage_dtype",
        "row width",
        "raw bytes/row",
        "grads bytes/row on disk",
        "index bytes/row on disk",
        "compression ratio",
    ]
    write_result("index_size", text, [{"header": header, "rows": rows}], args.out)


if __name__ == "__main__":
    main()
