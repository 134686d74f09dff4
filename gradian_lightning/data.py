"""Data rows -> tokenized examples -> padded batches.

Rows come from a list of dicts (`read_jsonl`) or a `datasets.Dataset` (data_sources.py reads any
file, folder or hub name into one). Each row is one of three formats, detected per row:
  - `prompt` + `completion`: the completion is supervised (and the EOS token after it);
  - `messages`: rendered with the tokenizer's chat template; assistant turns are supervised;
  - `text`: every token is supervised.
An optional `id` column names the row in results (ids compare by their string form everywhere:
`id_hashes`); without it the row's position is its id.
Columns named otherwise are mapped by `Fields` (the `data.*_field` settings); a null value is
an absent one, as in a `datasets` table whose rows have different formats.

Every format becomes (text, supervised character spans); the tokenizer's offset mapping turns the
spans into labels, with -100 on unsupervised tokens. This keeps the three formats on one path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from gradian_lightning.errors import DataError
from gradian_lightning.specs import Fields

IGNORE_INDEX = -100
ID_BATCH = 8192  # ids read per batch where all of a source's or an index's are checked: ~1 MB, whatever the rows


def read_jsonl(path: str | Path) -> List[Dict[str, Any]]:
    """All rows of a JSONL file as dicts. Raises `DataError` naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist; check data.train / query.data")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(
            f"data file {str(path)!r} cannot be read as UTF-8 text ({type(err).__name__}); fix its permissions or encoding"
        ) from None
    rows, row_of_id = [], {}  # ids compared as stored: 7 and "7" are one id
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: malformed JSON ({err.msg}); each line must be one JSON object") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
        try:
            check_row(row)
        except DataError as err:  # "row n", as the tokenizer's errors (JsonlDataset) say it
            raise DataError(f"{path} row {len(rows) + 1}: {err}") from None
        if "id" in row:
            if str(row["id"]) in row_of_id:
                raise DataError(
                    f"{path} row {len(rows) + 1}: id {row['id']!r} is also the id of row {row_of_id[str(row['id'])]}; ids name rows in results, so each must be unique"
                )
            row_of_id[str(row["id"])] = len(rows) + 1
        rows.append(row)
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows; it needs at least one JSON object per line")
    return rows


def id_hashes(batches: Iterator[Sequence[Any]], total: int) -> np.ndarray:
    """int64 [total]: a 64-bit hash of each id's string form (its stored form: 7 and "7" are one id),
    -1 where there is no id. 8 bytes a row, where a set of the strings would be ~70."""
    out = np.full(total, -1, dtype=np.int64)
    at = 0
    for batch in batches:
        out[at : at + len(batch)] = [hash(str(v)) if v is not None else -1 for v in batch]
        at += len(batch)
    return out


def check_row(row: Dict[str, Any]) -> None:
    """`DataError` unless `row` is one of the formats with text where text belongs and a usable id.

    JSON null, numbers or lists where text belongs would otherwise be indexed as the strings
    'None' or '[1, 2]'. An id is a string or an integer (stored as its decimal string).
    """
    kind = row_format(row)
    fields = {"prompt_completion": ("prompt", "completion"), "text": ("text",), "messages": ()}[kind]
    for name in fields:
        if not isinstance(row[name], str):
            raise DataError(f'{name!r} is {json.dumps(row[name])}; it must be a string (write "" for none)')
    if kind == "messages":
        turns = row["messages"]
        if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str) for t in turns
        ):
            raise DataError('\'messages\' must be a list of {"role": ..., "content": "text"} objects')
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], (str, int))):
        raise DataError(f"'id' is {json.dumps(row['id'])}; it must be a string or an integer")


def row_format(row: Dict[str, Any]) -> str:
    """'prompt_completion', 'messages' or 'text'; raises `DataError` for anything else."""
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "messages" in row:
        return "messages"
    if "text" in row:
        return "text"
    raise DataError(f"row has keys {sorted(row)}; expected prompt+completion, messages, or text")


def row_snippet(row: Optional[Dict[str, Any]], width: int = 72) -> str:
    """One line of a data row's text (prompt → completion, the chat turns, or the text), cut to `width` characters."""
    if row is None:
        return ""
    if "prompt" in row and "completion" in row:
        text = f"{row['prompt']} → {row['completion']}"
    elif "messages" in row:
        text = " | ".join(str(m.get("content", "")) for m in row["messages"])
    else:
        text = str(row.get("text", ""))
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _render(tokenizer: Any, messages: Sequence[Dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def _chat_spans(tokenizer: Any, messages: Sequence[Dict[str, Any]]) -> Tuple[str, List[Tuple[int, int]]]:
    # Each assistant turn is what rendering it appends to the conversation before it plus the
    # generation prompt. Templates that rewrite earlier turns break that prefix property, so check.
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "rows use 'messages' but the tokenizer has no chat template; use prompt/completion rows or a chat model's tokenizer"
        )
    full = _render(tokenizer, messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], True)) if i else 0
        upto = _render(tokenizer, messages[: i + 1], False)
        if not full.startswith(upto) or start > len(upto):
            raise DataError(
                "the chat template does not render turns as prefixes of the conversation; use prompt/completion rows instead"
            )
        spans.append((start, len(upto)))
    return full, spans


def _text_and_spans(tokenizer: Any, row: Dict[str, Any]) -> Tuple[str, List[Tuple[int, int]], bool]:
    """(text, supervised character spans, whether to append EOS as a supervised token)."""
    kind = row_format(row)
    if kind == "prompt_completion":
        prompt, completion = str(row["prompt"]), str(row["completion"])
        # EOS is supervised after a completion, not instead of one: an empty completion explains nothing.
        return prompt + completion, [(len(prompt), len(prompt) + len(completion))], bool(completion)
    if kind == "messages":
        text, spans = _chat_spans(tokenizer, row["messages"])
        return text, spans, False
    text = str(row["text"])
    return text, [(0, len(text))], bool(text)


@dataclass
class Example:
    """One tokenized row. `labels` is -100 where the token is not supervised."""

    index: int
    id: str
    input_ids: List[int]
    labels: List[int]
    truncated_tokens: int  # supervised tokens dropped by max_seq_length


def tokenize_row(tokenizer: Any, row: Dict[str, Any], index: int, max_seq_length: int) -> Example:
    """Tokenize one row, masking unsupervised tokens, then truncate to `max_seq_length` tokens."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "the tokenizer is not a fast (Rust) tokenizer; gradian needs its offset mapping; load it with use_fast=True"
        )
    text, spans, add_eos = _text_and_spans(tokenizer, row)
    kind = row_format(row)
    enc = tokenizer(text, add_special_tokens=kind != "messages", return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    labels = []
    for token, (start, end) in zip(ids, offsets):
        inside = end > start and any(s <= start < e for s, e in spans)
        labels.append(token if inside else IGNORE_INDEX)
    if add_eos and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    dropped = sum(1 for label in labels[max_seq_length:] if label != IGNORE_INDEX)
    row_id = row.get("id", index)
    return Example(index, str(row_id), ids[:max_seq_length], labels[:max_seq_length], dropped)


class TokenizedRows(Dataset):
    """Rows tokenized one at a time, as the data loader asks for them: item `i` is the `Example`
    of row `i` (`index == i`), so memory does not grow with the number of rows.

    `rows`: a `datasets.Dataset` (memory-mapped: nothing is held per row) or a sequence of dicts.
    `source` names the data in errors; `fields` maps its columns. A row without an id gets
    `first_id + i`: an index that these rows are appended to (index.append) starts them after its own.
    """

    def __init__(
        self,
        rows: Any,
        tokenizer: Any,
        max_seq_length: int,
        source: str = "data",
        fields: Optional[Fields] = None,
        first_id: int = 0,
    ) -> None:
        self.rows, self.tokenizer, self.max_seq_length = rows, tokenizer, max_seq_length
        self.source, self.fields, self.first_id = source, fields or Fields(), first_id

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> Dict[str, Any]:
        """Row `i` under gradian's names (`Fields.row`)."""
        return self.fields.row(self.rows[i])

    def __getitem__(self, i: int) -> Example:
        row = self.row(i)
        try:
            example = tokenize_row(self.tokenizer, row, i, self.max_seq_length)
        except DataError as err:
            raise DataError(f"{self.source} row {i + 1}: {err}") from None
        if "id" not in row:
            example.id = str(self.first_id + i)
        return example


class JsonlDataset(TokenizedRows):
    """A JSONL file's rows (`rows` its path, read by `read_jsonl`) or a list of row dicts, tokenized
    at once and kept in `examples`: a row's error fails here. For small row sets (queries, tests);
    `TokenizedRows` holds none in memory."""

    def __init__(
        self,
        rows: str | Path | Sequence[Dict[str, Any]],
        tokenizer: Any,
        max_seq_length: int,
        source: Optional[str] = None,
    ) -> None:
        if isinstance(rows, (str, Path)):
            rows, source = read_jsonl(rows), source or str(rows)
        rows = list(rows)
        odd = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if odd is not None:  # a str row would fail later as "'str' object has no attribute 'get'"
            raise DataError(
                f"JsonlDataset takes a JSONL file's path or a list of row dicts, and row {odd + 1} is a {type(rows[odd]).__name__}; pass the path, or read_jsonl(path)"
            )
        super().__init__(rows, tokenizer, max_seq_length, source or "data")
        self.examples = [super(JsonlDataset, self).__getitem__(i) for i in range(len(self.rows))]

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]


def collate(examples: Sequence[Example], pad_token_id: int = 0) -> Dict[str, Any]:
    """Right-pad a list of examples into a batch.

    Returns `input_ids`, `attention_mask`, `labels` as int64 [B, T], `index` int64 [B] (dataset
    positions), `truncated_tokens` int64 [B] and `id` (list of B strings). Right padding keeps every
    real token at the same position as in an unpadded batch, so rows do not depend on padding.
    """
    width = max(len(e.input_ids) for e in examples)
    shape = (len(examples), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention_mask[row, :n] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "index": torch.tensor([e.index for e in examples], dtype=torch.long),
        "truncated_tokens": torch.tensor([e.truncated_tokens for e in examples], dtype=torch.long),
        "id": [e.id for e in examples],
    }
