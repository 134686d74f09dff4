"""Reproduces docs/case-studies/truncated-completions.md: the same data indexed at a too-small and
an adequate grads.max_seq_length, and what that does to rankings.

    PYTHONPATH=. python docs/case-studies/truncated_completions.py [--out runs/case-truncated]

SmolLM2-135M-Instruct (tests/smollm2.py builds it offline), down_proj of all 30 layers, k = 64,
float32 storage. Query rows are indexed the same way (never truncated) and ranked by cosine
similarity with a few lines of numpy; rows with no supervised token have no gradient and are left
out of rankings, as `gradian index` says.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

import numpy as np

from gradian_lightning import open_index
from gradian_lightning.cli import main as gradian

HERE = Path(os.path.relpath(Path(__file__).parent))  # relative, so the printed commands are too
MODEL = Path.home() / ".cache/gradian/smollm2-135m-instruct"


def index(data: Path, path: Path, max_seq_length: int) -> str:
    argv = [
        "index",
        "configs/smollm2.yaml",
        f"model.name_or_path={MODEL}",
        f"data.train={data}",
        f"index.path={path}",
        f"grads.max_seq_length={max_seq_length}",
        "grads.projection_dim=64",
        "grads.storage_dtype=float32",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "index.overwrite=true",
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gradian(argv) == 0
    return (
        f"$ gradian index configs/smollm2.yaml data.train={data} grads.max_seq_length={max_seq_length} grads.projection_dim=64 ...\n"
        + out.getvalue()
    )


def ranking(train: Path, queries: Path, k: int = 3):
    ix, q = open_index(train), open_index(queries)
    rows, ids = ix.rows(slice(None)).numpy(), list(ix.column("id"))
    usable = (ix.column("supervised_tokens") > 0) & ix.column("finite")
    norms = np.linalg.norm(rows, axis=1)
    qrows = q.rows(slice(None)).numpy()
    scores = (qrows / np.linalg.norm(qrows, axis=1, keepdims=True)) @ (rows / np.where(norms > 0, norms, 1)[:, None]).T
    scores[:, ~usable] = -np.inf  # no supervised token: no gradient, no place in the ranking
    out = {}
    for qi, qid in enumerate(q.column("id")):
        order = [j for j in np.argsort(-scores[qi], kind="stable") if usable[j]]
        out[str(qid)] = {
            "top": [(ids[j], float(scores[qi, j])) for j in order[:k]],
            "rank": {ids[j]: r + 1 for r, j in enumerate(order)},
            "all": [(ids[j], float(scores[qi, j])) for j in order],
        }
    return (
        out,
        dict(zip(ids, norms)),
        dict(zip(ids, ix.column("supervised_tokens"))),
        dict(zip(ids, ix.column("truncated_tokens"))),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/case-truncated")
    args = parser.parse_args()
    out = Path(args.out)
    data, queries = HERE / "long_completions.jsonl", HERE / "queries.jsonl"
    print("## What gradian index reports\n\n```")
    for n in (48, 128):
        print(index(data, out / f"train-{n}", n))
    print("```")
    index(queries, out / "queries", 128)
    small, n_small, sup_small, cut_small = ranking(out / "train-48", out / "queries")
    full, n_full, sup_full, _ = ranking(out / "train-128", out / "queries")
    print("\n## Gradient norms of the rows that were cut\n")
    a, b = open_index(out / "train-48"), open_index(out / "train-128")
    rows_a, rows_b = a.rows(slice(None)).numpy(), b.rows(slice(None)).numpy()
    same = {
        str(i): float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))) if np.linalg.norm(x) > 0 else float("nan")
        for i, x, y in zip(a.column("id"), rows_a, rows_b)
    }
    print(
        "| row | supervised tokens at 128 | at 48 | cut at 48 | gradient norm at 128 | at 48 | ratio | cosine of its row at 48 with its row at 128 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for rid in n_full:
        if cut_small[rid] > 0:
            print(
                f"| {rid} | {sup_full[rid]} | {sup_small[rid]} | {cut_small[rid]} | {n_full[rid]:.3g} | {n_small[rid]:.3g} | {n_small[rid] / n_full[rid]:.2f} | {same[rid]:.3f} |"
            )
    uncut = [same[r] for r in n_full if cut_small[r] == 0]
    print(
        f"\nRows that were not cut: cosine of their row at 48 with their row at 128 between {min(uncut):.4f} and {max(uncut):.4f}."
    )
    print("\n## Rankings: top 3 by cosine, and where each query's own rows land\n")
    print(
        "Each query asks for one country's capital. Its `-short` row answers it and is never cut (the control); its `-long` row"
    )
    print(
        "answers it in its last sentence, which max_seq_length=48 cuts; `pe-longprompt` and `no-longprompt` lose everything.\n"
    )
    print(
        "| query | top 3 at 128 | top 3 at 48 | rank of -short at 128 → 48 | rank of -long at 128 → 48 | cosine with -long at 128 → 48 | rank of -longprompt at 128 → 48 |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for qid in full:
        code = qid.split("-", 1)[1]
        fmt = lambda r: ", ".join(f"{i} ({s:.2f})" for i, s in r["top"])  # noqa: E731
        rank = lambda r, suffix, code=code: str(r["rank"].get(f"{code}-{suffix}", "excluded"))  # noqa: E731
        cos = lambda r, code=code: dict(r["all"]).get(f"{code}-long")  # noqa: E731
        lp = (
            f"{rank(full[qid], 'longprompt')} → {rank(small[qid], 'longprompt')}"
            if f"{code}-longprompt" in n_full
            else ""
        )
        print(
            f"| {qid} | {fmt(full[qid])} | {fmt(small[qid])} | {rank(full[qid], 'short')} → {rank(small[qid], 'short')} | "
            f"{rank(full[qid], 'long')} → {rank(small[qid], 'long')} | {cos(full[qid]):.3f} → {cos(small[qid]):.3f} | {lp} |"
        )


if __name__ == "__main__":
    main()
