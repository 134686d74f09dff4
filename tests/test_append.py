"""index.append: index 10 rows, then append 10 more, and the index equals one built over the 20 at
once (rows, ids, statistics, and the query's output); refusals name what differs."""

import json

import numpy as np
import pytest
import torch
from conftest import WORDS, make_model, tiny_settings, write_jsonl

from gradian_lightning import open_index
from gradian_lightning.errors import ConfigError, DataError
from gradian_lightning.index.location import LOCK_FILE
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.query import run_query

ROWS = [
    {"id": f"r{i}", "prompt": f"what is {WORDS[i]} ?", "completion": f" {WORDS[i + 20]} {WORDS[(3 * i) % 40]} ."}
    for i in range(20)
]


def settings(model, train, path, *extra):
    return tiny_settings(model, train, path, "grads.batch_size=3", "index.rows_per_chunk=5", *extra)


def contents(path):
    index = open_index(path)
    stats = index.statistics()
    columns = {name: index.column(name) for name in ("id", "loss", "supervised_tokens", "complete")}
    return index.rows(slice(None)), columns, stats


def eigen(path):
    """The stored eigendecomposition of each module's mean second moment: (eigvals, eigvecs)."""
    group = open_index(path).group["statistics"]
    return group["eigvals"][:], group["eigvecs"][:]


def answer(saved_model, tmp_path, path):
    queries = write_jsonl(tmp_path / "queries.jsonl", ROWS[3:5] + ROWS[15:16])
    cfg = settings(saved_model, "unused", path, f"query.data={queries}", "query.top_k=all", "query.bottom_k=0")
    got = run_query(cfg)
    return json.dumps(got["results"]), [got["train_rows"][i]["id"] for i in range(20)]


@pytest.mark.parametrize("storage", ["float16", "int8"])
def test_appending_ten_rows_equals_indexing_twenty(tmp_path, saved_model, storage):
    first, second, whole = (
        write_jsonl(tmp_path / n, r) for n, r in (("a.jsonl", ROWS[:10]), ("b.jsonl", ROWS[10:]), ("all.jsonl", ROWS))
    )
    dtype = f"grads.storage_dtype={storage}"
    run_index(settings(saved_model, whole, tmp_path / "once", dtype))
    run_index(settings(saved_model, first, tmp_path / "grown", dtype))
    summary = run_index(settings(saved_model, second, tmp_path / "grown", "index.append=true", dtype))
    assert summary["complete"] and summary["rows"] == 20 and summary["computed_rows"] == 10
    rows, columns, stats = contents(tmp_path / "grown")
    want_rows, want_columns, want_stats = contents(tmp_path / "once")
    assert torch.equal(rows, want_rows)
    for name, values in want_columns.items():
        np.testing.assert_array_equal(columns[name], values)
    assert stats.count == want_stats.count == 20
    # The same chunks added in the same order: the sums are the same to the bit.
    np.testing.assert_array_equal(stats.sumsq, want_stats.sumsq)
    for got, want in zip(eigen(tmp_path / "grown"), eigen(tmp_path / "once")):
        np.testing.assert_array_equal(got, want)
    got, texts = answer(saved_model, tmp_path, tmp_path / "grown")
    assert got == answer(saved_model, tmp_path, tmp_path / "once")[0]
    assert texts == [r["id"] for r in ROWS]  # row texts from both sources, by index position
    # Appending the same rows again does nothing; appending them again under new names is refused by id.
    again = run_index(settings(saved_model, second, tmp_path / "grown", "index.append=true", dtype))
    assert again["computed_rows"] == 0 and again["rows"] == 20
    repeated = write_jsonl(tmp_path / "c.jsonl", [{"id": "x", "text": "the sky"}, ROWS[4]])
    with pytest.raises(DataError, match=r"appended row id 'r4' is also the id of row 5 of the index"):
        run_index(settings(saved_model, repeated, tmp_path / "grown", "index.append=true", dtype))


def test_an_interrupted_append_resumes_and_queries_see_its_rows(tmp_path, saved_model):
    first, second, whole = (
        write_jsonl(tmp_path / n, r) for n, r in (("a.jsonl", ROWS[:10]), ("b.jsonl", ROWS[10:]), ("all.jsonl", ROWS))
    )
    run_index(settings(saved_model, whole, tmp_path / "once"))
    run_index(settings(saved_model, first, tmp_path / "grown"))
    cut = run_index(
        settings(saved_model, second, tmp_path / "grown", "index.append=true", "trainer.limit_val_batches=2")
    )
    assert not cut["complete"] and cut["rows"] == 16  # 10, then two batches of 3
    index = open_index(tmp_path / "grown")
    assert len(index) == 20 and int(index.column("complete").sum()) == 16
    with pytest.warns(UserWarning, match="16 of 20 rows are written, and only those are ranked"):
        results = run_query(
            settings(
                saved_model, "unused", tmp_path / "grown", f"query.data={first}", "query.top_k=all", "query.bottom_k=0"
            )
        )["results"]
    assert {r["index"] for r in results[0]["results"]} == set(range(16))  # every row written so far is ranked
    done = run_index(settings(saved_model, second, tmp_path / "grown", "index.append=true"))
    assert done["complete"] and done["kept_rows"] == 6 and done["computed_rows"] == 4
    rows, _, stats = contents(tmp_path / "grown")
    want_rows, _, want_stats = contents(tmp_path / "once")
    assert torch.equal(rows, want_rows)
    # read back in other groups of rows (another sum order): the same second moments, V diag(w) Vᵀ
    (w, v), (want_w, want_v) = eigen(tmp_path / "grown"), eigen(tmp_path / "once")
    moments = [
        np.einsum("mij,mj,mkj->mik", b.astype(np.float64), a, b.astype(np.float64))
        for a, b in ((w, v), (want_w, want_v))
    ]
    np.testing.assert_allclose(moments[0], moments[1], rtol=0, atol=1e-6 * np.abs(moments[1]).max())


def test_appending_with_other_weights_or_settings_is_refused(tmp_path, saved_model, tokenizer):
    first, second = write_jsonl(tmp_path / "a.jsonl", ROWS[:10]), write_jsonl(tmp_path / "b.jsonl", ROWS[10:])
    run_index(settings(saved_model, first, tmp_path / "ix"))
    with pytest.raises(ConfigError, match=r"differing: .*projection.dim \(4 -> 2\)"):
        run_index(settings(saved_model, second, tmp_path / "ix", "index.append=true", "grads.projection_dim=2"))
    make_model(len(tokenizer), seed=1).save_pretrained(saved_model)  # the same model, trained on (other weights)
    with pytest.raises(
        ConfigError,
        match=r"weights the index at .* was built from \(weights digest [0-9a-f]+\); this model's are [0-9a-f]+",
    ):
        run_index(settings(saved_model, second, tmp_path / "ix", "index.append=true"))
    assert len(open_index(tmp_path / "ix")) == 10 and open_index(tmp_path / "ix").meta.complete


def files_of(path):
    """Every file under `path` and its bytes: what a refused command must leave as it found it."""
    files = (p for p in sorted(path.rglob("*")) if p.is_file() and p.name != LOCK_FILE)  # the lock is no part of it
    return {str(p.relative_to(path)): p.read_bytes() for p in files}


def test_a_refused_append_leaves_the_index_as_it_found_it(tmp_path, saved_model):
    first, second = write_jsonl(tmp_path / "a.jsonl", ROWS[:10]), write_jsonl(tmp_path / "b.jsonl", ROWS[10:])
    run_index(settings(saved_model, first, tmp_path / "ix"))
    before, meta = files_of(tmp_path / "ix"), open_index(tmp_path / "ix").meta
    # The repeated id is the last appended row: a check at write time would grow the index first.
    repeated = write_jsonl(tmp_path / "c.jsonl", [{"id": "x", "text": "the sky"}, {"id": "y", "text": "a"}, ROWS[4]])
    with pytest.raises(DataError, match=r"appended row id 'r4' is also the id of row 5 of the index"):
        run_index(settings(saved_model, repeated, tmp_path / "ix", "index.append=true"))
    assert files_of(tmp_path / "ix") == before
    assert open_index(tmp_path / "ix").meta == meta and meta.complete and meta.num_rows == 10
    # Settings are checked before the first byte changes too.
    with pytest.raises(ConfigError, match=r"differing: .*projection.dim \(4 -> 2\)"):
        run_index(settings(saved_model, second, tmp_path / "ix", "index.append=true", "grads.projection_dim=2"))
    assert files_of(tmp_path / "ix") == before
    done = run_index(settings(saved_model, second, tmp_path / "ix", "index.append=true"))
    assert done["complete"] and done["rows"] == 20 and done["computed_rows"] == 10


def test_a_repeated_id_found_while_appending_from_python_restores_the_index(tmp_path, model, tokenizer):
    """GradientIndexer(append=True) meets the ids only as rows are written: the refusal undoes the
    growth, the rows already written into the old rows' last chunk included."""
    from test_session import SPEC, validate

    from gradian_lightning import GradientIndexer
    from gradian_lightning.data import JsonlDataset

    path = tmp_path / "ix"
    first = JsonlDataset(ROWS[:10], tokenizer, 24)
    validate(tmp_path, GradientIndexer(path, **SPEC.to_meta(), rows_per_chunk=3), model, first)
    before, meta = files_of(path), open_index(path).meta
    # Batches of 2: rows 10 and 11 fill the chunk of row 9 (flushed), then r4 comes in the second batch.
    repeated = JsonlDataset(ROWS[10:12] + [ROWS[12], ROWS[4]] + ROWS[13:15], tokenizer, 24)
    with pytest.raises(DataError, match=r"appended row id 'r4' is also the id of row 5 of the index"):
        validate(tmp_path, GradientIndexer(path, **SPEC.to_meta(), rows_per_chunk=3, append=True), model, repeated)
    assert files_of(path) == before and open_index(path).meta == meta
    indexer = GradientIndexer(path, **SPEC.to_meta(), rows_per_chunk=3, append=True)
    # 9 rows, not 10: without data metadata, 10 rows after 10 share the first run's fingerprint.
    validate(tmp_path, indexer, model, JsonlDataset(ROWS[10:19], tokenizer, 24))
    assert indexer.summary["complete"] and indexer.summary["rows"] == 19
    assert list(open_index(path).column("id")) == [r["id"] for r in ROWS[:19]]
    validate(
        tmp_path, GradientIndexer(tmp_path / "once", **SPEC.to_meta()), model, JsonlDataset(ROWS[:19], tokenizer, 24)
    )
    assert torch.equal(open_index(path).rows(slice(None)), open_index(tmp_path / "once").rows(slice(None)))
