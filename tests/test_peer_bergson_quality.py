"""benchmarks/perf/peer_bergson_quality.py's pieces that decide the figures: the pre-tokenized rows
bergson is given (gradian's tokens, completion + EOS supervised), gradian's rows read from an LDS
set's result.json (seed-averaged k32-int8), bergson's flags, and the gradian / bergson ratios.
(bergson itself runs only in the benchmark: it lives in its own virtualenv.)"""

import json

import numpy as np
import pytest

from benchmarks.perf.peer_bergson_quality import (
    bergson_command,
    gradian_figures,
    ratio,
    tables,
    token_budget,
    tokenized_rows,
)
from gradian_lightning.recipes.quickstart import tiny_llama, word_tokenizer

ROWS = [
    {"id": "a", "prompt": "What fruit does Ann like ?", "completion": " Ann likes plums ."},
    {"id": "b", "prompt": "Where does Bo live ?", "completion": " Bo lives in lima ."},
]


@pytest.fixture
def model_dir(tmp_path):
    tokenizer = word_tokenizer([r["prompt"] + r["completion"] for r in ROWS])
    tiny_llama(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_rows_are_gradians_tokens_with_the_completion_and_eos_supervised(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.convert_tokens_to_ids
    eos = tokenizer.eos_token_id
    rows = tokenized_rows(model_dir, ROWS, 40)
    for row, source in zip(rows, ROWS):
        prompt, completion = source["prompt"].split(), source["completion"].split()
        assert row["input_ids"] == ids(prompt) + ids(completion) + [eos]
        assert row["labels"] == [-100] * len(prompt) + ids(completion) + [eos]
        assert row["length"] == len(row["input_ids"])
    # The set's max_seq_length truncates, as gradian's index did.
    assert [len(r["input_ids"]) for r in tokenized_rows(model_dir, ROWS, 5)] == [5, 5]


def test_bergson_flags_match_the_index_and_fit_the_models_context(model_dir):
    assert token_budget(model_dir) == 64  # the tiny model's positions: bergson refuses a larger budget
    ekfac = bergson_command(
        model_dir, "ekfac", model_dir / "run", model_dir, model_dir / "t.jsonl", model_dir / "q.jsonl"
    )
    text = " ".join(ekfac)
    for flag in ("ekfac", "--method kfac", "--hessian_cfg.ev_correction true", "--query.aggregation none"):
        assert flag in text
    assert "--token_batch_size 64" in text and "--filter_modules *self_attn*,lm_head" in text
    cosine = bergson_command(model_dir, "trackstar-cosine", model_dir / "r", model_dir, model_dir, model_dir)
    assert cosine[1] == "trackstar" and "--unit_normalize true" in " ".join(cosine)
    assert "--unit_normalize" not in bergson_command(model_dir, "trackstar", model_dir, model_dir, model_dir, model_dir)


def scorer(spec, lds):
    return {"scorer": spec, "name": "x", "lds": lds, "standard_error": 0.1, "centred_lds": lds + 0.1,
            "centred_standard_error": 0.1, "recall@10": 0.5, "mrr": 0.25}  # fmt: skip


def fake_result():
    """A result.json with three k32-int8 seeds, one k16 seed (not read) and the exact index."""
    specs = [{}, {"checkpoints": "last"}]
    indexes = {
        f"projected-k32-int8-seed{s}": {"scorers": [scorer(p, lds + s / 10) for p, lds in zip(specs, (0.2, 0.1))]}
        for s in range(3)
    }
    indexes["projected-k16-float16-seed0"] = {"scorers": [scorer(p, 0.9) for p in specs]}
    exact = [{"precondition": "none", "score": "inner", **c} for c in ({}, {"checkpoints": "last"})]
    indexes["exact"] = {
        "scorers": [scorer(exact[0], 0.15), scorer(exact[1], 0.05)],
        "random": {"lds": 0.0},
        "ceiling": {"lds": 0.5, "centred_lds": 0.6},
    }
    return {"indexes": indexes, "bm25": {"lds": 0.3, "centred_lds": 0.35, "recall@10": 1.0, "mrr": 1.0}}


def test_gradian_rows_are_the_k32_int8_seed_means_and_the_exact_index():
    rows = {r["label"]: r for r in gradian_figures(fake_result())}
    assert rows["gradian defaults (base + ft)"]["lds"] == pytest.approx(np.mean([0.2, 0.3, 0.4]))
    assert rows["gradian defaults, ft alone"]["lds"] == pytest.approx(np.mean([0.1, 0.2, 0.3]))
    assert rows["gradian defaults (base + ft)"]["mrr"] == pytest.approx(0.25)
    assert rows["exact inner product (base + ft)"]["lds"] == 0.15
    assert rows["exact inner product, ft alone"]["lds"] == 0.05
    assert rows["BM25"]["lds"] == 0.3 and rows["noise ceiling"]["lds"] == 0.5


def test_ratios_are_gradian_over_bergson_raw_and_centred_on_shared():
    gradian = gradian_figures(fake_result())
    figures = {
        "ekfac": {"lds": 0.1, "centred_lds": 0.2, "lds_spread": 0.01, "centred_lds_spread": 0.02},
        "trackstar": {"lds": -0.1, "centred_lds": 0.4, "lds_spread": 0.03, "centred_lds_spread": 0.04},
    }
    bergson = {
        f"{k}@{c}": {"label": f"{k} {c}", "index": "i", "method": k, "checkpoints": c, **v,
                     "lds": v["lds"] * (2 if c == "base+ft" else 1), "recall@10": 1.0, "mrr": 1.0}
        for k, v in figures.items()
        for c in ("ft", "base+ft")
    }  # fmt: skip
    out = tables(
        {
            "facts-N256": {"methods": bergson, "gradian": gradian},
            "shared-N512": {"methods": bergson, "gradian": gradian},
        }
    )
    ratios = {(r[0], r[2]): r[3:] for r in out[1]["rows"]}
    # each gradian row over bergson on the same checkpoints: raw 0.3 / (0.1 × 2) at base + ft, 0.2 / 0.1 at ft
    assert ratios[("facts-N256", "gradian defaults (base + ft)")] == ["1.50", "n/a (bergson -0.200)"]
    assert ratios[("facts-N256", "gradian defaults, ft alone")] == ["2.00", "n/a (bergson -0.100)"]
    assert ratios[("shared-N512", "gradian defaults (base + ft)")] == ["2.00", "1.00"]  # centred 0.4 / 0.2, / 0.4
    shared = [r for r in out[0]["rows"] if r[0] == "shared-N512"]
    assert all(r[3] == "(ceiling ~0)" for r in shared)  # raw LDS is not shown where it is noise
    assert [r[-1] for r in shared[:2]] == ["0.020", "0.020"]  # the centred spread where centred is read
    assert [r[-1] for r in out[0]["rows"][:2]] == ["0.010", "0.010"]
    assert json.dumps(out)  # the result file holds it
    assert ratio(0.2, 0.0).startswith("n/a")
