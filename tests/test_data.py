import pytest
from conftest import write_jsonl

from gradian_lightning.data import JsonlDataset, collate, read_jsonl, tokenize_row
from gradian_lightning.errors import DataError


def supervised_tokens(tokenizer, ex):
    return tokenizer.convert_ids_to_tokens([t for t in ex.labels if t != -100])


def test_formats_supervise_the_right_tokens(tokenizer, rows):
    pc, _, _, chat, text = (tokenize_row(tokenizer, r, i, 64) for i, r in enumerate(rows[:5]))
    assert supervised_tokens(tokenizer, pc) == ["paris", "is", "the", "capital", ".", "</s>"]
    assert supervised_tokens(tokenizer, chat) == ["a", "cat", "</s>", "red", "and", "green", "</s>"]
    assert supervised_tokens(tokenizer, text) == tokenizer.convert_ids_to_tokens(text.input_ids)
    assert (pc.id, text.id) == ("paris", "4")


def test_truncation_counts_lost_supervised_tokens(tokenizer, rows):
    ex = tokenize_row(tokenizer, rows[2], 0, 8)  # prompt 5 tokens, completion 10 + EOS
    assert len(ex.input_ids) == 8 and ex.truncated_tokens == 11 - 3
    assert tokenize_row(tokenizer, rows[2], 0, 64).truncated_tokens == 0


def test_collate_pads_right_and_keeps_positions(tokenizer, rows):
    batch = collate([tokenize_row(tokenizer, r, i, 64) for i, r in enumerate(rows[:3])], pad_token_id=0)
    assert batch["index"].tolist() == [0, 1, 2]
    assert batch["attention_mask"][1].tolist()[-1] == 0 and batch["labels"][1].tolist()[-1] == -100


def test_bad_files_give_one_line(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON"):
        read_jsonl(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="has no rows"):
        read_jsonl(empty)
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "a"}, {"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"odd.jsonl row 2: .*expected prompt\+completion, messages, or text"):
        JsonlDataset(read_jsonl(odd), tokenizer, 16, source=str(odd))
