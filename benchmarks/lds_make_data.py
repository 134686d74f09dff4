"""The LDS sets of benchmarks/lds_data/ (run once; the JSONL files are committed).

    PYTHONPATH=. python benchmarks/lds_make_data.py

Each set is 80 training rows and 24 queries cut from a planted-source set of benchmarks/ranking_data/
(ranking_make_data.py): the queries' planted sources, then other rows of the set, in the set's
order. Small enough that `gradian validate` retrains SmolLM2-135M on 24 half-subsets on a 2-core
CPU in minutes, and the same queries carry planted sources, so one set answers both measures.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "ranking_data"
OUT = Path(__file__).resolve().parent / "lds_data"
KINDS = ("fact", "newword")
ROWS, QUERIES = 80, 24


def cut(kind: str) -> None:
    train = [json.loads(line) for line in (DATA / f"{kind}.train.jsonl").read_text().splitlines()]
    queries = [json.loads(line) for line in (DATA / f"{kind}.queries.jsonl").read_text().splitlines()][:QUERIES]
    sources = {s for q in queries for s in q["sources"]}
    kept = [r for r in train if r["id"] in sources]
    kept += [r for r in train if r["id"] not in sources][: ROWS - len(kept)]
    order = {r["id"]: i for i, r in enumerate(train)}
    kept.sort(key=lambda r: order[r["id"]])
    OUT.mkdir(exist_ok=True)
    (OUT / f"{kind}.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (OUT / f"{kind}.queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    print(f"{kind}: {len(kept)} rows, {len(queries)} queries, {len(sources)} sources")


if __name__ == "__main__":
    for kind in KINDS:
        cut(kind)
