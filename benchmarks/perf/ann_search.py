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
  - exact:  `streaming_topk`, the scan `gradian query` runs by default, for a batch of queries
            (`--queries`: one or more batch sizes, e.g. 8,64; `gradian query` answers all the
            queries of its file in one call, so a batch is one such call);
  - build:  the first `open_ann` (sketch, train and add each shard, write them): wall time, the
            process's peak RSS rise during it, and the ANN folder's bytes beside the grads';
  - ann:    `ann_topk` (prepare the scorer, search the shards, read the candidates back from the
            zarr rows, score them exactly), the same queries, timed twice per repeat: as the first
            call of a process (the opened shards and preconditioners this process keeps are
            dropped first, so it opens the shards and reads the eigendecomposition again; the page
            cache stays warm) and as a later call (a query server's, or a Python user's next batch);
  each timed `--repeats` times, interleaved, median;
recall@10 is the share of the exact top 10 that the ANN path returns, over all queries.

    PYTHONPATH=. python -m benchmarks.perf.ann_search
    PYTHONPATH=. python -m benchmarks.perf.ann_search --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

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
    """The synthetic index at `path`; an index this script wrote there before with the same
    arguments (`--keep`, then `--reuse`) is opened instead, its rows drawn again and dropped so that
    `generator` draws the same queries after them."""
    import torch

    from gradian_lightning import open_index
    from gradian_lightning.index.writer import IndexWriter

    if (path / "zarr.json").is_file():
        index = open_index(path)
        assert (len(index), index.meta.width) == (rows, width), "--reuse: another --rows or --width"
        step = index.reader.grads.chunks[0] * max(1, 4096 // index.reader.grads.chunks[0])
        for lo in range(0, rows, step):
            structured(kind, min(lo + step, rows) - lo, width, basis, generator)
        return index
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


def parse_settings(text: str) -> List[Tuple[int, int]]:
    """`--settings` "NPROBE:CANDIDATES,..." -> [(query.ann_nprobe, query.ann_candidates), ...]."""
    pairs = [item.split(":") for item in text.split(",") if item]
    if not pairs or any(len(p) != 2 or not all(x.isdigit() and int(x) > 0 for x in p) for p in pairs):
        raise SystemExit(f"--settings {text!r}: give NPROBE:CANDIDATES pairs of positive integers, e.g. 32:100,128:200")
    return [(int(a), int(b)) for a, b in pairs]


def real_queries(index, model_dir: str, query_data: str, batch_size: int):
    """float32 [Q, D]: the rows of `query_data` (JSONL) made by `query_gradients` with the saved
    model at `model_dir`, as `gradian query` makes them for `index`."""
    import json

    from gradian_lightning.config import load_config
    from gradian_lightning.hub import load_model_and_tokenizer
    from gradian_lightning.query.rows import query_gradients

    model, tokenizer = load_model_and_tokenizer(load_config(None, [f"model.name_or_path={model_dir}"]).model)
    rows = [json.loads(line) for line in Path(query_data).read_text().splitlines() if line.strip()]
    return query_gradients(index.reader, model.eval(), tokenizer, rows, batch_size)


def times_faster(ratio: float) -> str:
    return f"{ratio:.1f}×" if ratio < 10 else f"{ratio:.0f}×"


def note(message: str) -> None:
    """A progress line on stderr (the long runs are polled from their logs)."""
    print(
        f"[{time.strftime('%H:%M:%S')} load {' '.join(f'{x:.2f}' for x in os.getloadavg())}] {message}",
        file=sys.stderr,
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--modules", type=int, default=16)
    parser.add_argument("--data", choices=("clustered", "lowrank"), default="clustered")
    parser.add_argument("--rows-per-chunk", type=int, default=64)
    parser.add_argument("--index", default=None, help="measure this existing index instead of writing synthetic rows")
    parser.add_argument("--query-data", default=None, help="with --index: the JSONL rows to query it with")
    parser.add_argument("--model", default=None, help="with --index: the saved model that makes the query rows")
    parser.add_argument("--label", default=None, help="the result's name and data column (default: --data, or real)")
    parser.add_argument("--queries", default="8", help="queries per timed batch: one size or several, e.g. 8,64")
    parser.add_argument("--recall-queries", type=int, default=64, help="queries recall@10 is counted over")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-rows", type=int, default=None, help="query.ann_shard_rows (default: the setting's)")
    parser.add_argument("--sketch-dim", type=int, default=None, help="query.ann_sketch_dim (default: the setting's)")
    parser.add_argument(
        "--settings",
        default=None,
        help="NPROBE:CANDIDATES pairs to measure, one ANN build for all, e.g. 32:100,128:200 (default: the settings' defaults)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch and FAISS threads (the machine is shared)")
    parser.add_argument("--dir", default=None, help="where to write the index (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the written index (under --dir) for another run")
    parser.add_argument(
        "--reuse", default=None, help="the folder a --keep run wrote (same --rows, --width, --data): measure it again"
    )
    parser.add_argument("--smoke", action="store_true", help="3000 × 1024 rows, 8 queries, one repeat: seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.width, args.queries, args.recall_queries, args.repeats = 3000, 1024, "8", 8, 1
    batches = sorted({int(x) for x in str(args.queries).split(",") if x})
    if args.index and not (args.query_data and args.model):
        raise SystemExit(
            "--index needs --query-data and --model (the rows to query it with, and the model that makes them)"
        )

    import faiss
    import torch

    from gradian_lightning import open_index
    from gradian_lightning.query import ann
    from gradian_lightning.query.scorer import checkpoint_scorers
    from gradian_lightning.query.topk import streaming_topk
    from gradian_lightning.specs import QuerySpec

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    label = args.label or ("real" if args.index else args.data)
    base = {"search": "ann", **({"ann_shard_rows": args.shard_rows} if args.shard_rows else {})}
    base.update({"ann_sketch_dim": args.sketch_dim} if args.sketch_dim else {})
    spec = QuerySpec(**base)
    settings = parse_settings(args.settings) if args.settings else [(spec.ann_nprobe, spec.ann_candidates)]
    with contextlib.ExitStack() as stack:
        if args.index:
            where = Path(args.index)
            index = open_index(where)
            note(f"querying {len(index):,} rows of {where}")
            asked = real_queries(index, args.model, args.query_data, 8)[: max(args.recall_queries, *batches)]
            write_s = None
        else:
            generator = torch.Generator().manual_seed(0)
            if args.data == "clustered":
                basis = torch.randn(max(1, args.rows // 50), args.width, generator=generator)
            else:
                basis = (
                    torch.randn(RANK, args.width, generator=generator)
                    / torch.arange(1, RANK + 1).float().sqrt()[:, None]
                )
            if args.reuse:
                tmp = Path(args.reuse)
            elif args.keep:
                tmp = Path(tempfile.mkdtemp(dir=args.dir))
            else:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.dir)))
            where = tmp / "ix"
            reused = (where / "zarr.json").is_file()
            note(f"{'drawing again' if reused else 'writing'} {args.rows:,} × {args.width} rows of {where}")
            start = time.perf_counter()
            index = write_index(
                where, args.data, args.rows, args.width, args.modules, args.rows_per_chunk, basis, generator
            )
            write_s = None if reused else time.perf_counter() - start
            asked = structured(args.data, max(args.recall_queries, *batches), args.width, basis, generator)
        batches = sorted({min(b, len(asked)) for b in batches})  # --smoke, or a short query file
        queries = asked[: batches[0]]
        specs = [QuerySpec(**base, ann_nprobe=n, ann_candidates=c) for n, c in settings]

        def exact(queries=queries):
            return streaming_topk(checkpoint_scorers(index.reader, queries, spec))[0]

        def approximate(queries=queries, spec=spec):
            return ann.ann_topk(checkpoint_scorers(index.reader, queries, spec, shortcut=False))[0]

        scorer = checkpoint_scorers(index.reader, queries, spec, shortcut=False)[0]
        note("building the ANN index")
        load_before = os.getloadavg()
        start = time.perf_counter()
        build_rss = peak_rss_rise(lambda: ann.open_ann(scorer))
        build_s = time.perf_counter() - start
        note(f"built in {build_s:.0f} s; timing")
        from gradian_lightning.query import precondition

        def first_call(queries, spec):
            # As a fresh process meets the index: nothing this process keeps open (ann.OPENED,
            # precondition.FACTORS), the page cache as warm as the later calls find it.
            ann.OPENED.clear()
            precondition.FACTORS.clear()
            return approximate(queries, spec)

        timed = {}  # batch -> (scan s, [first-call s per setting], [later-call s per setting]), medians
        for batch in batches:
            some = asked[:batch]
            exact_s, first_s, later_s = [], [[] for _ in specs], [[] for _ in specs]
            for _ in range(args.repeats):  # interleaved: all see the same load on the shared machine
                start = time.perf_counter()
                exact(some)
                exact_s.append(time.perf_counter() - start)
                for cold, warm, each in zip(first_s, later_s, specs):
                    start = time.perf_counter()
                    first_call(some, each)
                    cold.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    approximate(some, each)
                    warm.append(time.perf_counter() - start)
                note(
                    f"{batch} queries: scan {exact_s[-1]:.1f} s, ann first call {[round(t[-1], 3) for t in first_s]} s, "
                    f"later {[round(t[-1], 3) for t in later_s]} s"
                )
            median = statistics.median
            timed[batch] = (median(exact_s), [median(t) for t in first_s], [median(t) for t in later_s])
        top = exact(asked)
        hits = [
            sum(len(set(e.tolist()) & set(a.tolist())) for e, a in zip(top.indices, approximate(asked, each).indices))
            for each in specs
        ]
        load_after = os.getloadavg()
        recalls = [h / top.indices.numel() for h in hits]
        ann_bytes = bytes_on_disk(where / ann.FOLDER)
        grads_bytes = bytes_on_disk(where / "grads")
        num_rows, width = len(index), index.meta.width
        shards = len(ann.shard_ranges(num_rows, spec.ann_shard_rows))
        rows_out = []
        for batch, (exact_t, first_t, later_t) in timed.items():
            rows_out.append(
                [label, f"{num_rows:,}", str(batch), "exact scan", "", f"{batch / exact_t:.2f}", "1.0×", "", "", "1.00"]
                + ["", "", f"{fmt_bytes(grads_bytes)} (grads)" if batch == batches[0] else ""]
            )
            for i, ((nprobe, candidates), cold, warm, recall) in enumerate(zip(settings, first_t, later_t, recalls)):
                built = batch == batches[0] and i == 0
                rows_out.append(
                    [
                        label,
                        f"{num_rows:,}",
                        str(batch),
                        "ann",
                        f"{nprobe} / {candidates}",
                        f"{batch / warm:.1f}",
                        times_faster(exact_t / warm),
                        f"{batch / cold:.1f}",
                        times_faster(exact_t / cold),
                        f"{recall:.3f}",
                        f"{build_s:.0f}" if built else "",
                        fmt_bytes(build_rss) if built else "",
                        f"{fmt_bytes(ann_bytes)} ({ann_bytes / grads_bytes:.1%} of grads)" if built else "",
                    ]
                )
        chunk = index.reader.grads.chunks[0]
        if args.index:
            what = (
                f"{num_rows:,} × {width} {index.meta.storage_dtype} rows of a real model's gradients ({len(index.meta.blocks)} modules, "
                f"{chunk} rows a chunk) in {where}; batches of {', '.join(map(str, batches))} queries at once (the first of {args.query_data}), top 10; "
                f"recall over {len(asked)} queries"
            )
        else:
            what = (
                f"{num_rows:,} × {width} int8 synthetic {args.data} rows ({args.modules} equal modules, "
                f"{chunk} rows a chunk), {'written by an earlier run of the same arguments with --keep' if reused else f'written in {write_s:.0f} s'}; batches of {', '.join(map(str, batches))} queries at once, top 10; recall over "
                f"{len(asked)} queries"
            )
    header = [
        "data",
        "rows",
        "queries at once",
        "search",
        "nprobe / candidates",
        "queries/s",
        "speed-up",
        "first call: queries/s",
        "first call: speed-up",
        "recall@10",
        "build s",
        "build peak RSS rise",
        "bytes on disk",
    ]
    text = (
        f"{what}; scoring {scorer.describe()}; sketch to {spec.ann_sketch_dim} columns, {shards} shard(s) of "
        f"query.ann_shard_rows={spec.ann_shard_rows:,}, query.ann_nprobe / query.ann_candidates as in the table; "
        f"{args.threads} thread(s); medians of {args.repeats} interleaved runs, warm page cache; load average "
        f"{load_before[0]:.2f} before the build, {load_after[0]:.2f} at the end (1-minute). An ann call prepares the "
        f"scorer, searches the shards, reads the candidates back from the zarr rows and scores them; 'first call' "
        f"also opens the shards and reads the preconditioner's eigendecomposition, as the first call of a process "
        f"does, and the speed-ups divide the scan's time by each."
    )
    write_result(
        f"ann_search.{label}",
        text,
        [{"header": header, "rows": rows_out}],
        args.out,
        recall_at_10=recalls,
        settings=settings,
        batches=batches,
        exact_s=[timed[b][0] for b in batches],
        ann_first_s=[timed[b][1] for b in batches],
        ann_s=[timed[b][2] for b in batches],
        write_s=write_s,
        build_s=build_s,
        build_rss=build_rss,
        ann_bytes=ann_bytes,
        grads_bytes=grads_bytes,
        load_average=[list(load_before), list(load_after)],
    )


if __name__ == "__main__":
    main()
