"""Query throughput: the streaming top-k against two floors measured in the same run on the same index.

An index of `--rows` × `--width` float16 rows (N(0, 1) values, 16 equal modules, written by
`IndexWriter`) and a raw .npy file of the same float16 bytes are written to local disk. Each is
read once to warm the page cache (this machine cannot drop caches, so all are measured warm).
Then, interleaved `--repeats` times, for each query count Q in `--queries` (default 1, 8, 64):
  - floor (i), read + decode:  `IndexReader.stored_chunks()` decoded into one reused float32 buffer
                               (zarr read + float16 -> float32, the fastest decode the scorer has);
                               context: `IndexReader.chunks()`, which decodes into fresh tensors;
  - floor (ii), fp32 GEMM:     one `[Q, D] @ [D, N]` float32 matmul over rows already in memory;
  - streaming top-k:           `streaming_topk` (cosine per module, no preconditioner; top 10): read (the next chunk on a worker thread) +
                               decode + per-module scaling by the stored norms + one [Q, D] x [D, c]
                               matmul per chunk + merge;
  - the default scoring:       the same with `query.precondition=auto` (fisher here: 16 blocks of k² =
                               256) at damping 1.0: the queries are whitened twice and each chunk is
                               scaled by the whitened norms the writer stored, so the per-chunk work
                               is that of `none` plus the fixed cost of the factors; reported beside
                               the target.
The target: streaming top-k at >= 70% of the throughput of the slower floor, at every Q. Context: a
NumPy read of the same bytes into one reused buffer (a memory copy). GB/s counts the raw float16
bytes of the rows (N × width × 2), 10⁹ bytes per GB.

    PYTHONPATH=. python -m benchmarks.perf.query_throughput
    PYTHONPATH=. python -m benchmarks.perf.query_throughput --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import bytes_on_disk, fmt_bytes, write_result, write_synthetic_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--queries", default="1,8,64", help="comma-separated query counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the machine is shared; NumPy's read is one thread too)",
    )
    parser.add_argument(
        "--dir", default=None, help="where to write the files (default: a temporary directory under /tmp)"
    )
    parser.add_argument("--smoke", action="store_true", help="2000 × 256 rows, one repeat: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.width, args.repeats = 2000, 256, 1
    counts = [int(q) for q in args.queries.split(",")]

    import numpy as np
    import torch

    from gradian_lightning.index.layout import decode

    torch.set_num_threads(args.threads)
    raw_bytes = args.rows * args.width * 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        generator = torch.Generator().manual_seed(0)
        plain = np.lib.format.open_memmap(tmp / "rows.npy", mode="w+", dtype=np.float16, shape=(args.rows, args.width))

        def keep(lo: int, hi: int, values: torch.Tensor) -> None:
            plain[lo:hi] = values.half().numpy()

        index = write_synthetic_index(tmp / "index", args.rows, args.width, generator, each_chunk=keep)
        plain.flush()
        dense = torch.from_numpy(np.asarray(plain)).float().T.contiguous()  # [D, N] float32 for the GEMM floor
        queries = {q: torch.randn(q, args.width, generator=generator) for q in counts}

        chunk_bytes = index.grads.chunks[0] * args.width * 2
        buffer = np.empty(chunk_bytes, dtype=np.uint8)

        def numpy_read() -> None:
            with open(tmp / "rows.npy", "rb") as f:
                np.lib.format.read_magic(f)
                np.lib.format.read_array_header_1_0(f)
                while f.readinto(buffer):
                    pass

        decoded = torch.empty(index.grads.chunks[0], args.width)

        def read_decode() -> None:
            for _lo, stored in index.stored_chunks():
                decode(stored, "float16", out=decoded[: len(stored)])

        def chunk_read() -> None:
            for _ in index.chunks():
                pass

        def gemm(q: int):
            return lambda: queries[q] @ dense

        def topk(q: int, precondition: str = "none"):
            return lambda: index.topk(queries[q], 10, score="cosine", precondition=precondition, damping=1.0)

        runs = {"numpy read": numpy_read, "read + decode": read_decode, "chunks()": chunk_read}
        for q in counts:
            runs[f"gemm Q={q}"] = gemm(q)
            runs[f"top-k Q={q}"] = topk(q)
            runs[f"default Q={q}"] = topk(q, "auto")
        for fn in runs.values():  # warm the page cache and the code paths
            fn()
        seconds = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - start)
        on_disk = bytes_on_disk(tmp / "index" / "grads")
        chunk_rows = index.grads.chunks[0]
    med = {name: statistics.median(s) for name, s in seconds.items()}
    gbps = {name: raw_bytes / t / 1e9 for name, t in med.items()}
    rows_out = []
    for q in counts:
        slower = min(gbps["read + decode"], gbps[f"gemm Q={q}"])
        rows_out.append(
            [
                q,
                f"{gbps['read + decode']:.2f}",
                f"{gbps[f'gemm Q={q}']:.2f}",
                f"{gbps[f'top-k Q={q}']:.2f}",
                f"{gbps[f'top-k Q={q}'] / slower:.2f}",
                "met" if gbps[f"top-k Q={q}"] >= 0.7 * slower else "not met",
                f"{gbps[f'default Q={q}']:.2f}",
                f"{gbps[f'default Q={q}'] / slower:.2f}",
            ]
        )
    text = (
        f"{args.rows} × {args.width} float16 rows in 16 equal modules = {fmt_bytes(raw_bytes)} raw, {fmt_bytes(on_disk)} on disk as zarr grads "
        f"(chunks of {chunk_rows} rows); {args.threads} torch thread(s); cosine per module, top 10; "
        f"warm page cache; medians of {args.repeats} interleaved runs. Context: a NumPy read of the same bytes into one reused buffer runs at "
        f"{gbps['numpy read']:.2f} GB/s (a memory copy); `IndexReader.chunks()`, decoding into fresh tensors, at {gbps['chunks()']:.2f} GB/s."
    )
    header = [
        "Q",
        "floor (i) read + decode GB/s",
        "floor (ii) fp32 GEMM GB/s",
        "streaming top-k GB/s",
        "top-k / slower floor",
        "≥ 0.70 of the slower floor",
        "default scoring (auto = fisher, damping 1.0) GB/s",
        "default / slower floor",
    ]
    write_result("query_throughput", text, [{"header": header, "rows": rows_out}], args.out)


if __name__ == "__main__":
    main()
