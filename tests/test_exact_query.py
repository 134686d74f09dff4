"""query.method=exact: `gradian query`, `dense_scores` and `gradian validate` through the exact pass,
checked against `ExactPass` run directly on the same rows (fitted independently, all rows in one
batch), the checkpoint sum against its learning-rate weights, the factor cache, and every refusal."""

import json

import numpy as np
import pytest
import torch
import zarr
from conftest import ROWS, make_model, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from gradian_lightning import IndexSpec, JsonlDataset, QuerySpec, collate, open_index
from gradian_lightning.cli import main
from gradian_lightning.config import load_config
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.factors import fit_factors
from gradian_lightning.query.exact import ExactPass
from gradian_lightning.query.exact_scoring import (
    AUTO_COSINE,
    AUTO_FACTORS,
    AUTO_HEAD,
    AUTO_HORIZON,
    AUTO_HORIZON_TRAJECTORY,
    exact_estimator,
    resolve_method,
)
from gradian_lightning.recipes import query as recipe
from gradian_lightning.recipes.query import dense_scores, run_query

QUERIES = [
    {"id": "q-sky", "prompt": "what color is the sky ?", "completion": " blue"},
    {"id": "q-dog", "prompt": "tell me the dog .", "completion": " the dog is red"},
    {"id": "q-rome", "prompt": "what city is blue ?", "completion": " rome is blue"},
]
MAX_LEN = 24
KEYS = ("input_ids", "attention_mask", "labels")


def _settings(tmp_path, model, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train={tmp_path / 'train.jsonl'}",
        f"query.data={tmp_path / 'queries.jsonl'}",
        f"index.path={tmp_path / 'ix'}",
        f"grads.max_seq_length={MAX_LEN}",
        "grads.projection_dim=4",
        "grads.batch_size=3",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        *extra,
    ]


@pytest.fixture
def indexed(tmp_path, saved_model, capsys):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "queries.jsonl", QUERIES)
    common = _settings(tmp_path, saved_model)
    assert main(["index", *common]) == 0
    capsys.readouterr()
    return common


def _batch(rows, tokenizer):
    return {k: v for k, v in collate(JsonlDataset(rows, tokenizer, MAX_LEN).examples).items() if k in KEYS}


def reference(path, kind=None, damping=0.1, horizon=None, cosine=False, train=ROWS, head=False):
    """[Q, N] float64 of `ExactPass` run directly: the saved model, every training row in one batch,
    factors fitted over that batch; a different batching and dtype than the recipe's. `head`: the
    output head (`lm_head`) as a second part, its G diagonal."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    spec = IndexSpec()
    train_batch = _batch(train, tokenizer)
    modules = select_modules(model, spec.module_filter)
    parts = [list(modules), ["lm_head"]] if head else None
    modules = {**modules, "lm_head": model.lm_head} if head else modules
    diagonal = ["lm_head"] if head else []
    factors = None
    if kind is not None:
        factors = fit_factors(
            model, spec, [train_batch], ekfac=kind == "ekfac", modules=modules, dtype=torch.float64, diagonal_g=diagonal
        )
    exact = ExactPass(
        model,
        spec,
        _batch(QUERIES, tokenizer),
        factors,
        damping,
        cosine,
        horizon=horizon,
        dtype=torch.float64,
        modules=modules,
        parts=parts,
    )
    return exact.score_all([train_batch], len(train)).numpy()


def _close(got, expected):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


CASES = [
    ({"precondition": "none", "score": "inner"}, {}),
    ({"precondition": "none", "score": "cosine"}, {"cosine": True}),
    ({"precondition": "ekfac", "damping": 0.1, "score": "inner"}, {"kind": "ekfac", "damping": 0.1}),
    ({"precondition": "kfac", "damping": 0.3, "horizon": 2.0, "score": "inner"}, {"kind": "kfac", "horizon": 2.0}),
    ({"precondition": "ekfac", "damping": 0.1, "score": "cosine"}, {"kind": "ekfac", "damping": 0.1, "cosine": True}),
    (
        {},
        {"kind": AUTO_FACTORS, "horizon": AUTO_HORIZON, "cosine": AUTO_COSINE, "head": AUTO_HEAD},
    ),  # auto: the defaults
]


def test_dense_scores_and_gradian_query_equal_a_direct_exact_pass(tmp_path, saved_model, indexed, capsys):
    cfg = load_config(None, indexed)
    specs = [QuerySpec(method="exact", top_k="all", **settings) for settings, _ in CASES]
    got = dense_scores(cfg, specs)
    for (_, expected), matrix in zip(CASES, got):
        assert matrix.shape == (len(QUERIES), len(ROWS)) and matrix.dtype == np.float32
        _close(matrix, reference(saved_model, **expected))
    # The index path is unchanged beside them, in the same call.
    index_path = dense_scores(cfg, [QuerySpec(method="index", score="inner", precondition="none", top_k="all")])[0]
    assert not np.allclose(index_path, got[0], rtol=1e-3)  # projected at k = 4: not the exact scores

    # gradian query with the defaults and query.method=exact: the top and bottom rows of the same scores.
    out = tmp_path / "exact.jsonl"
    assert (
        main(["query", *indexed, "query.method=exact", "query.top_k=3", "query.bottom_k=2", f"query.output={out}"]) == 0
    )
    printed = capsys.readouterr().out
    scoring = exact_estimator(QuerySpec(method="exact")).describe()
    assert scoring.startswith("exact pass: full-space") and scoring in printed
    expected = reference(saved_model, kind=AUTO_FACTORS, horizon=AUTO_HORIZON, cosine=AUTO_COSINE, head=AUTO_HEAD)
    for q, line in enumerate(out.read_text().splitlines()):
        entry = json.loads(line)
        assert entry["query_id"] == QUERIES[q]["id"] and entry["scoring"] == scoring
        order = np.argsort(-expected[q])
        assert [r["index"] for r in entry["results"]] == order[:3].tolist()
        assert [r["index"] for r in entry["opponents"]] == order[::-1][:2].tolist()
        assert [r["id"] for r in entry["results"]] == [str(ROWS[i].get("id", i)) for i in order[:3]]
        _close(np.array([r["score"] for r in entry["results"]]), expected[q, order[:3]])
    # gradian report of those results: the page names the exact pass and holds every row's score.
    assert main(["report", *indexed, "query.method=exact", "query.top_k=3", f"query.output={out}"]) == 0
    page = out.with_suffix(".html").read_text()
    assert scoring in page and "Tokens are not shaded" in page


def test_rows_the_index_never_ranks_are_nan_and_left_out_of_the_fit(tmp_path, saved_model, indexed):
    zarr.open_group(str(tmp_path / "ix"), mode="r+")["complete"][2] = False  # as if row 2 were never written
    cfg = load_config(None, indexed)
    (got,) = dense_scores(
        cfg, [QuerySpec(method="exact", precondition="ekfac", damping=0.1, score="inner", top_k="all")]
    )
    assert np.isnan(got[:, 2]).all() and np.isfinite(np.delete(got, 2, axis=1)).all()
    kept = [r for i, r in enumerate(ROWS) if i != 2]
    _close(np.delete(got, 2, axis=1), reference(saved_model, kind="ekfac", train=kept))


def test_two_checkpoints_sum_with_their_learning_rate_weights(tmp_path, saved_model, tokenizer, capsys):
    tuned = tmp_path / "tuned"
    make_model(len(tokenizer), seed=1).save_pretrained(tuned)
    tokenizer.save_pretrained(tuned)
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "queries.jsonl", QUERIES)
    common = _settings(tmp_path, tuned, f"model.checkpoints=[{saved_model},{tuned}]")
    assert main(["index", *common]) == 0
    # Learning rates 1 and 3 recorded for the two checkpoints: weights 1/4 and 3/4.
    root = zarr.open_group(str(tmp_path / "ix"), mode="r+")
    attrs = dict(root.attrs["gradian"])
    attrs["checkpoints"] = [{**e, "lr": lr} for e, lr in zip(attrs["checkpoints"], (1.0, 3.0))]
    root.attrs["gradian"] = attrs
    assert [e["lr"] for e in open_index(tmp_path / "ix").checkpoints] == [1.0, 3.0]
    cfg = load_config(None, common)
    spec = QuerySpec(method="exact", precondition="ekfac", damping=0.1, score="inner", checkpoints="all", top_k="all")
    (got,) = dense_scores(cfg, [spec])
    base, fine = reference(saved_model, kind="ekfac"), reference(tuned, kind="ekfac")
    _close(got, 0.25 * base + 0.75 * fine)
    (last,) = dense_scores(
        cfg, [QuerySpec(method="exact", precondition="ekfac", damping=0.1, score="inner", checkpoints="last")]
    )
    _close(last, fine)
    capsys.readouterr()
    assert (
        main(
            [
                "query",
                *common,
                "query.method=exact",
                "query.precondition=ekfac",
                "query.damping=0.1",
                "query.score=inner",
            ]
        )
        == 0
    )
    assert (
        "exact pass: full-space EK-FAC influence, damping 0.1, summed over 2 checkpoints weighted by learning rate"
        in capsys.readouterr().out
    )


def test_fitted_factors_are_kept_in_the_index_and_a_half_written_set_is_refitted(
    tmp_path, saved_model, indexed, monkeypatch
):
    cfg = load_config(None, indexed)
    spec = QuerySpec(method="exact", precondition="ekfac", damping=0.1, score="inner", top_k="all")
    real, fits = recipe.fit_factors, []

    def counted(*args, **kwargs):
        fits.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(recipe, "fit_factors", counted)
    (first,) = dense_scores(cfg, [spec])
    assert len(fits) == 1
    group = zarr.open_group(str(tmp_path / "ix"), mode="r")["factors/step-0-ekfac"]
    assert group.attrs["complete"] is True and group.attrs["key"]["kind"] == "ekfac"

    def refused(*args, **kwargs):
        raise AssertionError("the factors were fitted again")

    monkeypatch.setattr(recipe, "fit_factors", refused)
    (second,) = dense_scores(cfg, [spec, QuerySpec(method="exact", precondition="ekfac", horizon=5.0)])[:1]
    np.testing.assert_array_equal(first, second)

    # A set cut short (no "complete": a fit killed while writing) is ignored and written again.
    zarr.open_group(str(tmp_path / "ix"), mode="r+")["factors/step-0-ekfac"].attrs.pop("complete")
    monkeypatch.setattr(recipe, "fit_factors", counted)
    (third,) = dense_scores(cfg, [spec])
    assert len(fits) == 2
    np.testing.assert_array_equal(first, third)
    assert zarr.open_group(str(tmp_path / "ix"), mode="r")["factors/step-0-ekfac"].attrs["complete"] is True
    # Other rows are another fit: the key differs.
    zarr.open_group(str(tmp_path / "ix"), mode="r+")["complete"][1] = False
    dense_scores(cfg, [spec])
    assert len(fits) == 3


def test_validate_reports_an_exact_scorer(tmp_path, saved_model, indexed, capsys):
    out = tmp_path / "validate"
    args = [
        "validate",
        *indexed,
        f"validate.output={out}",
        "validate.num_subsets=5",
        "validate.epochs=1",
        "validate.batch_size=4",
        "validate.learning_rate=0.01",
        "validate.scorers=[{score: inner, precondition: none},{method: exact, precondition: none, score: inner}]",
    ]
    assert main(args) == 0
    report = json.loads((out / "lds.json").read_text())
    names = [s["name"] for s in report["scorers"]]
    assert names == ["score=inner, precondition=none", "method=exact, precondition=none, score=inner"]
    assert all(np.isfinite(s["lds"]) for s in report["scorers"])
    assert "method=exact" in capsys.readouterr().out


@pytest.mark.parametrize(
    "settings, key",
    [
        (["query.method=exhaustive"], "query.method"),
        (["query.horizon=-1"], "query.horizon"),
        (["query.method=index", "query.horizon=2"], "query.horizon"),
        (["query.method=index", "query.precondition=kfac"], "query.precondition"),
        (["query.horizon=2", "query.precondition=fisher"], "query.horizon"),  # auto: fisher asks for the index
        (["query.exact_budget=-1"], "query.exact_budget"),
        (["query.method=exact", "query.precondition=fisher"], "query.precondition"),
        (["query.method=exact", "query.precondition=diag"], "query.precondition"),
        (["query.method=exact", "query.normalize=module"], "query.normalize"),
        (["query.method=exact", "query.precondition=none", "query.horizon=1"], "query.horizon"),
        (["query.method=exact", "query.search=ann"], "query.search"),
        (["query.method=exact", "query.engine=dask"], "query.engine"),
        (["query.method=exact", "query.token_scores=true"], "query.token_scores"),
    ],
)
def test_each_exact_setting_refusal_is_one_line_naming_the_setting(settings, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, settings)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"setting '{key}'=") and "; use " in message


def test_the_estimator_is_resolved_in_one_place():
    assert exact_estimator(QuerySpec(method="exact")).horizon == AUTO_HORIZON
    assert exact_estimator(QuerySpec(method="exact"), checkpoints=2).horizon == AUTO_HORIZON
    assert exact_estimator(QuerySpec(method="exact"), checkpoints=3).horizon == AUTO_HORIZON_TRAJECTORY
    assert exact_estimator(QuerySpec(method="exact", horizon=5.0), checkpoints=3).horizon == 5.0
    assert exact_estimator(QuerySpec(method="exact", horizon=None)).horizon is None  # auto's kind, as influence
    assert exact_estimator(QuerySpec(method="exact", precondition="ekfac")).horizon is None
    assert exact_estimator(QuerySpec(method="exact", precondition="none", score="auto")).cosine is AUTO_COSINE
    assert exact_estimator(QuerySpec(method="exact", precondition="ekfac", score="inner")).cosine is False
    assert QuerySpec(method="exact", precondition="kfac", damping=0.1)  # kfac is allowed under exact
    # The output head is a second part of auto's estimator only, and only as a cosine: the field's
    # estimators (kfac, ekfac, none) stay over the index's modules, as issue 41's references.
    assert exact_estimator(QuerySpec(method="exact")).head is AUTO_HEAD
    assert exact_estimator(QuerySpec(method="exact", score="inner")).head is False
    assert exact_estimator(QuerySpec(method="exact", precondition="kfac")).head is False


def test_auto_counts_the_heads_weights_in_the_exact_pass_cost(tmp_path, indexed, saved_model):
    """The cost line's weights are the index's modules' plus the output head's [out, in], which the
    index records; an estimator without the head counts the modules alone."""
    reader = open_index(tmp_path / "ix").reader
    model = AutoModelForCausalLM.from_pretrained(saved_model)
    modules = sum(m.weight.numel() for m in select_modules(model, IndexSpec().module_filter).values())
    assert reader.meta.model["head_features"] == list(model.lm_head.weight.shape)
    _, why = resolve_method(QuerySpec(), reader, 1)
    assert f"x {modules + model.lm_head.weight.numel():,} weights" in why
    _, why = resolve_method(QuerySpec(score="inner"), reader, 1)
    assert f"x {modules:,} weights" in why


def test_a_head_the_settings_cannot_score_is_said_and_left_out(tmp_path, indexed, saved_model, capsys):
    """grads.loss_chunk_tokens runs the head outside its module: auto's scores are then the index's
    modules' alone, and the output says so with the fix."""
    out = tmp_path / "chunked.jsonl"
    settings = ["query.method=exact", "query.top_k=all", "grads.loss_chunk_tokens=4", f"query.output={out}"]
    assert main(["query", *indexed, *settings]) == 0
    assert "the output head is left out: grads.loss_chunk_tokens runs it outside its module" in capsys.readouterr().out
    expected = reference(saved_model, kind=AUTO_FACTORS, horizon=AUTO_HORIZON, cosine=AUTO_COSINE)
    for q, line in enumerate(out.read_text().splitlines()):
        entry = json.loads(line)
        assert "plus the output head" not in entry["scoring"]
        got = {r["index"]: r["score"] for r in entry["results"]}
        _close(np.array([got[i] for i in range(len(ROWS))]), expected[q])


def test_auto_runs_the_exact_pass_within_its_budget_and_the_index_past_it(tmp_path, indexed, capsys):
    """query.method=auto: the cost is supervised tokens x checkpoints x selected weights, against
    query.exact_budget; the summary names the method chosen and why, and the scores are that method's."""
    cfg = load_config(None, indexed)
    within, past = QuerySpec(top_k="all"), QuerySpec(top_k="all", exact_budget=0)
    got_within, got_past = dense_scores(cfg, [within, past])
    exact, index = dense_scores(cfg, [QuerySpec(method="exact", top_k="all"), QuerySpec(method="index", top_k="all")])
    np.testing.assert_array_equal(got_within, exact)
    np.testing.assert_array_equal(got_past, index)
    assert main(["query", *indexed, "query.top_k=2"]) == 0
    assert "(query.method=auto: exact (" in capsys.readouterr().out
    assert main(["query", *indexed, "query.top_k=2", "query.exact_budget=0"]) == 0
    printed = capsys.readouterr().out
    assert "(query.method=auto: index (" in printed and "above query.exact_budget=0" in printed


def test_auto_past_its_budget_never_reads_the_training_data(tmp_path, indexed):
    """Reading and fingerprinting data.train is asked for only when the exact pass is affordable:
    a large index going to the index path does not hash its training data first."""
    reader = open_index(tmp_path / "ix").reader

    def unreadable():
        raise AssertionError("the training data was read past the budget")

    spec, why = resolve_method(QuerySpec(exact_budget=0), reader, 1, unreadable)
    assert spec.method == "index" and "above query.exact_budget=0" in why
    spec, why = resolve_method(QuerySpec(), reader, 1, lambda: "the data changed")
    assert spec.method == "index" and why.endswith("(the exact pass cannot run: the data changed)")


def test_changed_training_data_and_stored_rows_only_callers_are_refused(tmp_path, indexed):
    index = open_index(tmp_path / "ix")
    with pytest.raises(ConfigError, match=r"Index.topk\(method='exact'\) scores the stored rows only"):
        index.topk(torch.zeros(1, index.meta.width), 2, method="exact")
    with pytest.raises(ConfigError, match=r"Index.score_all\(method='exact'\)"):
        index.score_all(torch.zeros(1, index.meta.width), method="exact")
    write_jsonl(tmp_path / "train.jsonl", ROWS[::-1])  # edited after indexing
    with pytest.raises(ConfigError) as err:
        run_query(load_config(None, [*indexed, "query.method=exact"]))
    message = str(err.value)
    assert "\n" not in message and "data.train" in message and "changed after it was indexed" in message
    assert "query.method=index" in message


def test_queries_past_the_memory_budget_are_scored_in_several_passes(tmp_path, saved_model, indexed, monkeypatch):
    """One query per pass (a budget below one query's directions) gives the scores of one pass."""
    import gradian_lightning.query.exact_scoring as exact_scoring

    cfg = load_config(None, indexed)
    spec = QuerySpec(method="exact", precondition="ekfac", damping=0.1, score="inner", top_k="all")
    (together,) = dense_scores(cfg, [spec])
    passes = []
    real = exact_scoring.ExactPass

    def counted(*args, **kwargs):
        passes.append(args[2]["input_ids"].shape[0])
        return real(*args, **kwargs)

    trims = []
    monkeypatch.setattr(exact_scoring, "QUERY_BYTES", 1)
    monkeypatch.setattr(exact_scoring, "ExactPass", counted)
    monkeypatch.setattr(exact_scoring, "return_freed_memory", lambda: trims.append(len(passes)))
    (apart,) = dense_scores(cfg, [spec])
    assert passes == [1] * len(QUERIES)
    _close(apart, together)
    # Freed memory is handed back once a pass's directions are made and again once it is done.
    assert trims == [n for n in range(1, len(QUERIES) + 1) for _ in range(2)]


def test_returning_freed_memory_is_a_no_op_without_malloc_trim(monkeypatch):
    import ctypes

    import gradian_lightning.query.exact_scoring as exact_scoring

    exact_scoring.return_freed_memory()  # glibc here: malloc_trim(0) runs
    for missing in (OSError("no C library"), AttributeError("malloc_trim"), TypeError("no handle")):

        def library(name, missing=missing):
            raise missing

        monkeypatch.setattr(ctypes, "CDLL", library)
        assert exact_scoring.return_freed_memory() is None


def test_an_index_that_cannot_keep_its_factors_warns_and_scores_the_same(tmp_path, saved_model, indexed, monkeypatch):
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(recipe, "write_factor_set", read_only)
    cfg = load_config(None, indexed)
    with pytest.warns(UserWarning, match="the fitted factors could not be kept in the index at .*fits them again"):
        (got,) = dense_scores(cfg, [QuerySpec(method="exact", precondition="kfac", damping=0.1, score="inner")])
    _close(got, reference(saved_model, kind="kfac", damping=0.1))


def test_deleted_training_data_is_refused_naming_data_train(tmp_path, indexed):
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(ConfigError) as err:
        dense_scores(load_config(None, indexed), [QuerySpec(method="exact")])
    message = str(err.value)
    assert "\n" not in message and "data.train" in message and "cannot be read any more" in message
