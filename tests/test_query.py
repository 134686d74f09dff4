"""Querying: streaming top-k against a plain argsort, scores against their formulas, query rows
against the stored rows, mismatches, and `gradian query` end to end on a saved tiny model."""

import json

import lightning as L
import numpy as np
import pytest
import torch
from conftest import ROWS, make_model, write_jsonl
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, IndexSpec, QuerySpec, open_index, query_gradients, streaming_topk
from gradian_lightning.cli import main
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError, DataError, IndexMismatchError
from gradian_lightning.index import layout
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.query.rows import check_matches_index
from gradian_lightning.query.scorer import checkpoint_scorers
from gradian_lightning.recipes.index import CausalLMModule

META = {"fingerprint": "t", "global_step": 0}


def build_index(path, grads, supervised=None, written=None, ids=None, storage_dtype="float32", modules=None):
    """An index of rows `grads` [N, D]; rows not in `written` are left unwritten (complete=False)."""
    n, d = grads.shape
    supervised = torch.full((n,), 3) if supervised is None else supervised
    writer = IndexWriter(path, n, d, storage_dtype, {**META, **({"modules": modules} if modules else {})})
    for i in range(n) if written is None else written:
        writer.write(
            [i], grads[i : i + 1], torch.zeros(1), supervised[i : i + 1], torch.zeros(1), [ids[i] if ids else str(i)]
        )
    writer.close()
    return open_index(path)


def argsort_ranking(queries, rows, valid, k, score, largest=True, blocks=None):
    """The reference: score every row at once in float64 numpy, drop invalid rows, argsort.

    With `blocks` [(offset, size)], cosine is the mean over blocks of the per-block cosines."""
    q, r = queries.double().numpy(), rows.double().numpy()
    if score == "cosine":
        cosines = []
        for lo, size in blocks or [(0, q.shape[1])]:
            qb, rb = q[:, lo : lo + size], r[:, lo : lo + size]
            qb = qb / np.maximum(np.linalg.norm(qb, axis=1, keepdims=True), 1e-300)
            rb = rb / np.maximum(np.linalg.norm(rb, axis=1, keepdims=True), 1e-300)
            cosines.append(qb @ rb.T)
        scores = np.mean(cosines, axis=0)
    else:
        scores = q @ r.T
    scores[:, ~valid] = -np.inf if largest else np.inf
    order = np.argsort(-scores if largest else scores, axis=1, kind="stable")[:, : min(k, int(valid.sum()))]
    return order, np.take_along_axis(scores, order, axis=1)


@pytest.mark.parametrize("storage_dtype", ["float32", "int8"])
@pytest.mark.parametrize("blocks", [[(0, 3), (3, 5)], [(0, 4), (4, 4)]], ids=["unequal-modules", "equal-modules"])
@pytest.mark.parametrize("score, normalize", [("cosine", "module"), ("cosine", "row"), ("inner", "module")])
def test_streaming_topk_equals_full_argsort_across_chunk_edges(
    tmp_path, monkeypatch, score, normalize, blocks, storage_dtype
):
    n, d, chunk = 23, 8, 5  # 23 is not a multiple of 5: the last chunk holds 3 rows
    monkeypatch.setattr(layout, "CHUNK_BYTES", chunk * d * layout.NUMPY_DTYPE[storage_dtype]().itemsize)
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 5
    grads[11] = float("nan")  # stored as zeros, finite=False
    supervised = torch.full((n,), 3)
    supervised[[4, 5, 19]] = 0  # 4, 5 straddle a chunk edge
    # Two "modules": unequal widths take the per-block loop, equal ones the reshaped path.
    index = build_index(
        tmp_path / "ix",
        grads,
        supervised,
        written=[i for i in range(n) if i != 8],
        storage_dtype=storage_dtype,
        modules=[{"offset": o, "size": z} for o, z in blocks],
    )
    if storage_dtype == "int8":  # the reference scores the rows as stored, decoded with numpy
        grads = torch.nan_to_num(grads, nan=0.0).double()
        for o, z in blocks:
            step = grads[:, o : o + z].abs().amax(dim=1, keepdim=True) / 127
            grads[:, o : o + z] = torch.round(grads[:, o : o + z] / step.clamp_min(1e-300)) * step
    reference_blocks = blocks if normalize == "module" else None
    valid = np.ones(n, dtype=bool)
    valid[[4, 5, 8, 11, 19]] = False
    assert (index.rankable(0, n) == valid).all()
    queries = torch.randn(4, d, generator=g)
    reads = []
    stored = index.reader.stored  # the Index reads through its IndexReader
    monkeypatch.setattr(index.reader, "stored", lambda lo, hi: reads.append((lo, hi)) or stored(lo, hi))
    for k in (1, 4, 5, 7, int(valid.sum()), n, 40):  # k = rankable rows, k = N and k > N
        reads.clear()
        spec = QuerySpec(top_k=k, bottom_k=k, score=score, normalize=normalize, precondition="none")
        top, bottom = streaming_topk(checkpoint_scorers(index, queries, spec))
        want_i, want_s = argsort_ranking(queries, grads, valid, k, score, blocks=reference_blocks)
        assert top.indices.shape == (4, min(k, 18))
        np.testing.assert_array_equal(top.indices.numpy(), want_i)
        np.testing.assert_allclose(top.scores.numpy(), want_s, rtol=1e-5, atol=1e-6)
        want_i, want_s = argsort_ranking(queries, grads, valid, k, score, largest=False, blocks=reference_blocks)
        np.testing.assert_array_equal(bottom.indices.numpy(), want_i)
        np.testing.assert_allclose(bottom.scores.numpy(), want_s, rtol=1e-5, atol=1e-6)
        # Streaming: the index is read one chunk at a time, never more than a chunk of rows at once.
        assert reads == [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]


def test_inner_and_cosine_on_hand_built_rows(tmp_path):
    rows = torch.tensor([[10.0, 10.0], [1.0, 0.0], [-2.0, 0.0], [0.0, 3.0]])
    index = build_index(tmp_path / "ix", rows, ids=["big", "aligned", "opposite", "orthogonal"])
    query = torch.tensor([[2.0, 0.0]])
    inner = index.topk(query, 4, score="inner", precondition="none")
    assert inner.indices.tolist() == [[0, 1, 3, 2]]
    assert inner.scores.tolist() == [[20.0, 2.0, 0.0, -4.0]]
    cosine = index.topk(query, 2, score="cosine", bottom_k=1, precondition="none")
    opponents = cosine.opponents
    assert cosine.indices.tolist() == [[1, 0]]
    torch.testing.assert_close(cosine.scores, torch.tensor([[1.0, 2**-0.5]]))
    assert opponents.indices.tolist() == [[2]] and opponents.scores.tolist() == [[-1.0]]
    with pytest.raises(IndexMismatchError, match="width 2"):
        index.topk(torch.ones(1, 3), 1)
    with pytest.raises(ConfigError, match="query.score"):
        index.topk(query, 1, score="dot")
    with pytest.raises(ConfigError, match="'query.normalize'='layer' is not allowed; use auto or module or row"):
        index.topk(query, 1, normalize="layer")


@pytest.fixture
def tiny_index(tmp_path, tokenizer, model, rows):
    """The conftest rows indexed by GradientIndexer in a Lightning validate run (float16 storage)."""
    dataset = JsonlDataset(rows, tokenizer, 64)
    indexer = GradientIndexer(
        tmp_path / "ix",
        ["down_proj", "o_proj"],
        projection_dim=8,
        storage_dtype="float16",
        seed=5,
        meta={"data": {"max_seq_length": 64}},
    )
    module = CausalLMModule(model)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[indexer],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.validate(module, dataloaders=DataLoader(dataset, batch_size=3, collate_fn=collate))
    return open_index(tmp_path / "ix")


def test_training_rows_as_queries_match_their_stored_rows_and_rank_first(tiny_index, tokenizer, model, rows):
    model.train()  # the query must put it in eval mode for the forward, and give it back as it was
    rng = torch.get_rng_state()
    queries = query_gradients(tiny_index, model, tokenizer, rows, batch_size=2)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    stored = tiny_index.rows(slice(None))
    assert queries.shape == stored.shape and queries.dtype == torch.float32
    # Other batch sizes change the float32 sums slightly; float16 rounding then differs by an ulp at most.
    torch.testing.assert_close(queries, stored, rtol=2e-3, atol=1e-5)
    top = tiny_index.topk(queries, 3, score="cosine")
    assert top.indices[:, 0].tolist() == list(range(len(rows)))
    torch.testing.assert_close(top.scores[:, 0], torch.ones(len(rows)), rtol=0, atol=1e-5)


def test_mismatches_are_named_in_one_line(tiny_index, tokenizer, model, rows):
    other_vocab = make_model(len(tokenizer) + 5)
    narrow = make_model(len(tokenizer), hidden=64)
    one_layer = make_model(len(tokenizer), layers=1)
    with pytest.raises(IndexMismatchError) as err:
        query_gradients(tiny_index, other_vocab, tokenizer, rows)
    assert f"vocabulary size is {len(tokenizer) + 5} here but {len(tokenizer)} in the index" in str(err.value)
    with pytest.raises(IndexMismatchError) as err:
        query_gradients(tiny_index, narrow, tokenizer, rows)
    message = str(err.value)
    assert (
        "\n" not in message
        and "module 'model.layers.0.self_attn.o_proj' is 64x64 here but 32x32 in the index" in message
    )
    assert "module 'model.layers.1.mlp.down_proj' is 64x128 here but 32x64 in the index" in message
    with pytest.raises(IndexMismatchError, match="module 'model.layers.1.mlp.down_proj' is missing from the model"):
        query_gradients(tiny_index, one_layer, tokenizer, rows)
    with pytest.raises(IndexMismatchError, match="model dtype is 'float64' here but 'float32' in the index"):
        query_gradients(tiny_index, make_model(len(tokenizer)).double(), tokenizer, rows)
    with pytest.raises(IndexMismatchError) as err:
        check_matches_index(
            tiny_index,
            model,
            IndexSpec(projection_dim=16, seed=5, storage_dtype="float32", module_filter="down_proj"),
        )
    message = str(err.value)
    assert (
        "grads.projection_dim is 16 here but 8 in the index; grads.storage_dtype is 'float32' here but 'float16' in the index; "
        in message
    )
    assert (
        "grads.module_filter=['down_proj'] selects 2 modules here, not the 4 modules of the index" in message
        and "seed" not in message
    )
    check_matches_index(
        tiny_index,
        model,
        IndexSpec(projection_dim=8, seed=5, storage_dtype="float16", module_filter=["o_proj", "down_proj"]),
    )
    with pytest.raises(DataError, match="row 2 .* has no supervised token within max_seq_length=8"):
        query_gradients(
            tiny_index,
            model,
            tokenizer,
            [rows[1], {"prompt": "what is the color of the sky ?", "completion": " blue"}],
            max_seq_length=8,
        )


def test_gradian_query_end_to_end_on_a_saved_tiny_model(tmp_path, saved_model, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [
        "configs/smollm2.yaml",
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "grads.projection_dim=8",
        "grads.module_filter=[down_proj,q_proj]",
        "query.method=index",  # the stored rows, as the summary line below names them
    ]
    assert (
        main(["index", *common, f"data.train={train}", "grads.batch_size=3", "trainer.enable_progress_bar=false"]) == 0
    )
    capsys.readouterr()
    out_file = tmp_path / "out" / "results.jsonl"
    assert (
        main(["query", *common, f"query.data={train}", "query.top_k=3", "query.bottom_k=2", f"query.output={out_file}"])
        == 0
    )
    printed = capsys.readouterr().out
    results = [json.loads(line) for line in out_file.read_text().splitlines()]
    ids = [str(r.get("id", i)) for i, r in enumerate(ROWS)]
    assert [r["query_id"] for r in results] == ids  # the row without an id falls back to its position
    for position, result in enumerate(results):
        assert set(result) == {"query_id", "results", "opponents", "scoring"}
        # 3 rows < k² = 64 counted rows: auto is ekfac, whose normalize=auto is per module
        assert result["scoring"] == "per-module cosine (mean over modules), preconditioner ekfac (damping 1.0)"
        assert [h["rank"] for h in result["results"]] == [1, 2, 3] and [h["rank"] for h in result["opponents"]] == [
            1,
            2,
        ]
        for hit in result["results"] + result["opponents"]:
            assert (
                set(hit) == {"rank", "id", "index", "score"}
                and isinstance(hit["index"], int)
                and isinstance(hit["score"], float)
            )
            assert hit["id"] == ids[hit["index"]]
        scores = [h["score"] for h in result["results"]]
        assert scores == sorted(scores, reverse=True) and result["results"][0]["index"] == position  # self-retrieval
        assert [h["score"] for h in result["opponents"]] == sorted(h["score"] for h in result["opponents"])
        assert result["opponents"][0]["score"] <= scores[-1]
    assert "query paris: what is the capital of the country ? → paris is the capital ." in printed
    assert f"{len(ROWS)} queries ranked against {len(ROWS)} rows" in printed
    # The same config with another projection than the index's: one line, exit 2, nothing loaded.
    assert main(["query", *common, f"query.data={train}", "grads.projection_dim=4", "grads.seed=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gradian query: error: the query does not match the index at") and "\n" not in err
    assert "grads.projection_dim is 4 here but 8 in the index; grads.seed is 1 here but 0 in the index" in err
    assert main(["query", *common, "query.data=null"]) == 2
    assert "setting 'query.data' is required" in capsys.readouterr().err
    # Without any grads.* setting the query reads the index's stored spec (k = 8, the index's
    # modules): the same results as with them repeated.
    bare = [
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "query.method=index",
    ]
    again = tmp_path / "out" / "bare.jsonl"
    args = [f"query.data={train}", "query.top_k=3", "query.bottom_k=2", f"query.output={again}"]
    assert main(["query", *bare, *args]) == 0
    assert [json.loads(line) for line in again.read_text().splitlines()] == results
