"""Peak RSS of `gradian index` on 10^4 against 10^6 short rows (issue 30): memory must not grow
with the number of rows, since rows are read memory-mapped (datasets) and tokenised as the loader
takes them (data.TokenizedRows).

    PYTHONPATH=. python -m benchmarks.perf.data_memory --rows 10000 100000 1000000

Each size runs `gradian index` in a child process of its own on a JSONL file of prompt/completion
rows with ids (so the repeated-id check runs too), over a tiny random Llama (hidden 64, 2 layers,
down_proj, projection_dim 4); the child's peak RSS is its `ru_maxrss`. The datasets cache goes
under --out, so the JSONL -> arrow conversion is part of each measured run.
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


def measure(out: Path, model_dir: Path, rows: int) -> dict:
    """Run one `gradian index` child on `rows` rows; its wall time (s) and peak RSS (bytes)."""
    data = out / f"rows-{rows}.jsonl"
    if not data.is_file():
        write_rows(data, rows)
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
    peaks = {"RssAnon": 0, "RssFile": 0}  # sampled: anonymous memory, and mapped file pages (the arrow data)
    with open(log, "w") as sink:
        child = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)  # this child's own rusage: ru_maxrss in KiB
            if pid:
                break
            try:
                for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
            except OSError:  # not Linux, or the child is exiting
                pass
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"gradian index on {rows} rows failed:\n{log.read_text()[-2000:]}")
    return {
        "rows": rows,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": int(usage.ru_maxrss) * 1024,
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
        # Twice per size: the first run converts the JSONL to arrow (datasets, once per file, cached);
        # the second reads the cached arrow, which is what every later index or query of it costs.
        results = [{**measure(work, model_dir, n), "run": run} for n in rows for run in ("first read", "cached")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = {r["run"]: r["peak_rss_bytes"] for r in results if r["rows"] == rows[0]}
    header = ["rows", "run", "peak RSS", "against the fewest rows", "anonymous / mapped file pages", "wall time"]
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
        "The first read of a JSONL file includes datasets' one-off conversion to arrow (cached in HF_DATASETS_CACHE); the cached run is what indexing costs."
    )
    write_result("data_memory", text, [{"header": header, "rows": table_rows}], args.out, runs=results)


if __name__ == "__main__":
    main()
