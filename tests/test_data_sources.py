"""data.train as Hugging Face users hold it: each format `datasets` reads indexes the same rows as
its JSONL twin, compared on the stored rows, ids, losses and token counts."""

import gzip
import json
import pickle
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
from conftest import ROWS, tiny_settings, write_jsonl

from gradian_lightning import open_index
from gradian_lightning.data import Fields, id_hashes
from gradian_lightning.data_sources import JsonlRows, StreamedRows, first_repeat, ids_of, open_rows, streamed_rows
from gradian_lightning.errors import DataError
from gradian_lightning.recipes.index import run_index

# CSV holds no nested column, so its twin has no messages row.
FLAT = [r for r in ROWS if "messages" not in r]


def settings(model, train, path, *extra):
    return tiny_settings(model, train, path, "grads.batch_size=3", *extra)


def stored(path):
    index = open_index(path)
    return (
        index.rows(slice(None)),
        list(index.column("id")),
        index.column("loss"),
        index.column("supervised_tokens"),
    )


def assert_same_rows(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1] == want[1]
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[3], want[3])


def as_dataset(rows):
    # Dataset.from_list takes its columns from the first row: give every row every column.
    columns = sorted({k for r in rows for k in r})
    return datasets.Dataset.from_list([{k: r.get(k) for k in columns} for r in rows])


def twin(tmp_path, name, rows, write):
    path = tmp_path / name
    write(path, as_dataset(rows))
    return path


WRITERS = {
    "rows.jsonl.gz": lambda p, d: p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in d).encode())),
    "rows.json": lambda p, d: p.write_text(json.dumps([{k: v for k, v in r.items() if v is not None} for r in d])),
    "rows.parquet": lambda p, d: d.to_parquet(str(p)),
    "saved": lambda p, d: d.save_to_disk(str(p)),
    "saved/data-00000-of-00001.arrow": lambda p, d: d.save_to_disk(str(p.parent)),
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_each_format_indexes_the_rows_of_its_jsonl_twin(tmp_path, saved_model, name):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    run_index(settings(saved_model, jsonl, tmp_path / "want"))
    other = twin(tmp_path, name, ROWS, WRITERS[name])
    run_index(settings(saved_model, other, tmp_path / "got"))
    assert_same_rows(stored(tmp_path / "got"), stored(tmp_path / "want"))
    assert stored(tmp_path / "want")[1][4] == "4"  # the row without an id: its position


def test_csv_and_a_python_dataset_and_mapped_columns(tmp_path, saved_model):
    jsonl = write_jsonl(tmp_path / "flat.jsonl", FLAT)
    run_index(settings(saved_model, jsonl, tmp_path / "want"))
    want = stored(tmp_path / "want")
    csv = twin(tmp_path, "flat.csv", FLAT, lambda p, d: d.to_csv(str(p), index=False))
    run_index(settings(saved_model, csv, tmp_path / "csv"))
    assert_same_rows(stored(tmp_path / "csv"), want)
    # From Python: the Dataset itself, wherever a data path goes.
    run_index(settings(saved_model, jsonl, tmp_path / "python"), train=as_dataset(FLAT))
    assert_same_rows(stored(tmp_path / "python"), want)
    # A dataset whose columns are named otherwise, mapped by the data.*_field settings.
    renamed = [
        {{"prompt": "question", "completion": "answer", "id": "key"}.get(k, k): v for k, v in r.items()} for r in FLAT
    ]
    other = write_jsonl(tmp_path / "renamed.jsonl", renamed)
    extra = ("data.prompt_field=question", "data.completion_field=answer", "data.id_field=key")
    run_index(settings(saved_model, other, tmp_path / "mapped", *extra))
    assert_same_rows(stored(tmp_path / "mapped"), want)


def test_bad_sources_are_one_line(tmp_path):
    fields = Fields()
    with pytest.raises(DataError, match="does not exist"):
        open_rows(tmp_path / "nope.parquet", fields)
    with pytest.raises(DataError, match=r"file type \.txt is not one gradian reads"):
        open_rows(write_jsonl(tmp_path / "rows.txt", ROWS), fields)
    odd = tmp_path / "odd.parquet"
    datasets.Dataset.from_list([{"question": "q", "answer": "a"}]).to_parquet(str(odd))
    with pytest.raises(DataError, match=r"columns \['answer', 'question'\]; expected .* data.prompt_field"):
        open_rows(odd, fields)
    numbers = tmp_path / "numbers.parquet"
    datasets.Dataset.from_list([{"text": 5}]).to_parquet(str(numbers))
    with pytest.raises(DataError, match=r"column 'text' \(data.text_field\) holds .*int64.*; it must hold strings"):
        open_rows(numbers, fields)
    twice = tmp_path / "twice.parquet"
    datasets.Dataset.from_list(
        [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}, {"id": "a", "text": "z"}]
    ).to_parquet(str(twice))
    with pytest.raises(DataError, match=r"row 3: id 'a' is also the id of row 1"):
        open_rows(twice, fields)
    saved = tmp_path / "dict"
    datasets.DatasetDict(
        {"a": datasets.Dataset.from_list(ROWS[:2]), "b": datasets.Dataset.from_list(ROWS[2:3])}
    ).save_to_disk(str(saved))
    with pytest.raises(DataError, match=r"holds the splits \['a', 'b'\]; name one as data.train=.*dict:a"):
        open_rows(saved, fields)
    assert len(open_rows(f"{saved}:b", fields)) == 1


def test_repeated_ids_are_found_by_their_hashes_not_guessed():
    ids = ["x", "y", 7, "7", None, None, "z", "y"]
    # 7 and "7" are one id (stored as "7"); rows without an id never repeat one.
    assert first_repeat(id_hashes(iter([ids]), len(ids)), lambda i: str(ids[i])) == (2, 3)
    colliding = np.array([5, 5, 5], dtype=np.int64)  # one hash, three different ids: no repeat
    assert first_repeat(colliding, lambda i: "abc"[i]) is None


def test_streamed_rows_are_the_datasets_rows_in_any_order_the_loader_asks(tmp_path):
    # Two arrow files of 4-row record batches, with a chat column: every row read forward, strided
    # (a distributed sampler) and backwards (its padding) must be the dict datasets gives for it.
    rows = [{**r, "id": f"r{i}"} for i, r in enumerate(ROWS * 3)]
    half = len(rows) // 2
    parts = [
        as_dataset(part).map(lambda r: r, cache_file_name=str(tmp_path / f"{i}.arrow"), writer_batch_size=4)
        for i, part in enumerate((rows[:half], rows[half:]))
    ]
    dataset = datasets.concatenate_datasets(parts)
    assert len(dataset.cache_files) == 2 and len(dataset.data.to_batches()) > 4
    streamed = streamed_rows(dataset)
    assert isinstance(streamed, StreamedRows) and len(streamed) == len(dataset)
    order = [*range(len(dataset)), *range(1, len(dataset), 3), *reversed(range(len(dataset)))]
    assert [streamed[i] for i in order] == [dataset[i] for i in order]


def test_a_dataset_that_is_not_its_files_is_read_as_it_is(tmp_path):
    rows = [{**r, "id": f"r{i}"} for i, r in enumerate(ROWS * 2)]
    as_dataset(rows).save_to_disk(str(tmp_path / "saved"))
    dataset = datasets.load_from_disk(str(tmp_path / "saved"))
    for view in (
        dataset.shuffle(seed=0),  # an indices mapping
        dataset.select(range(2, 5)),  # a contiguous slice of the same file
        dataset.select_columns(["id", "text"]),  # fewer columns than the file holds
        dataset.with_format("numpy"),
        as_dataset(rows),  # in memory: no files
    ):
        assert streamed_rows(view) is view


def test_a_jsonl_file_is_read_without_datasets_and_gives_its_rows(tmp_path):
    # JsonlRows against datasets' own reading of the same file: every row, in any order a loader
    # asks (a key a row lacks reads as null in both), after pickling (a data-loader worker), and
    # the ids in batches; a blank line is no row.
    rows = [{**r, "id": f"r{i}"} for i, r in enumerate(ROWS * 3)]
    rows[4].pop("id")  # a row without an id
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + ("\n\n" if i == 2 else "\n") for i, r in enumerate(rows)))
    want = datasets.load_dataset("json", data_files=str(path), split="train")
    got = open_rows(path, Fields())
    assert isinstance(got, JsonlRows) and len(got) == len(want) == len(rows)
    assert sorted(got.column_names) == sorted(want.column_names)
    order = [*range(len(rows)), *reversed(range(len(rows))), 5, 1, -1]
    assert [got[i] for i in order] == [want[i % len(rows)] for i in order]
    assert list(pickle.loads(pickle.dumps(got))) == list(want)
    assert [v for batch in ids_of(got, Fields()) for v in batch] == want["id"]
    assert streamed_rows(got) is got  # already read by line, no memory map to close
    # The whole index path: no datasets, no pyarrow in the process (their import is 80 MiB and 1.3 s).
    code = (
        "import sys; from gradian_lightning.data_sources import open_rows, streamed_rows; "
        "from gradian_lightning.specs import Fields; "
        f"rows = streamed_rows(open_rows({str(path)!r}, Fields())); [rows[i] for i in range(len(rows))]; "
        "print(sorted(m for m in ('datasets', 'pyarrow', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_jsonl_files_mistakes_name_the_line_or_row(tmp_path):
    fields = Fields()

    def write(name, text):
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path

    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        open_rows(write("bad.jsonl", '{"text": "a"}\n\n{"text": \n'), fields)
    with pytest.raises(DataError, match=r"list\.jsonl:2: expected a JSON object per line, got list"):
        open_rows(write("list.jsonl", '{"text": "a"}\n["text"]\n'), fields)
    with pytest.raises(DataError, match=r"latin\.jsonl:2: not UTF-8 text; save the file as UTF-8"):
        open_rows(write("latin.jsonl", '{"text": "a"}\n{"text": "caf\xe9"}\n'.encode("latin-1")), fields)
    # A value of the wrong kind: the first row that holds one, with the value (datasets refuses a
    # column of mixed kinds without naming a row).
    with pytest.raises(
        DataError, match=r"mixed\.jsonl row 3: column 'text' \(data.text_field\) holds 5; it must hold strings"
    ):
        open_rows(write("mixed.jsonl", '{"text": "a"}\n{"text": null}\n{"text": 5}\n{"text": [1]}\n'), fields)
    with pytest.raises(DataError, match=r"row 2: column 'messages' \(data.messages_field\) holds \[\{\"role\""):
        open_rows(write("chat.jsonl", '{"text": "a"}\n{"messages": [{"role": "user", "content": 1}]}\n'), fields)
    with pytest.raises(
        DataError, match=r"row 1: column 'id' \(data.id_field\) holds 1.5; it must hold strings or integers"
    ):
        open_rows(write("ids.jsonl", '{"id": 1.5, "text": "a"}\n'), fields)
    with pytest.raises(DataError, match=r"empty\.jsonl'? has no rows"):
        open_rows(write("empty.jsonl", "\n\n"), fields)
    mixed_ids = open_rows(write("fine.jsonl", '{"id": 7, "text": "a"}\n{"id": "x", "text": "b"}\n'), fields)
    assert [mixed_ids[0]["id"], mixed_ids[1]["id"]] == [7, "x"]  # ids compare by their string form
