"""Report cost: the whole `gradian report` process against the `gradian query` it reports on.

Issue 42 (item 8): `gradian report` on 40 SmolLM2 rows and 5 queries ran 41 minutes with no output,
one forward/backward per copy of a shown row per supervised token, per query. The target: the
report costs at most 3× the query. Here, on the first `--rows` rows of the quickstart's bundled
facts (gradian_lightning/recipes/quickstart/train.jsonl) and the first `--queries` of its queries
whose planted source is among them, with SmolLM2-135M-Instruct at the index's defaults (the MLP,
k = 32, int8; batch 8, max length 128): `gradian index` once, then `gradian query` (top 5, 5
opponents) and `gradian report` (report.token_rows 5: up to 10 shaded rows per query) as fresh
processes, alternated `--repeats` times with the order rotated, both at OMP_NUM_THREADS=`--threads`.
Wall time and peak RSS are each whole process's, start-up included; the report makes its query
rows again and scores every row before its token terms.

    PYTHONPATH=. python -m benchmarks.perf.report_cost
    PYTHONPATH=. python -m benchmarks.perf.report_cost --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.common import ROOT, SMOLLM2, fmt_bytes, measure_command, write_result

QUICKSTART = ROOT / "gradian_lightning" / "recipes" / "quickstart"
TARGET = 3.0  # the report at most this many times the query's wall time


def write_data(folder: Path, rows: int, queries: int) -> tuple:
    """The first `rows` bundled facts and the first `queries` queries whose source is among them."""
    train = [json.loads(line) for line in (QUICKSTART / "train.jsonl").read_text().splitlines()][:rows]
    ids = {r["id"] for r in train}
    asked = [q for q in map(json.loads, (QUICKSTART / "queries.jsonl").read_text().splitlines()) if q["source"] in ids]
    asked = asked[:queries]
    paths = folder / "train.jsonl", folder / "queries.jsonl"
    for path, data in zip(paths, (train, asked)):
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return (*paths, len(train), len(asked))


def tiny_model_dir(folder: Path) -> Path:
    """The smoke run's model: the quickstart's word tokenizer and a tiny random Llama, saved."""
    from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer

    texts = [
        r["prompt"] + r["completion"]
        for f in ("train.jsonl", "queries.jsonl")
        for r in map(json.loads, (QUICKSTART / f).read_text().splitlines())
    ]
    tokenizer = word_tokenizer(texts)
    tiny_llama(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def settings(model: Path, folder: Path, train: Path, queries: Path) -> List[str]:
    return [
        f"model.name_or_path={model}",
        "model.dtype=float32",
        f"data.train={train}",
        "grads.batch_size=8",
        "grads.max_seq_length=128",
        f"index.path={folder / 'index'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        f"query.data={queries}",
        "query.top_k=5",
        "query.bottom_k=5",
        "query.method=index",  # the report's token terms are of the stored rows
        f"query.output={folder / 'results.jsonl'}",
        "report.token_rows=5",
    ]


def run(step: str, args: List[str], env: Dict[str, str], cwd: Path) -> Dict[str, Any]:
    result = measure_command([sys.executable, "-m", "gradian_lightning.cli", step, *args], env=env, cwd=cwd)
    if result["rc"] != 0:
        raise SystemExit(f"gradian {step} failed (exit {result['rc']}):\n{result['stderr']}")
    print(f"gradian {step}: {result['wall_s']:.1f} s, peak RSS {fmt_bytes(result['peak_rss'])}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--queries", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS (default 1: the machine is shared)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, 12 rows, 2 queries, one run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.queries, args.repeats = 12, 2, 1
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    times: Dict[str, List[Dict[str, Any]]] = {"query": [], "report": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = tiny_model_dir(folder / "model") if args.smoke else SMOLLM2
        if not (Path(model) / "model.safetensors").is_file():
            raise SystemExit(f"no SmolLM2 at {model}: build it (tests/smollm2.py says how) or set GRADIAN_SMOLLM2")
        train, queries, n_rows, n_queries = write_data(folder, args.rows, args.queries)
        common = settings(model, folder, train, queries)
        run("index", common, env, folder)
        for r in range(args.repeats):
            for step in ("query", "report") if r % 2 == 0 else ("report", "query"):
                times[step].append(run(step, common, env, folder))
        results = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
        shaded = {e["index"] for q in results for e in q["results"][:5] + q["opponents"][:5]}
    query_s = statistics.median(t["wall_s"] for t in times["query"])
    report_s = statistics.median(t["wall_s"] for t in times["report"])
    name = "tiny" if args.smoke else "smollm2"
    row = [
        name,
        n_rows,
        n_queries,
        len(shaded),
        f"{query_s:.1f}",
        f"{report_s:.1f}",
        f"{report_s / query_s:.2f}",
        "met" if report_s <= TARGET * query_s else "not met",
        fmt_bytes(statistics.median(t["peak_rss"] for t in times["query"])),
        fmt_bytes(statistics.median(t["peak_rss"] for t in times["report"])),
    ]
    header = [
        "model",
        "rows",
        "queries",
        "distinct shaded rows",
        "query wall s",
        "report wall s",
        "report / query",
        f"≤ {TARGET:g}×",
        "query peak RSS",
        "report peak RSS",
    ]
    text = (
        f"Whole fresh processes, medians of {args.repeats} alternated runs, OMP_NUM_THREADS={args.threads}; "
        "index at the defaults (MLP, k = 32, int8), batch 8, max length 128; query top 5 and 5 opponents, "
        "report.token_rows 5."
    )
    write_result(
        "report_cost",
        text,
        [{"title": "", "header": header, "rows": [row]}],
        args.out,
        runs={k: [{"wall_s": t["wall_s"], "peak_rss": t["peak_rss"]} for t in v] for k, v in times.items()},
    )


if __name__ == "__main__":
    main()
