"""Integration: `gradian index` on the real SmolLM2-135M-Instruct (skipped when it cannot be built)."""

import json

import numpy as np
import pytest
from smollm2 import ROOT, smollm2_dir

from gradian_lightning import open_index
from gradian_lightning.cli import main

pytestmark = pytest.mark.slow  # the real SmolLM2-135M


def test_index_and_query_smollm2_down_proj(tmp_path, capsys):
    model = smollm2_dir()
    argv = [
        "index",
        str(ROOT / "configs" / "smollm2.yaml"),
        f"model.name_or_path={model}",
        f"data.train={ROOT / 'tests/data/prompt_completion.jsonl'}",
        f"index.path={tmp_path / 'ix'}",
        "grads.module_filter=down_proj",
        "grads.projection_dim=16",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    index = open_index(tmp_path / "ix")
    rows = index.rows(slice(None)).numpy()
    assert rows.shape == (16, 30 * 16 * 16) and index.meta.complete
    assert np.isfinite(rows).all() and (np.abs(rows).sum(axis=1) > 0).all()
    assert (index.column("supervised_tokens") > 0).all() and index.column("finite").all()

    # Query it: two training rows (each must find itself first) and the paraphrases of tests/data/queries.jsonl.
    train = [json.loads(line) for line in (ROOT / "tests/data/prompt_completion.jsonl").read_text().splitlines()]
    paraphrases = [json.loads(line) for line in (ROOT / "tests/data/queries.jsonl").read_text().splitlines()]
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in [train[0], train[10]] + paraphrases))
    out = tmp_path / "results.jsonl"
    assert (
        main(["query", *argv[1:], f"query.data={queries}", "query.top_k=5", "query.bottom_k=1", f"query.output={out}"])
        == 0
    ), capsys.readouterr().err
    printed = capsys.readouterr().out
    results = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["id"] for r in train]
    assert [r["query_id"] for r in results] == ["fr", "py"] + [q["id"] for q in paraphrases]
    for result in results:
        assert [h["rank"] for h in result["results"]] == [1, 2, 3, 4, 5] and len(result["opponents"]) == 1
        assert all(h["id"] == ids[h["index"]] for h in result["results"] + result["opponents"])
    assert results[0]["results"][0]["id"] == "fr" and results[1]["results"][0]["id"] == "py"
    assert results[0]["results"][0]["score"] > 0.99
    assert "query q-capital-fr: Which city is the capital of France? → Paris is the capital of France." in printed
    print({r["query_id"]: [(h["id"], round(h["score"], 3)) for h in r["results"][:3]] for r in results})
