"""Dask query engine against the local streaming scorer: the same index, the same queries, side by side.

An index of `--rows` × `--width` float16 rows (16 "modules" of equal width, N(0, 1) values scaled
per row, written by `IndexWriter`) goes to local disk. Then, on one machine:
  - local: `gradian_lightning.query.topk.streaming_topk` in this process, `--threads` torch threads;
  - dask:  `gradian_lightning.query.dask_engine.dask_topk` on a `distributed.LocalCluster` of
           `--threads` worker processes with one thread each (the same cores), already started.
Both rank `--queries` queries by the default score (cosine per module), top 10 and bottom 10, from a
warm page cache. The cluster's start-up and the workers' first call (imports) are timed apart; the
steady-state calls are interleaved `--repeats` times and the medians compared. Both rankings are
checked equal. Dask is for indexes larger than one machine; on one small machine it only adds
scheduling, serialisation and inter-process transfer, and this measures how much.

    PYTHONPATH=. python -m benchmarks.perf.dask_engine
    PYTHONPATH=. python -m benchmarks.perf.dask_engine --smoke --out /tmp/x
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
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads for local = Dask worker processes (one thread each)"
    )
    parser.add_argument(
        "--dir", default=None, help="where to write the index (default: a temporary directory under /tmp)"
    )
    parser.add_argument("--smoke", action="store_true", help="2000 × 256 rows, one repeat: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.width, args.repeats = 2000, 256, 1

    import torch
    from distributed import Client, LocalCluster

    from gradian_lightning.query.dask_engine import dask_topk
    from gradian_lightning.query.scorer import Scorer
    from gradian_lightning.query.topk import streaming_topk
    from gradian_lightning.specs import QuerySpec

    torch.set_num_threads(args.threads)
    raw_bytes = args.rows * args.width * 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        generator = torch.Generator().manual_seed(0)
        index = write_synthetic_index(tmp / "index", args.rows, args.width, generator, scale_rows=True)
        queries = torch.randn(args.queries, args.width, generator=generator)

        start = time.perf_counter()
        cluster = LocalCluster(n_workers=args.threads, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
        cluster_start = time.perf_counter() - start
        try:
            spec = QuerySpec(top_k=10, bottom_k=10, score="cosine", precondition="none")  # as measured in RESULTS.md
            local = lambda: streaming_topk([Scorer(index, spec).prepare(queries)])  # noqa: E731
            dask = lambda: dask_topk(Scorer(index, spec).prepare(queries), client=client)  # noqa: E731
            local()  # warm the page cache
            start = time.perf_counter()
            first = dask()  # the workers import torch and gradian and open the store
            first_call = time.perf_counter() - start
            reference = local()
            same = all(torch.equal(a.indices, b.indices) for a, b in zip(first, reference))
            seconds = {"local (streaming_topk)": [], "dask (dask_topk)": []}
            for _ in range(args.repeats):
                for name, fn in (("local (streaming_topk)", local), ("dask (dask_topk)", dask)):
                    start = time.perf_counter()
                    fn()
                    seconds[name].append(time.perf_counter() - start)
        finally:
            client.close()
            cluster.close()
        on_disk = bytes_on_disk(tmp / "index" / "grads")
        chunk_rows = index.grads.chunks[0]
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    base = medians["local (streaming_topk)"]
    rows = [[name, f"{m:.3f}", f"{raw_bytes / m / 1e9:.2f}", f"{m / base:.2f}"] for name, m in medians.items()]
    text = (
        f"{args.rows} × {args.width} float16 rows = {fmt_bytes(raw_bytes)} raw, {fmt_bytes(on_disk)} on disk as zarr grads (chunks of {chunk_rows} rows); "
        f"{args.queries} queries, cosine per module (16 modules), top 10 + bottom 10; warm page cache; local: {args.threads} torch thread(s); "
        f"dask: LocalCluster of {args.threads} worker process(es) × 1 thread; medians of {args.repeats} interleaved runs. "
        f"Rankings equal: {'yes' if same else 'NO'}. Not in the table: starting the LocalCluster took {cluster_start:.2f} s, and the workers' first call (importing torch and gradian, opening the store) {first_call:.2f} s."
    )
    write_result("dask_engine", text, [{"header": ["engine", "seconds", "GB/s", "× local"], "rows": rows}], args.out)


if __name__ == "__main__":
    main()
