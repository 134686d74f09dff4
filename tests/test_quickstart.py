"""The embedded default end to end (a short fit): index, answer the bundled queries, score recall."""

import json

from gradian_lightning import open_index
from gradian_lightning.data import read_jsonl
from gradian_lightning.recipes.quickstart import QUERIES, TRAIN, run_quickstart


def test_quickstart_answers_every_query_and_reports_recall_it_can_back(tmp_path):
    result = run_quickstart(tmp_path, epochs=1)
    queries, train = read_jsonl(QUERIES), read_jsonl(TRAIN)
    index = open_index(tmp_path / "index")
    assert result["summary"]["complete"] and len(index) == len(train)
    assert list(index.column("id")) == [r["id"] for r in train]
    written = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert written == result["results"] and [r["query_id"] for r in written] == [q["id"] for q in queries]
    for entry in written:
        assert [h["rank"] for h in entry["results"]] == list(range(1, 11))
        assert all(h["id"] == train[h["index"]]["id"] for h in entry["results"])
    # Recall recomputed from the written file and the answer key.
    for k in (1, 10):
        hits = sum(q["source"] in [h["id"] for h in entry["results"][:k]] for q, entry in zip(queries, written))
        assert result[f"recall@{k}"] == hits / len(queries)
    # One epoch already puts every planted source in the top 10 and most first (chance: 1/120 and 10/120).
    assert result["recall@10"] >= 0.9 and result["recall@1"] >= 0.5
