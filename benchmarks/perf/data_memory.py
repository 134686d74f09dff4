"""Peak RSS of `gradian index` on 10^4 against 10^6 short rows (issue 30): memory must not grow
with the number of rows, since rows are read a row at a time and tokenised as the loader takes them
(data.TokenizedRows), by either reader of data_sources.py:

  - jsonl:   a `.jsonl` file, read by gradian itself (`JsonlRows`: one pass, then by line offset);
  - parquet: the same rows as a parquet file, read by `datasets` (converted to arrow in its cache on
    the first read, then memory-mapped: `StreamedRows`), first read and cached.

    PYTHONPATH=. python -m benchmarks.perf.data_memory --rows 10000 100000 1000000

Each size and source runs `gradian index` in a child process of its own on prompt/completion rows
with ids (so the repeated-id check runs too), over a tiny random Llama (hidden 64, 2 layers,
down_proj, projection_dim 4); the child's peak RSS is its VmHWM, sampled. The datasets cache goes
under the work folder, so the conversion to arrow is part of the first read.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_result

WORDS = "the a of to in on at is was who what where lives likes keeps city fruit pet one two three".split()


def write_rows(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` short prompt/completion rows (3-6 words each side), each with an id."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(3, 6)))
            completion = " " + " ".join(rng.choices(WORDS, k=rng.randint(3, 6)))
            f.write(json.dumps({"id": f"row-{i}", "prompt": prompt, "completion": completion}) + "\n")


def save_model(out: Path) -> Path:
    from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer

    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        tokenizer = word_tokenizer(WORDS)
        tiny_llama(len(tokenizer)).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return model_dir


def parquet_copy(jsonl: Path) -> Path:
    """The rows of `jsonl` as a parquet file beside it (written once, by datasets)."""
    out = jsonl.with_suffix(".parquet")
    if not out.is_file():  # in a process of its own: this one stays small (see `measure`)
        code = (
            "import datasets, sys; "
            "datasets.Dataset.from_json(sys.argv[1], cache_dir=sys.argv[2]).to_parquet(sys.argv[3])"
        )
        subprocess.run([sys.executable, "-c", code, str(jsonl), str(jsonl.parent / "convert"), str(out)], check=True)
    return out


def measure(out: Path, model_dir: Path, rows: int, source: str) -> dict:
    """Run one `gradian index` child on `rows` rows of `source` (jsonl or parquet); its wall time (s) and peak RSS (bytes)."""
    data = out / f"rows-{rows}.jsonl"
    if not data.is_file():
        write_rows(data, rows)
    if source == "parquet":
        data = parquet_copy(data)
    env = {**os.environ, "HF_DATASETS_CACHE": str(out / f"cache-{rows}"), "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "gradian_lightning.cli",
        "index",
        f"model.name_or_path={model_dir}",
        f"data.train={data}",
        f"index.path={out / f'index-{rows}'}",
        "index.overwrite=true",
        "grads.module_filter=down_proj",
        "grads.projection_dim=4",
        "grads.batch_size=64",
        "grads.max_seq_length=32",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    log = out / f"index-{rows}.log"
    start = time.perf_counter()
    # Sampled: the peak RSS (VmHWM), anonymous memory and mapped file pages (the arrow data). The peak
    # is VmHWM, not the child's ru_maxrss: Linux counts in that the image forked from this process
    # before the exec, and after a datasets import here it was larger than the child's own peak.
    peaks = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    with open(log, "w") as sink:
        child = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)
        while True:
            pid, status, _ = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            try:
                for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
            except OSError:  # not Linux, or the child is exiting
                pass
            time.sleep(0.05)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"gradian index on {rows} rows failed:\n{log.read_text()[-2000:]}")
    return {
        "rows": rows,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": peaks["VmHWM"],
        "peak_anon_bytes": peaks["RssAnon"],
        "peak_file_bytes": peaks["RssFile"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--smoke", action="store_true", help="200 and 2,000 rows: a minute")
    parser.add_argument("--out", default=None, help="result JSON folder (default benchmarks/results)")
    args = parser.parse_args()
    rows = [200, 2_000] if args.smoke else args.rows
    work = Path(tempfile.mkdtemp(prefix="gradian-data-memory-"))
    try:
        model_dir = save_model(work)
        # Parquet twice per size: the first run converts it to arrow (datasets, once per file, cached);
        # the second reads the cached arrow, which is what every later index or query of it costs.
        runs = [("jsonl", "jsonl"), ("parquet", "parquet, first read"), ("parquet", "parquet, cached")]
        results = [{**measure(work, model_dir, n, source), "run": run} for n in rows for source, run in runs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = {r["run"]: r["peak_rss_bytes"] for r in results if r["rows"] == rows[0]}
    header = [
        "rows",
        "source, run",
        "peak RSS",
        "against the fewest rows",
        "anonymous / mapped file pages",
        "wall time",
    ]
    table_rows = [
        [
            f"{r['rows']:,}",
            r["run"],
            f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB",
            f"{r['peak_rss_bytes'] / base[r['run']]:.2f}x",
            f"{r['peak_anon_bytes'] / 2**20:,.0f} / {r['peak_file_bytes'] / 2**20:,.0f} MiB",
            f"{r['wall_s']} s",
        ]
        for r in results
    ]
    text = (
        "Peak RSS of one `gradian index` child per size and run (tiny Llama, down_proj, k = 4, batch 64); target: flat within 10%. "
        "jsonl: the file read by gradian itself (JsonlRows). parquet: the same rows read by datasets; its first read includes the one-off conversion to arrow (cached in HF_DATASETS_CACHE), the cached run is what indexing it costs after."
    )
    write_result("data_memory", text, [{"header": header, "rows": table_rows}], args.out, runs=results)


if __name__ == "__main__":
    main()
