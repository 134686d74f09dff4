"""What `data.train` and `query.data` name, read by the `datasets` library as a `datasets.Dataset`.

A source is any of:
  - a data file: JSONL or JSON (`.jsonl`, `.json`), parquet, arrow, CSV (`.csv`, `.tsv`), each
    also gzip-, bz2-, xz- or zstd-compressed (`rows.jsonl.gz`);
  - a folder written by `Dataset.save_to_disk` (a `DatasetDict`'s with `folder:split`), or a
    folder of data files;
  - a Hugging Face hub name with a split, `name:split` (`train` when no split is given);
  - from Python, a `datasets.Dataset` itself.

A plain `.jsonl` file, the format the docs teach, is read without `datasets` (`JsonlRows`: by the
byte offset of each line); every other source by `datasets`, which reads files into memory-mapped
arrow tables (its cache). Either way a source of any size costs the same memory: rows are taken one at a time as the data loader asks for them and tokenised then
(`data.TokenizedRows`). `gradian index` reads them through `StreamedRows`, with plain reads, since
every page read through a memory map stays in the process's RSS. Columns named otherwise are mapped by `data.Fields` (`data.prompt_field`
...). The checks here read the schema and, batch by batch, the id column: one line of error before
a model loads, whatever the source's size.

A source's `fingerprint` is what an index records of it: the SHA-256 of a file's bytes, else the
`datasets` fingerprint (a saved folder's, stored with it; a hub dataset's, from its revision).
"""

from __future__ import annotations

import contextlib
import json
import os
from array import array
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from gradian_lightning.errors import DataError
from gradian_lightning.specs import Fields

# The datasets builder that reads each data file suffix (after a compression suffix, if any).
BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".tsv": "csv",
}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".zstd")


def builder_of(path: Path) -> Optional[str]:
    """The `datasets` builder for a data file's suffix (`rows.jsonl.gz`: json), or None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    # datasets draws a progress bar per split it converts; the index run has its own.
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _first_line(err: BaseException) -> str:
    # datasets wraps the reader's error (pyarrow's, json's) as the cause of a generic one.
    while err.__cause__ is not None and str(err).startswith("An error occurred while generating"):
        err = err.__cause__
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _split_of(dataset: Any, source: str, folder: str, split: Optional[str], key: str) -> Any:
    """One split of a `DatasetDict` saved at `folder` (`source` as the user wrote it, with its
    `:split` if any): `split`, else its only one, else "train"."""
    from datasets import DatasetDict

    if not isinstance(dataset, DatasetDict):
        return dataset
    names = list(dataset)
    chosen = split or (names[0] if len(names) == 1 else "train" if "train" in names else None)
    if chosen not in names:
        if split:  # the suggestion is the folder's own name with a split it has, not `source:another`
            raise DataError(
                f"setting '{key}'={source!r}: {folder!r} has no split {split!r}, only {names}; name one as {key}={folder}:{names[0]}"
            )
        raise DataError(f"setting '{key}'={source!r} holds the splits {names}; name one as {key}={folder}:{names[0]}")
    return dataset[chosen]


def _split_path(source: str) -> Tuple[str, Optional[str]]:
    """`folder:split` or `name:split` -> (folder or name, split); a path that exists is whole."""
    if os.path.exists(os.path.expanduser(source)) or ":" not in source:
        return source, None
    head, _, split = source.rpartition(":")
    return head, split or None


def load_source(source: Any, key: str = "data.train") -> Any:
    """The rows that `source` names (see the module docstring): `JsonlRows` for a plain `.jsonl`
    file, else a `datasets.Dataset`; `DataError` in one line naming `key` when it cannot be read.
    A `datasets.Dataset` is returned as it is."""
    if not isinstance(source, (str, Path)):
        import datasets

        if isinstance(source, datasets.Dataset):
            return source
        if isinstance(source, (datasets.DatasetDict, datasets.IterableDataset, datasets.IterableDatasetDict)):
            raise DataError(
                f"{key} is a {type(source).__name__}; pass one split as a datasets.Dataset (an IterableDataset has no length, and rows land at their positions)"
            )
    check_source_path(source, key)
    text, split = _split_path(str(source))
    path = Path(os.path.expanduser(text))
    if path.is_file() and [s.lower() for s in path.suffixes[-1:]] == [".jsonl"]:
        return JsonlRows(path)
    import datasets

    with _quiet_datasets():
        if path.is_file():
            return _load_file(path, builder_of(path), key)
        if path.is_dir():
            if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
                return _split_of(datasets.load_from_disk(str(path)), str(source), text, split, key)
            return _load(lambda: datasets.load_dataset(str(path), split=split or "train"), source, key)
        return _load(lambda: datasets.load_dataset(text, split=split or "train"), source, key)


def check_source_path(source: Any, key: str = "data.train") -> None:
    """The checks of `load_source` that need only the disk (no `datasets`, no torch: the CLI makes
    them first): a file of a type gradian reads, or a path that is there. A hub name, and anything
    that is not a str or Path, passes."""
    if not isinstance(source, (str, Path)):
        return
    text, _ = _split_path(str(source))
    path = Path(os.path.expanduser(text))
    if path.is_file() and builder_of(path) is None:
        raise DataError(
            f"setting '{key}'={str(source)!r}: the file type {''.join(path.suffixes) or '(none)'} is not one gradian reads; use JSONL, JSON, parquet, arrow or CSV (optionally .gz)"
        )
    if not path.exists() and (builder_of(path) is not None or os.sep in text or text.startswith(".")):
        raise DataError(f"data file {text!r} does not exist; check {key}")


def _load(read: Any, source: Any, key: str) -> Any:
    try:
        return read()
    except Exception as err:  # FileNotFoundError, DatasetNotFoundError, ConnectionError, ...
        raise DataError(
            f"setting '{key}'={str(source)!r} could not be read by datasets ({_first_line(err)}); give a data file, a save_to_disk folder or a hub name:split that is cached or reachable"
        ) from None


def _load_file(path: Path, builder: str, key: str) -> Any:
    import datasets
    import pyarrow

    try:
        if builder == "arrow":  # memory-mapped where it lies, no copy into the cache
            return datasets.Dataset.from_file(str(path))
        options = {"delimiter": "\t"} if builder == "csv" and ".tsv" in [s.lower() for s in path.suffixes] else {}
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
        # A first read converts the file to arrow; arrow's allocator keeps the pages it freed
        # (40 MB of 10^5 JSONL rows) unless told to give them back.
        pyarrow.default_memory_pool().release_unused()
        return dataset
    except Exception as err:
        if builder == "json" and not path.name.lower().endswith(COMPRESSIONS):
            from gradian_lightning.data import read_jsonl  # torch: only on this failure

            read_jsonl(path)  # a bad line: raises DataError with its number and what is wrong
        raise DataError(
            f"data file {str(path)!r} could not be read as {builder} ({_first_line(err)}); check {key} and the file's format"
        ) from None


def _kind(value: Any) -> str:
    # What a JSON value is, as `check_columns` asks of a column (a chat is a list of turns with text).
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        return type(value).__name__
    if isinstance(value, int):
        return "int"
    chat = all(isinstance(t, dict) and isinstance(t.get("content"), str) for t in value)
    return "messages" if chat else "list"


class JsonlRows:
    """The rows of a plain `.jsonl` file: `rows[i]` is the JSON object on its i-th non-blank line.

    Why not `datasets` for the format the docs teach: importing it (with pyarrow and pandas) costs
    a command 80 MiB of RSS and 1.3 s of CPU (a small SmolLM2 index's whole process peaked at 0.67×
    a plain training process's with it, 0.64× without: benchmarks/RESULTS.md §1b), and a JSONL file
    needs no arrow table.
    One pass at opening parses every line (a malformed one is an error naming it), keeps each row's
    byte offset (8 bytes a row) and, per column, the first row holding each kind of value
    (`kinds`), which `check_columns` reads as it reads a `datasets` schema. A row is then one seek
    and one `json.loads`: no memory map whose pages stay in RSS (`StreamedRows`), no cache on disk.
    A key a row lacks reads as null, as in a `datasets` table.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        starts = array("q")
        self.kinds: Dict[str, Dict[str, int]] = {}  # column -> kind of value -> first row holding one
        try:
            with open(self.path, "rb") as file:
                at = 0
                for number, line in enumerate(file, start=1):
                    start, at = at, at + len(line)
                    if line.strip():
                        for column, value in self._parse(line, number).items():
                            self.kinds.setdefault(column, {}).setdefault(_kind(value), len(starts))
                        starts.append(start)
        except OSError as err:
            raise DataError(
                f"data file {str(self.path)!r} cannot be read ({type(err).__name__}: {err.strerror}); fix its permissions"
            ) from None
        self.size = at
        self.starts = np.frombuffer(starts, dtype=np.int64).copy() if len(starts) else np.zeros(0, np.int64)
        self.column_names = list(self.kinds)  # in the order rows first name them
        self._file: Any = None
        self._pid = -1

    def _parse(self, line: bytes, number: int) -> Dict[str, Any]:
        try:
            row = json.loads(line)
        except UnicodeDecodeError:
            raise DataError(f"{self.path}:{number}: not UTF-8 text; save the file as UTF-8") from None
        except json.JSONDecodeError as err:
            raise DataError(
                f"{self.path}:{number}: malformed JSON ({err.msg}); each line must be one JSON object"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{self.path}:{number}: expected a JSON object per line, got {type(row).__name__}")
        return row

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        if self._file is None or self._pid != os.getpid():  # a data-loader worker opens its own
            self._file, self._pid = open(self.path, "rb"), os.getpid()  # noqa: SIM115 (kept open between rows)
        end = int(self.starts[i + 1]) if i + 1 < len(self) else self.size
        self._file.seek(int(self.starts[i]))
        return {**dict.fromkeys(self.column_names), **json.loads(self._file.read(end - int(self.starts[i])))}

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": -1}  # a process that unpickles it opens the file

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()

    def column(self, name: str, size: int) -> Iterator[List[Any]]:
        """The values of column `name` (None where a row lacks it), `size` rows at a time, read forward."""
        batch: List[Any] = []
        with open(self.path, "rb") as file:
            for line in file:
                if line.strip():
                    batch.append(json.loads(line).get(name))
                    if len(batch) == size:
                        yield batch
                        batch = []
        if batch:
            yield batch


def fingerprint_of(source: Any, dataset: Any) -> str:
    """What an index records of a source: the SHA-256 of a file's bytes (it changes exactly when
    they do), else the dataset's `datasets` fingerprint."""
    from gradian_lightning.hub import file_sha256

    if isinstance(source, (str, Path)):
        path = Path(os.path.expanduser(_split_path(str(source))[0]))
        if path.is_file():
            return file_sha256(path)
    return str(dataset._fingerprint)


def describe_source(source: Any, dataset: Any) -> Dict[str, Any]:
    """The index metadata of a source: "path" (resolved, or None for a Python Dataset), "fingerprint",
    "num_rows", and for a file "sha256" (the same as its fingerprint)."""
    from gradian_lightning.hub import normalized_name

    path = None if not isinstance(source, (str, Path)) else normalized_name(str(source))
    out = {"path": path, "fingerprint": fingerprint_of(source, dataset), "num_rows": len(dataset)}
    if path is not None and Path(_split_path(path)[0]).is_file():
        out["sha256"] = out["fingerprint"]
    return out


def _arrow_type_ok(feature: Any, wanted: str) -> bool:
    from datasets import Json, LargeList, List, Value

    if wanted == "string":
        return isinstance(feature, Value) and feature.dtype in ("string", "large_string")
    if wanted == "id":
        return isinstance(feature, Json) or (
            isinstance(feature, Value) and (feature.dtype in ("string", "large_string") or "int" in feature.dtype)
        )
    if wanted == "messages":  # a list of {"role", "content"} structs, or mixed (Json)
        if isinstance(feature, Json):
            return True
        inner = getattr(feature, "feature", None) if isinstance(feature, (List, LargeList)) else None
        return isinstance(inner, dict) and _arrow_type_ok(inner.get("content"), "string")
    return False


# The kinds of JSON value each column type takes (`_kind`); null is an absent value.
JSON_KINDS = {"string": {"string", "null"}, "id": {"string", "int", "null"}, "messages": {"messages", "null"}}
ALLOWED = {"string": "strings", "id": "strings or integers", "messages": 'lists of {"role": ..., "content": "text"}'}


def _check_json_kinds(rows: JsonlRows, column: str, what: str, wanted: str, name: str) -> None:
    # The first row whose value in `column` is not of a kind `wanted` takes, named with its value.
    bad = [row for kind, row in rows.kinds[column].items() if kind not in JSON_KINDS[wanted]]
    if bad:
        value = json.dumps(rows[min(bad)][column])
        value = value if len(value) <= 40 else value[:39] + "…"
        raise DataError(
            f"{name} row {min(bad) + 1}: column {column!r} (data.{what}) holds {value}; it must hold {ALLOWED[wanted]}"
        )


def _likely(part: str, columns: List[str], id_column: str) -> str:
    """The column most likely meant for `part` (prompt, completion, ...): its default name when
    present, else the first column that is not the id."""
    return part if part in columns else next((c for c in columns if c != id_column), columns[0])


def check_columns(dataset: Any, fields: Fields, name: str) -> None:
    """`DataError` unless the mapped columns of `dataset` make one of the row formats, each of the
    type it must have. Reads only the schema; rows without a format fail when tokenised."""
    columns = set(dataset.column_names)
    formats = {
        "prompt+completion": (fields.prompt, fields.completion),
        "messages": (fields.messages,),
        "text": (fields.text,),
    }
    if not any(all(c in columns for c in cols) for cols in formats.values()):
        # A column the user mapped (data.prompt_field=question) that is not there is the mistake to name.
        default = Fields()
        for part in vars(fields):
            column = getattr(fields, part)
            if column != getattr(default, part) and column not in columns and part != "id":
                raise DataError(
                    f"{name} has no column {column!r} (data.{part}_field); its columns are {sorted(columns)}: set data.{part}_field to one of them, e.g. data.{part}_field={_likely(part, sorted(columns), fields.id)}"
                )
        raise DataError(
            f"{name} has columns {sorted(columns)}; expected prompt+completion, messages, or text: map yours with data.prompt_field, data.completion_field, data.messages_field or data.text_field"
        )
    setting = {
        fields.prompt: ("prompt_field", "string"),
        fields.completion: ("completion_field", "string"),
        fields.text: ("text_field", "string"),
        fields.messages: ("messages_field", "messages"),
        fields.id: ("id_field", "id"),
    }
    for column, (what, wanted) in setting.items():
        if column not in columns:
            continue
        if isinstance(dataset, JsonlRows):
            _check_json_kinds(dataset, column, what, wanted, name)
            continue
        feature = dataset.features[column]
        if getattr(feature, "dtype", None) == "null":
            continue  # every value null: no row takes this format, each is checked when tokenised
        if not _arrow_type_ok(feature, wanted):
            raise DataError(f"{name}: column {column!r} (data.{what}) holds {feature}; it must hold {ALLOWED[wanted]}")


def ids_of(dataset: Any, fields: Fields) -> Iterator[List[Any]]:
    """The id column of `dataset`, `ID_BATCH` values at a time (no batches when it has none)."""
    from gradian_lightning.data import ID_BATCH  # torch: only once rows are read

    if fields.id not in dataset.column_names:
        return
    if isinstance(dataset, JsonlRows):
        yield from dataset.column(fields.id, ID_BATCH)
        return
    column = dataset.select_columns([fields.id])
    for lo in range(0, len(dataset), ID_BATCH):
        yield column[lo : lo + ID_BATCH][fields.id]


def first_repeat(hashes: np.ndarray, id_at: Any) -> Optional[Tuple[int, int]]:
    """(earlier, later) positions of the first repeated id in `hashes` (`id_hashes`), ordered by
    the later row, or None. `id_at(position)` gives an id's string, to rule out hash collisions."""
    ranked = np.sort(hashes)  # no repeat, the common case, costs this one copy (8 bytes a row)
    if not np.any((ranked[1:] == ranked[:-1]) & (ranked[1:] != -1)):
        return None
    order = np.argsort(hashes, kind="stable")
    ranked = hashes[order]
    same = np.flatnonzero((ranked[1:] == ranked[:-1]) & (ranked[1:] != -1))
    best: Optional[Tuple[int, int]] = None
    for j in same:  # a run of one hash: compare each member with the earlier ones of its run
        later = int(order[j + 1])
        k = j
        while k >= 0 and ranked[k] == ranked[j + 1]:
            earlier = int(order[k])
            if id_at(earlier) == id_at(later) and (best is None or later < best[1]):
                best = (earlier, later)
            k -= 1
    return best


def check_unique_ids(dataset: Any, fields: Fields, name: str) -> None:
    """`DataError` naming the first repeated id of `dataset`: ids name rows in results."""
    from gradian_lightning.data import id_hashes  # torch: only once rows are read

    if fields.id not in dataset.column_names:
        return
    repeat = first_repeat(id_hashes(ids_of(dataset, fields), len(dataset)), lambda i: str(dataset[i][fields.id]))
    if repeat is not None:
        earlier, later = repeat
        raise DataError(
            f"{name} row {later + 1}: id {str(dataset[later][fields.id])!r} is also the id of row {earlier + 1}; ids name rows in results, so each must be unique"
        )


def open_rows(source: Any, fields: Fields, key: str = "data.train") -> Any:
    """`load_source`, then the checks that need no model: the columns and the ids. Returns the Dataset."""
    dataset = load_source(source, key)
    name = str(source) if isinstance(source, (str, Path)) else key
    if len(dataset) == 0:
        raise DataError(f"{key} {name!r} has no rows; it needs at least one")
    check_columns(dataset, fields, name)
    check_unique_ids(dataset, fields, name)
    return dataset


class IndexedRows:
    """The data rows an index was built from, by index position, read back from their sources
    (one `datasets.Dataset` per appended source, memory-mapped): `rows[i]` is row i under gradian's
    names (`Fields.row`). Built by `indexed_rows`, which checks each source is unchanged."""

    def __init__(self, parts: Sequence[Tuple[int, Any]], fields: Fields) -> None:
        self.parts, self.fields = list(parts), fields  # (offset, Dataset), by offset
        self.total = sum(len(d) for _, d in self.parts)

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> Dict[str, Any]:
        offset, dataset = next(part for part in reversed(self.parts) if i >= part[0])  # the first starts at 0
        return self.fields.row(dataset[int(i) - offset])


def indexed_rows(
    segments: Sequence[Dict[str, Any]], fields: Fields, train: Any = None
) -> Tuple[Optional[IndexedRows], str]:
    """(`IndexedRows` of an index whose rows came from `segments` (`IndexMeta.data_segments`), "")
    when every source it was built from is
    still there and unchanged, else (None, why not, in words). `train`: a Python `datasets.Dataset`
    to use for a source recorded without a path, when its fingerprint matches."""
    parts = []
    for segment in segments:
        data = segment["data"]
        recorded = data.get("fingerprint") or data.get("sha256")
        path = data.get("path")
        if path is None:
            if train is None or recorded != fingerprint_of(train, load_source(train)):
                return None, "its rows came from a Python Dataset; pass the same one to see their texts"
            parts.append((int(segment["offset"]), load_source(train)))
            continue
        try:
            dataset = load_source(path, "data.train")
        except DataError:
            return None, f"the training data {path!r} it was built from cannot be read any more"
        if fingerprint_of(path, dataset) != recorded or len(dataset) != int(segment["rows"]):
            return (
                None,
                f"the training data {path!r} changed after it was indexed (fingerprint {recorded} then, {fingerprint_of(path, dataset)} now)",
            )
        parts.append((int(segment["offset"]), dataset))
    return IndexedRows(parts, fields), ""


class StreamedRows:
    """The rows of a `datasets.Dataset` that is exactly its arrow files, read forward one record
    batch at a time with plain file reads: `rows[i]` is the dict `dataset[i]` is.

    `datasets` memory-maps its arrow files, and every page read through a map stays in the
    process's RSS while the map is open: indexing 10^6 short rows held the whole 57 MB file there,
    past the 10% that peak RSS may grow from 10^4 rows (benchmarks/RESULTS.md §9). The loader asks
    for rows in increasing order (every W-th under a distributed sampler), so one batch is held at a
    time; asking for an earlier row (a sampler's padding at the end) reads the files again from the
    start. Built by `streamed_rows`.
    """

    def __init__(self, files: Sequence[str], features: Any, num_rows: int) -> None:
        from datasets.formatting import PythonFormatter

        self.files, self.num_rows = list(files), num_rows
        self._format = PythonFormatter(features=features)
        self._batches: Optional[Iterator[Any]] = None
        self._batch, self._start = None, 0  # the record batch held and the position of its first row

    def __len__(self) -> int:
        return self.num_rows

    def _read(self) -> Iterator[Any]:
        import pyarrow as pa

        for name in self.files:
            with pa.OSFile(name) as source:
                yield from pa.ipc.open_stream(source)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        i = int(i)
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} of {self.num_rows}")
        if self._batch is None or i < self._start:
            self._batches, self._batch, self._start = self._read(), None, 0
        while self._batch is None or i >= self._start + self._batch.num_rows:
            if self._batch is not None:
                self._start += self._batch.num_rows
            self._batch = next(self._batches)
        import pyarrow as pa

        return self._format.format_row(pa.Table.from_batches([self._batch.slice(i - self._start, 1)]))


def streamed_rows(dataset: Any) -> Any:
    """`StreamedRows` of `dataset` when it is exactly the arrow files it was read from (no
    selection or order of its own, no output format), else `dataset` itself, read through its map.

    The caller drops its own reference to `dataset`, so that the map closes and its pages leave RSS."""
    if isinstance(dataset, JsonlRows):
        return dataset  # read by line offsets already
    import pyarrow as pa

    files = [entry["filename"] for entry in dataset.cache_files]
    if not files or dataset._indices is not None or dataset.format["type"] is not None:
        return dataset
    rows = 0
    for name in files:
        with pa.OSFile(name) as source:
            reader = pa.ipc.open_stream(source)
            if not reader.schema.equals(dataset.data.schema, check_metadata=False):
                return dataset  # columns selected or cast after reading: the files hold others
            rows += sum(batch.num_rows for batch in reader)  # one read of the files, a batch at a time
    # A contiguous `select` slices the table and keeps the files: then the counts differ.
    return StreamedRows(files, dataset.features, rows) if rows == len(dataset) else dataset
