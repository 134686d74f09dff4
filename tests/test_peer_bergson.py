"""benchmarks/perf/peer_bergson.py's matching of the two tools: the chat rows it writes give gradian
the tokens bergson 2.5.1's `tokenize` makes of them, and its check refuses indexes that do not hold
the same numbers. (The script itself runs end to end in tests/test_benchmarks_smoke.py.)"""

import json

import pytest
from smollm2 import smollm2_dir

from benchmarks.perf.peer_bergson import DATA, bergson_stored, check_same_numbers, write_chat_rows
from gradian_lightning.data import tokenize_row


def bergson_tokens(tokenizer, messages):
    """bergson 2.5.1's bergson/data.py `tokenize` for a conversation row, restated: the chat template
    rendered to a string, then tokenized without special tokens (the template has its own)."""
    text = tokenizer.apply_chat_template([messages], tokenize=False)[0]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_rows_give_both_tools_the_same_tokens(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    assert write_chat_rows(DATA, tmp_path / "chats.jsonl", 20) == 20
    chats = [json.loads(line) for line in (tmp_path / "chats.jsonl").read_text().splitlines()]
    originals = [json.loads(line) for line in DATA.read_text().splitlines()[:20]]
    for i, (chat, original) in enumerate(zip(chats, originals)):
        assert chat["id"] == original["id"]
        assert [m["content"] for m in chat["messages"]] == [original["prompt"], original["completion"]]
        ours = tokenize_row(tokenizer, chat, i, 512)
        assert ours.input_ids == bergson_tokens(tokenizer, chat["messages"])
        assert any(label != -100 for label in ours.labels)
        # The prompt/completion row itself is not templated by gradian: far fewer tokens than bergson runs.
        assert len(tokenize_row(tokenizer, original, i, 512).input_ids) < len(ours.input_ids) / 2


def stored(names, numbers=1024, rows=8):
    return {"modules": {n: numbers for n in names}, "rows": rows}


MLP = [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")]


def test_check_accepts_the_same_modules_named_inside_the_base_model():
    check_same_numbers(stored(MLP), stored([n.removeprefix("model.") for n in MLP]), 8, 32)


@pytest.mark.parametrize(
    "bergson, message",
    [
        (stored([n.removeprefix("model.") for n in MLP] + ["lm_head"]), "modules differ"),
        (stored([n.removeprefix("model.") for n in MLP], numbers=256), "not all 1024"),
        (stored([n.removeprefix("model.") for n in MLP], rows=7), "rows"),
    ],
)
def test_check_refuses_indexes_that_hold_other_numbers(bergson, message):
    with pytest.raises(SystemExit, match=message):
        check_same_numbers(stored(MLP), bergson, 8, 32)


def test_bergson_stored_reads_its_info_and_gradient_file(tmp_path):
    info = {
        "num_grads": 3,
        "grad_sizes": {"layers.0.mlp.up_proj": 4, "layers.0.mlp.down_proj": 4},
        "base_dtype": "float32",
    }
    (tmp_path / "info.json").write_text(json.dumps(info))
    (tmp_path / "gradients.bin").write_bytes(bytes(3 * 8 * 4))
    assert bergson_stored(tmp_path) == {
        "modules": info["grad_sizes"],
        "rows": 3,
        "dtype": "float32",
        "row_bytes": 32,
    }
