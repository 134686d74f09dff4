"""Query throughput: GB/s of index scored by the streaming top-k, against a plain NumPy read.

An index of `--rows` × `--width` float16 rows (N(0, 1) values, written by `IndexWriter` with zarr's
default codec) and a raw .npy file of the same float16 bytes are written to local disk. Each is
read once to warm the page cache (this machine cannot drop caches, so both are measured warm),
then, interleaved `--repeats` times:
  - numpy read:      the .npy file's bytes read chunk by chunk (the index's chunk size) into one
                     reused NumPy buffer: the ceiling, bytes only, no decoding or scoring;
  - chunk read:      `IndexReader.chunks()` alone (zarr read + decompress + decode to float32);
  - streaming top-k: `gradian_lightning.query.topk.streaming_topk` (cosine, top 10, `--queries` queries),
                     i.e. read + decode + one float32 matmul per chunk + running top-k.
GB/s counts the raw float16 bytes of the rows (N × width × 2), 10⁹ bytes per GB.

    PYTHONPATH=. python -m benchmarks.query_throughput
    PYTHONPATH=. python -m benchmarks.query_throughput --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import bytes_on_disk, command_line, fmt_bytes, table, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared; NumPy's read is one thread too)")
    parser.add_argument("--dir", default=None, help="where to write the files (default: a temporary directory under /tmp)")
    parser.add_argument("--smoke", action="store_true", help="2000 × 256 rows, one repeat: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.width, args.repeats = 2000, 256, 1

    import numpy as np
    import torch

    from gradian_lightning import open_index
    from gradian_lightning.index.writer import IndexWriter

    torch.set_num_threads(args.threads)

    try:
        from gradian_lightning.query.topk import streaming_topk

        scorer = "gradian_lightning.query.topk.streaming_topk"
    except ImportError:  # query not merged yet: the same loop, written here
        scorer = "benchmark's own loop over IndexReader.chunks() (gradian_lightning.query not available)"

        def streaming_topk(index, query_rows, k, score="cosine"):
            q = query_rows / query_rows.norm(dim=1, keepdim=True)
            best_s = torch.empty(len(q), 0)
            best_i = torch.empty(len(q), 0, dtype=torch.long)
            for lo, rows in index.chunks():
                s = q @ (rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30)).T
                best_s = torch.cat([best_s, s], 1)
                best_i = torch.cat([best_i, torch.arange(lo, lo + len(rows)).expand(len(q), -1)], 1)
                top = best_s.topk(min(k, best_s.shape[1]), dim=1)
                best_s, best_i = top.values, best_i.gather(1, top.indices)
            return best_i, best_s

    raw_bytes = args.rows * args.width * 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        generator = torch.Generator().manual_seed(0)
        writer = IndexWriter(tmp / "index", args.rows, args.width, "float16", {"fingerprint": "bench"})
        plain = np.lib.format.open_memmap(tmp / "rows.npy", mode="w+", dtype=np.float16, shape=(args.rows, args.width))
        step = writer.chunk
        for lo in range(0, args.rows, step):
            hi = min(lo + step, args.rows)
            rows = torch.randn(hi - lo, args.width, generator=generator)
            writer.write(range(lo, hi), rows, torch.zeros(hi - lo), torch.ones(hi - lo), torch.zeros(hi - lo), [str(i) for i in range(lo, hi)])
            plain[lo:hi] = rows.half().numpy()
        assert writer.close()
        plain.flush()
        del plain
        index = open_index(tmp / "index")
        queries = torch.randn(args.queries, args.width, generator=generator)

        chunk_bytes = writer.chunk * args.width * 2
        buffer = np.empty(chunk_bytes, dtype=np.uint8)

        def numpy_read() -> None:
            # The same bytes in the index's chunk size into one reused buffer: streaming's ceiling.
            with open(tmp / "rows.npy", "rb") as f:
                np.lib.format.read_magic(f)
                np.lib.format.read_array_header_1_0(f)
                while f.readinto(buffer):
                    pass

        def chunk_read() -> None:
            for _ in index.chunks():
                pass

        def topk() -> None:
            streaming_topk(index, queries, 10, score="cosine")

        runs = {"numpy read (ceiling)": numpy_read, "chunk read + decode": chunk_read, "streaming top-k": topk}
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
    gbps = {name: raw_bytes / statistics.median(s) / 1e9 for name, s in seconds.items()}
    ceiling = gbps["numpy read (ceiling)"]
    rows = [[name, f"{statistics.median(s):.3f}", f"{gbps[name]:.2f}", f"{gbps[name] / ceiling:.2f}"] for name, s in seconds.items()]
    body = (
        f"{args.rows} × {args.width} float16 rows = {fmt_bytes(raw_bytes)} raw, {fmt_bytes(on_disk)} on disk as zarr grads "
        f"(chunks of {chunk_rows} rows); {args.threads} torch thread(s); {args.queries} queries, cosine, top 10; warm page cache; medians of {args.repeats} interleaved runs. "
        f"Scorer: {scorer}.\n\n" + table(["what", "seconds", "GB/s", "fraction of numpy read"], rows)
    )
    write_result("query_throughput", command_line(), body, args.out)


if __name__ == "__main__":
    main()
