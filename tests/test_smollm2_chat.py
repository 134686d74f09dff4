"""Chat data on the real SmolLM2-135M-Instruct: `messages` rows through its own chat template, only
the assistant turns supervised, indexed and queried with the `gradian` CLI."""

import json

import numpy as np
import pytest
from smollm2 import ROOT, smollm2_dir
from transformers import AutoTokenizer

from gradian_lightning import open_index
from gradian_lightning.cli import main
from gradian_lightning.data import JsonlDataset, read_jsonl

pytestmark = pytest.mark.slow  # the real SmolLM2-135M

TRAIN, QUERIES = ROOT / "tests/data/chat.jsonl", ROOT / "tests/data/chat_queries.jsonl"


def supervised_runs(example):
    """The maximal runs of consecutive supervised tokens of one example, as token-id lists."""
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_only_the_assistant_turns_are_supervised():
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    rows = read_jsonl(TRAIN) + read_jsonl(QUERIES)
    for row, example in zip(rows, JsonlDataset(rows, tokenizer, 512).examples):
        # SmolLM2's template writes each turn as <|im_start|>ROLE\nCONTENT<|im_end|>\n (and a default
        # system turn when there is none): an assistant turn's span is its content and its end marker.
        text = tokenizer.decode(example.input_ids)
        assert text == tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assistant = [m["content"] + "<|im_end|>\n" for m in row["messages"] if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in supervised_runs(example)] == assistant, row["id"]
        assert not any(
            m["content"] in tokenizer.decode(run)
            for m in row["messages"]
            if m["role"] != "assistant"
            for run in supervised_runs(example)
        )


def test_index_and_query_chat_rows_with_the_cli(tmp_path, capsys):
    model = smollm2_dir()
    argv = [
        "index",
        str(ROOT / "configs" / "smollm2.yaml"),
        f"model.name_or_path={model}",
        f"data.train={TRAIN}",
        f"index.path={tmp_path / 'ix'}",
        "grads.module_filter=down_proj",
        "grads.projection_dim=16",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    index = open_index(tmp_path / "ix")
    train = read_jsonl(TRAIN)
    assert index.meta.complete and len(index) == len(train) and index.column("finite").all()
    assert np.isfinite(index.rows(slice(None)).numpy()).all()
    # supervised tokens per row = the assistant turns' tokens, counted from the template's spans
    tokenizer = AutoTokenizer.from_pretrained(model)
    want = [sum(len(run) for run in supervised_runs(e)) for e in JsonlDataset(train, tokenizer, 512).examples]
    assert index.column("supervised_tokens").tolist() == want

    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in [train[0]] + read_jsonl(QUERIES)[:2]))
    out = tmp_path / "results.jsonl"
    assert main(["query", *argv[1:], f"query.data={queries}", "query.top_k=3", f"query.output={out}"]) == 0, (
        capsys.readouterr().err
    )
    results = [json.loads(line) for line in out.read_text().splitlines()]
    top = {r["query_id"]: [h["id"] for h in r["results"]] for r in results}
    printed = capsys.readouterr().out
    assert top["chat-fr"][0] == "chat-fr"  # a training row finds itself
    assert (
        top["q-chat-fr"][0] == "chat-fr" and top["q-chat-shakespeare"][0] == "chat-shakespeare"
    )  # paraphrases find their source
    assert results[0]["results"][0]["score"] > 0.99
    assert "query q-chat-fr: Which city is the capital of France? | Paris is the capital of France." in printed
