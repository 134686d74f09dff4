"""Two-stage search (query.search=ann) against the exact scan: recall@10, queries per second, build.

An int8 index of `--rows` × `--width` synthetic rows in `--modules` equal blocks is written by
`IndexWriter` (statistics included, so the default scoring resolves to fisher as on a real index).
Rows are not i.i.d. noise (there no two rows are near, and every ANN method's recall is chance);
`--data` picks one of two structures, queries drawn the same way:
  - clustered: groups of about 50 rows around a shared direction (near-duplicates, one task's
    rows), each row half shared direction, half its own noise;
  - lowrank: a rank-64 part (latent N(0, 1) codes times a fixed basis whose scales fall as 1/√i)
    plus isotropic noise of the same size: after whitening, a flat score landscape (the top 10 of
    20,000 rows within 0.03 of each other), the hard case for any ANN index.
Neither is a real model's gradients (issue 43 asks for those: see RESULTS §15).
`--rows-per-chunk` (default 64) stores about as many rows a chunk as the default 92,160-wide int8
row gets (45): a candidate read back costs one chunk, as it would at the default width.

Then, for the default scoring (`query.precondition=auto`, `query.normalize=auto`):
  - exact:  `streaming_topk`, the scan `gradian query` runs by default, for `--queries` queries;
  - build:  the first `open_ann` (sketch, train and add each shard, write them): wall time, the
            process's peak RSS rise during it, and the ANN folder's bytes beside the grads';
  - ann:    `ann_topk` (open the shards from disk, search, read the candidates back from the zarr
            rows, score them exactly), the same queries, `--repeats` times (median);
recall@10 is the share of the exact top 10 that the ANN path returns, over all queries.

    PYTHONPATH=. python -m benchmarks.perf.ann_search
    PYTHONPATH=. python -m benchmarks.perf.ann_search --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import bytes_on_disk, fmt_bytes, peak_rss_rise, write_result

RANK = 64


def structured(kind: str, count: int, width: int, basis, generator):
    """[count, width] float32 rows of structure `kind` (the module docstring); `basis` holds the
    cluster directions [rows / 50, width] or the low-rank basis [RANK, width]."""
    import torch

    if kind == "clustered":
        centres = basis[torch.randint(len(basis), (count,), generator=generator)]
        return centres + torch.randn(count, width, generator=generator)
    low = torch.randn(count, RANK, generator=generator) @ basis
    return low + torch.randn(count, width, generator=generator) * (low.norm(dim=1, keepdim=True) / width**0.5)


def write_index(path: Path, kind: str, rows: int, width: int, modules: int, rows_per_chunk: int, basis, generator):
    import torch

    from gradian_lightning import open_index
    from gradian_lightning.index.writer import IndexWriter

    size = width // modules
    blocks = [{"name": f"m{i}", "offset": i * size, "size": size} for i in range(modules)]
    meta = {"fingerprint": "ann-bench", "modules": blocks}
    writer = IndexWriter(path, rows, width, "int8", meta, rows_per_chunk=rows_per_chunk)
    step = writer.chunk * max(1, 4096 // writer.chunk)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        n = hi - lo
        writer.write(
            range(lo, hi),
            structured(kind, n, width, basis, generator),
            torch.zeros(n),
            torch.ones(n),
            torch.zeros(n),
            [str(i) for i in range(lo, hi)],
        )
    assert writer.close()
    return open_index(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--modules", type=int, default=16)
    parser.add_argument("--data", choices=("clustered", "lowrank"), default="clustered")
    parser.add_argument("--rows-per-chunk", type=int, default=64)
    parser.add_argument("--queries", type=int, default=8, help="queries per timed batch")
    parser.add_argument("--recall-queries", type=int, default=64, help="queries recall@10 is counted over")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-rows", type=int, default=None, help="query.ann_shard_rows (default: the setting's)")
    parser.add_argument("--threads", type=int, default=1, help="torch and FAISS threads (the machine is shared)")
    parser.add_argument("--dir", default=None, help="where to write the index (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="3000 × 1024 rows, 8 queries, one repeat: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.width, args.queries, args.recall_queries, args.repeats = 3000, 1024, 8, 8, 1

    import faiss
    import torch

    from gradian_lightning.query import ann
    from gradian_lightning.query.scorer import checkpoint_scorers
    from gradian_lightning.query.topk import streaming_topk
    from gradian_lightning.specs import QuerySpec

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    if args.data == "clustered":
        basis = torch.randn(max(1, args.rows // 50), args.width, generator=generator)
    else:
        basis = torch.randn(RANK, args.width, generator=generator) / torch.arange(1, RANK + 1).float().sqrt()[:, None]
    settings = {"search": "ann", **({"ann_shard_rows": args.shard_rows} if args.shard_rows else {})}
    spec = QuerySpec(**settings)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        start = time.perf_counter()
        index = write_index(
            Path(tmp) / "ix", args.data, args.rows, args.width, args.modules, args.rows_per_chunk, basis, generator
        )
        write_s = time.perf_counter() - start
        asked = structured(args.data, args.recall_queries, args.width, basis, generator)
        queries = asked[: args.queries]

        def exact(queries=queries):
            return streaming_topk(checkpoint_scorers(index.reader, queries, spec))[0]

        def approximate(queries=queries):
            return ann.ann_topk(checkpoint_scorers(index.reader, queries, spec, shortcut=False))[0]

        scorer = checkpoint_scorers(index.reader, queries, spec, shortcut=False)[0]
        start = time.perf_counter()
        build_rss = peak_rss_rise(lambda: ann.open_ann(scorer))
        build_s = time.perf_counter() - start
        exact_s, ann_s = [], []
        for _ in range(args.repeats):  # interleaved: both see the same load on the shared machine
            start = time.perf_counter()
            exact()
            exact_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            approximate()
            ann_s.append(time.perf_counter() - start)
        top, found = exact(asked), approximate(asked)
        hits = sum(len(set(e.tolist()) & set(a.tolist())) for e, a in zip(top.indices, found.indices))
        recall = hits / top.indices.numel()
        exact_t, ann_t = statistics.median(exact_s), statistics.median(ann_s)
        ann_bytes = bytes_on_disk(Path(tmp) / "ix" / ann.FOLDER)
        grads_bytes = bytes_on_disk(Path(tmp) / "ix" / "grads")
        shards = len(ann.shard_ranges(args.rows, spec.ann_shard_rows))
        rows_out = [
            [
                args.data,
                f"{args.rows:,}",
                "exact scan",
                f"{args.queries / exact_t:.1f}",
                "1.00",
                "",
                "",
                f"{fmt_bytes(grads_bytes)} (grads)",
            ],
            [
                args.data,
                f"{args.rows:,}",
                "ann",
                f"{args.queries / ann_t:.1f}",
                f"{recall:.3f}",
                f"{build_s:.1f}",
                fmt_bytes(build_rss),
                f"{fmt_bytes(ann_bytes)} ({ann_bytes / grads_bytes:.1%} of grads)",
            ],
        ]
    header = ["data", "rows", "search", "queries/s", "recall@10", "build s", "build peak RSS rise", "bytes on disk"]
    text = (
        f"{args.rows:,} × {args.width} int8 synthetic {args.data} rows ({args.modules} equal modules, "
        f"{args.rows_per_chunk} rows a chunk), written in {write_s:.0f} s; {args.queries} queries at once, top 10; recall over "
        f"{args.recall_queries} queries; scoring "
        f"{scorer.describe()}; sketch to {spec.ann_sketch_dim} columns, {shards} shard(s), "
        f"query.ann_candidates={spec.ann_candidates}, query.ann_nprobe={spec.ann_nprobe}; {args.threads} thread(s); "
        f"medians of {args.repeats} interleaved runs, warm page cache. The ann time includes opening the "
        f"shards from disk and reading the candidates back from the zarr rows; speed-up {exact_t / ann_t:.1f}×."
    )
    write_result(
        f"ann_search.{args.data}",
        text,
        [{"header": header, "rows": rows_out}],
        args.out,
        recall_at_10=recall,
        exact_s=exact_t,
        ann_s=ann_t,
        build_s=build_s,
        build_rss=build_rss,
        ann_bytes=ann_bytes,
        grads_bytes=grads_bytes,
    )


if __name__ == "__main__":
    main()
