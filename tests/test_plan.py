"""`gradian plan` against what indexing really allocates, and the accelerator-OOM error."""

import json
from functools import partial

import numpy as np
import pytest
import torch
import zarr
from conftest import MAPPED, ROWS, make_model, saved_activation_bytes, write_jsonl, write_renamed_parquet
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

from gradian_lightning.cli import main
from gradian_lightning.config import load_config
from gradian_lightning.data import collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.loss import supervised_token_loss
from gradian_lightning.hub import load_model_and_tokenizer
from gradian_lightning.recipes.plan import activation_bytes_per_token, largest_fitting_batch, make_plan, parse_bytes

VOCAB = 4096  # larger than the tokenizer's: the logits must be the biggest tensor, as in real models


@pytest.fixture
def wide_model(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("wide-llama")
    make_model(VOCAB).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def config(tmp_path, model_dir, rows, *more):
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    return load_config(
        "configs/smollm2.yaml", [f"model.name_or_path={model_dir}", f"data.train={data}", "model.dtype=bfloat16", *more]
    )


def upcast_bytes(model, batch, chunk=None):
    """Bytes the CPU allocator handed to the fp32 upcast of the logits in one loss + backward."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, torch.enable_grad():
        supervised_token_loss(model, batch, chunk).sum().backward()
    return max(e.cpu_memory_usage for e in prof.events() if e.name == "aten::_to_copy")


def test_predicted_fp32_logit_bytes_equal_the_bytes_allocated(tmp_path, wide_model, tokenizer):
    rows = ROWS + [{"prompt": "the capital", "completion": " " + " ".join(["one"] * 30)}]
    cfg = config(tmp_path, wide_model, rows, "grads.batch_size=3", "grads.max_seq_length=24", "trainer.accelerator=cpu")
    plan = make_plan(cfg)
    model, tok = load_model_and_tokenizer(cfg.model)
    assert plan["vocab_size"] == VOCAB and next(model.parameters()).dtype == torch.bfloat16
    from gradian_lightning.data import JsonlDataset

    examples = JsonlDataset(rows, tok, 24).examples
    # the batches gradian index makes, in its order: the largest upcast is the plan's
    loader = DataLoader(examples, batch_size=3, shuffle=False, collate_fn=partial(collate, pad_token_id=0))
    measured = [upcast_bytes(model, batch) for batch in loader]
    assert max(measured) == plan["fp32_logits_bytes"]["largest_batch_in_index_order"]
    # worst case: the 3 rows with the most supervised tokens, batched together
    counts = np.array([sum(t != -100 for t in e.labels[1:]) for e in examples])
    top = [examples[i] for i in np.argsort(-counts, kind="stable")[:3]]
    assert upcast_bytes(model, collate(top)) == plan["fp32_logits_bytes"]["worst_case"]
    s = plan["supervised_tokens"]
    assert (s["max"], s["mean"], s["p95"]) == (
        counts.max(),
        pytest.approx(counts.mean()),
        pytest.approx(np.percentile(counts, 95)),
    )
    assert plan["truncated_rows"] == 1 and plan["empty_rows"] == 0
    # index size: rows × (modules × k² × itemsize + modules × 4 for the stored norms), plus the row statistics:
    # sumsq [D] f64, eigvecs [M, k², min(rows, k²)] f32 (F has rank <= rows), eigvals [M, k²] f64,
    # whitened norms [rows, M] f32; 2 layers' gate, up and down projections, k = 32 (the default): k² = 1,024
    m, n, s = 2 * 3, len(rows), 32 * 32
    stats = m * s * 8 + m * s * min(n, s) * 4 + m * s * 8 + n * m * 4
    assert plan["index"]["statistics_bytes"] == stats
    assert plan["index"]["bytes_by_storage_dtype"] == {
        "float32": n * (m * s * 4 + m * 4) + stats,
        "float16": n * (m * s * 2 + m * 4) + stats,
        "bfloat16": n * (m * s * 2 + m * 4) + stats,
        "int8": n * (m * s + m * 4 + m * 4) + stats,  # and a float32 scale per module
    }


def test_chunked_loss_peak_is_the_chunk_whatever_the_batch(tmp_path, wide_model, tokenizer):
    cfg = config(
        tmp_path, wide_model, ROWS, "grads.batch_size=4", "grads.loss_chunk_tokens=5", "trainer.accelerator=cpu"
    )
    plan = make_plan(cfg)
    model, tok = load_model_and_tokenizer(cfg.model)
    from gradian_lightning.data import JsonlDataset

    examples = JsonlDataset(ROWS, tok, 512).examples
    batch = collate(examples[:4])
    assert (batch["labels"][:, 1:] != -100).sum() > 5  # the chunk really cuts this batch
    assert upcast_bytes(model, batch, 5) == plan["fp32_logits_bytes"]["worst_case"] == 5 * VOCAB * 4
    assert upcast_bytes(model, batch) > 5 * VOCAB * 4


def test_largest_fitting_batch_is_the_budget_boundary():
    counts, longest, vocab, weights, act = [10, 8, 5, 1], 12, 100, 1000, 7
    need = lambda b: weights + b * longest * act + sum(counts[:b]) * vocab * 4  # noqa: E731  (fp32 logits: one copy at the peak)
    assert largest_fitting_batch(counts, longest, vocab, weights, act, need(2)) == 2
    assert largest_fitting_batch(counts, longest, vocab, weights, act, need(2) - 1) == 1
    assert largest_fitting_batch(counts, longest, vocab, weights, act, need(1) - 1) == 0
    assert largest_fitting_batch(counts, longest, vocab, weights, act, 10**9) == 4
    # with the loss chunked to 9 tokens, the logit term stops growing after the first row
    chunked = lambda b: weights + b * longest * act + min(sum(counts[:b]), 9) * vocab * 4  # noqa: E731
    assert largest_fitting_batch(counts, longest, vocab, weights, act, chunked(3), chunk_tokens=9) == 3
    assert largest_fitting_batch(counts, longest, vocab, weights, act, chunked(3) - 1, chunk_tokens=9) == 2


def test_activation_bytes_per_token_predict_a_deeper_longer_forward(tokenizer):
    """The 1- and 2-layer probe, scaled, against what indexing a 3-layer model keeps for 2 rows of 20 tokens."""
    model = make_model(VOCAB, hidden=64, layers=3)
    ids = torch.randint(3, len(tokenizer), (2, 20))
    for recompute in (
        "none",
        "mlp",
        "layers",
    ):  # every layer keeping its activations, recomputed MLP blocks (the default), recomputed layers
        per_token = activation_bytes_per_token(model.config, torch.float32, recompute=recompute)
        # One supervised token: its fp32 log-softmax, [1, vocab], is the loss's share.
        kept = saved_activation_bytes(model, ids, recompute=recompute) - VOCAB * 4
        assert 0.85 * per_token * 40 <= kept <= per_token * 40
    # Recomputing keeps less than the layers' own activations (hidden 64, 3 layers: 0.8x here for layers, fewer at depth).
    per_token = {
        r: activation_bytes_per_token(model.config, torch.float32, recompute=r) for r in ("none", "mlp", "layers")
    }
    assert per_token["layers"] < 0.85 * per_token["none"] and per_token["mlp"] < 0.85 * per_token["none"]


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("80 GB") == 80 * 10**9 and parse_bytes("512") == 512
    with pytest.raises(ConfigError, match="--device-memory 'lots' is not a size"):
        parse_bytes("lots")


def test_plan_cli_prints_the_numbers_without_loading_weights(tmp_path, wide_model, capsys, monkeypatch):
    import transformers

    def no_weights(*a, **k):
        raise AssertionError("plan loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    argv = [
        "plan",
        "configs/smollm2.yaml",
        f"model.name_or_path={wide_model}",
        f"data.train={data}",
        "--device-memory",
        "1MiB",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "supervised tokens per row: max" in out and "largest batch size that fits 1.00 MiB (--device-memory):" in out
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    weights = sum(p.numel() for p in make_model(VOCAB).parameters()) * 4
    assert plan["weights_bytes"] == weights and plan["device_memory"]["bytes"] == 2**20
    counts, longest = sorted_counts(wide_model, ROWS)
    assert plan["largest_batch_size_that_fits"] == largest_fitting_batch(
        counts, longest, VOCAB, weights, plan["activation_bytes_per_token"], 2**20
    )


def test_a_parquet_file_with_renamed_columns_plans_as_its_jsonl_twin(tmp_path, wide_model):
    """plan reads data.train as gradian index does: any source, through the data.*_field mapping."""
    want = make_plan(config(tmp_path, wide_model, ROWS), device_memory=2**20)
    parquet = write_renamed_parquet(tmp_path / "train.parquet", ROWS)
    got = make_plan(config(tmp_path, wide_model, ROWS, f"data.train={parquet}", *MAPPED), device_memory=2**20)
    assert got["data"] == str(parquet) and {**got, "data": None} == {**want, "data": None}
    assert got["rows"] == len(ROWS) and got["supervised_tokens"]["min"] > 0  # every row's format was read


def sorted_counts(model_dir, rows):
    from transformers import AutoTokenizer

    from gradian_lightning.data import JsonlDataset

    examples = JsonlDataset(rows, AutoTokenizer.from_pretrained(str(model_dir)), 512).examples
    return sorted((sum(t != -100 for t in e.labels[1:]) for e in examples), reverse=True), max(
        len(e.input_ids) for e in examples
    )


def _array_bytes(group):
    """Uncompressed bytes of every array under a zarr group, at any depth."""
    return sum(a.nbytes for _, a in group.arrays()) + sum(_array_bytes(g) for _, g in group.groups())


def test_plan_says_which_path_gradian_query_takes_and_what_the_exact_pass_caches(tmp_path, wide_model, capsys):
    """The query line of `gradian plan` is the line `gradian query` prints for query.method=auto
    (the same method, cost and budget), and the factor cache it predicts is the bytes the exact
    pass then stores under index.path/factors/."""
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    queries = write_jsonl(tmp_path / "queries.jsonl", ROWS[:2])
    common = [
        "configs/smollm2.yaml",
        f"model.name_or_path={wide_model}",
        f"data.train={data}",
        f"index.path={tmp_path / 'ix'}",
        f"query.data={queries}",
        f"query.output={tmp_path / 'results.jsonl'}",
        "grads.batch_size=4",
        "trainer.enable_progress_bar=false",
    ]
    assert main(["plan", *common, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["query"]
    assert plan["method"] == "exact" and plan["why"].startswith("query.method=auto: exact (")
    assert main(["plan", *common]) == 0
    assert plan["why"] in capsys.readouterr().out
    assert main(["index", *common]) == 0 and main(["query", *common]) == 0
    assert plan["why"] in capsys.readouterr().out
    stored = _array_bytes(zarr.open_group(str(tmp_path / "ix" / "factors"), mode="r"))
    assert stored == plan["factor_cache_bytes"] > 0
    assert main(["plan", *common, "query.exact_budget=1000", "--json"]) == 0  # past the budget
    past = json.loads(capsys.readouterr().out)["query"]
    assert past["method"] == "index" and "above query.exact_budget=1e+03" in past["why"]
    assert main(["query", *common, "query.exact_budget=1000"]) == 0
    assert past["why"] in capsys.readouterr().out
    assert main(["plan", *common, "query.token_scores=true", "--json"]) == 0  # a run setting the exact pass lacks
    explained = json.loads(capsys.readouterr().out)["query"]
    assert explained["method"] == "index" and "query.token_scores=true" in explained["why"]
