"""`gradian validate`: the LDS maths against an independent computation, a planted case with a known
answer, and the command end to end on a tiny model, killed and resumed."""

import json
import signal

import numpy as np
import pytest
from conftest import MAPPED, ROWS, write_jsonl, write_renamed_parquet

from gradian_lightning.cli import main
from gradian_lightning.errors import ConfigError
from gradian_lightning.validation.lds import linear_datamodeling_score, shared_variance_share, spearman
from gradian_lightning.validation.subsets import SubsetRuns, random_subsets


def reference_spearman(a, b):
    """Spearman's rho by its definition, written independently: average ranks by counting, then Pearson."""

    def ranks(x):
        return np.array([np.sum(x < v) + (np.sum(x == v) - 1) / 2 for v in x], dtype=float)

    return float(np.corrcoef(ranks(np.asarray(a)), ranks(np.asarray(b)))[0, 1])


def test_spearman_matches_its_definition_with_ties():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 5, size=(6, 30)).astype(float)  # many ties
    b = a + rng.normal(size=a.shape)
    got = spearman(a, b)
    assert got.shape == (6,)
    np.testing.assert_allclose(got, [reference_spearman(x, y) for x, y in zip(a, b)], rtol=1e-12)
    assert np.isnan(spearman(np.ones(5), np.arange(5.0)))  # a constant side has no ranking


def test_a_scorer_equal_to_the_true_effect_reaches_lds_near_one_and_random_near_zero():
    rng = np.random.default_rng(1)
    queries, rows, models = 10, 80, 64
    effect = rng.normal(size=(queries, rows))  # each row's true effect on each query's output
    subsets = random_subsets(rows, models, 0.5, seed=2)
    assert (subsets.sum(axis=1) == 40).all()
    outputs = subsets @ effect.T + 0.05 * rng.normal(size=(models, queries))  # what training did, plus noise
    truth = linear_datamodeling_score(effect, subsets, outputs)
    assert truth.shape == (queries,) and truth.min() > 0.95
    random = linear_datamodeling_score(rng.normal(size=(queries, rows)), subsets, outputs)
    assert abs(random.mean()) < 0.1
    # and the per-query values are Spearman of the summed scores, as defined
    predicted = subsets @ effect.T
    assert truth[3] == pytest.approx(reference_spearman(predicted[:, 3], outputs[:, 3]), abs=1e-12)


def reference_centred_lds(scores, subsets, outputs):
    """Centred LDS by its definition, one query at a time: each subset's mean over the queries is
    taken out of the predicted and the measured output by explicit loops, then Spearman."""
    models, queries = outputs.shape
    predicted = [[sum(scores[q, i] for i in np.flatnonzero(subsets[m])) for q in range(queries)] for m in range(models)]
    lds = []
    for q in range(queries):
        mine = [predicted[m][q] - sum(predicted[m]) / queries for m in range(models)]
        measured = [outputs[m, q] - sum(outputs[m]) / queries for m in range(models)]
        lds.append(reference_spearman(mine, measured))
    return np.array(lds)


def reference_shared_share(outputs):
    """The shared share by a two-way analysis of variance: subset effect over subset + residual."""
    grand = outputs.mean()
    subset_effect = outputs.mean(axis=1) - grand  # [M]
    query_effect = outputs.mean(axis=0) - grand  # [Q]
    shared = outputs.shape[1] * np.sum(subset_effect**2)
    specific = np.sum((outputs - grand - subset_effect[:, None] - query_effect[None, :]) ** 2)
    return shared / (shared + specific)


def test_centred_lds_and_the_shared_share_match_a_per_query_loop():
    rng = np.random.default_rng(3)
    queries, rows, models = 7, 30, 20
    scores = rng.normal(size=(queries, rows))
    subsets = random_subsets(rows, models, 0.5, seed=4)
    outputs = rng.normal(size=(models, queries)) + rng.normal(size=(models, 1))
    np.testing.assert_allclose(
        linear_datamodeling_score(scores, subsets, outputs, centred=True),
        reference_centred_lds(scores, subsets, outputs),
        atol=1e-12,
    )
    assert shared_variance_share(outputs) == pytest.approx(reference_shared_share(outputs), abs=1e-12)


def test_raw_lds_rewards_the_shared_movement_and_centred_lds_does_not():
    rng = np.random.default_rng(5)
    queries, rows, models = 12, 80, 64
    format_effect = rng.normal(size=rows)  # each row's effect on every query: a shared format
    own_effect = rng.normal(size=(queries, rows))  # each row's effect on one query alone
    subsets = random_subsets(rows, models, 0.5, seed=6)
    shared, own = subsets @ format_effect, subsets @ own_effect.T  # [M], [M, Q]
    outputs = 3 * shared[:, None] + own
    assert shared_variance_share(outputs) == pytest.approx(9 / 10, abs=0.1)  # 3² : 1 by construction
    same_for_all = np.tile(format_effect, (queries, 1)) + 1e-3 * rng.normal(size=(queries, rows))
    raw, centred = (linear_datamodeling_score(same_for_all, subsets, outputs, centred=c).mean() for c in (0, 1))
    assert raw > 0.85 and abs(centred) < 0.15  # predicts the movement all queries share, nothing of each one's own
    raw, centred = (linear_datamodeling_score(own_effect, subsets, outputs, centred=c).mean() for c in (0, 1))
    assert raw < 0.5 and centred > 0.9  # the reverse: each query's own rows, blind to the shared part


def _index(tmp_path, saved_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    queries = write_jsonl(tmp_path / "queries.jsonl", ROWS[:3])
    common = [
        f"model.name_or_path={saved_model}",
        f"data.train={data}",
        f"query.data={queries}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "grads.batch_size=4",
    ]
    assert main(["index", *common]) == 0
    capsys.readouterr()
    return common


def test_validate_end_to_end_matches_an_independent_lds_and_resumes(tmp_path, saved_model, capsys, monkeypatch):
    common = _index(tmp_path, saved_model, capsys)
    out = tmp_path / "validate"
    args = [
        "validate",
        *common,
        f"validate.output={out}",
        "validate.num_subsets=5",
        "validate.epochs=1",
        "validate.batch_size=4",
        "validate.learning_rate=0.01",
        "validate.repeats=2",
        "validate.scorers=[{},{score: inner, precondition: none}]",
    ]
    import gradian_lightning.recipes.validate as recipe

    real, calls = recipe.fine_tune, []

    def killed_on_the_fifth_run(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(recipe, "fine_tune", killed_on_the_fifth_run)
    assert main(args) == 130
    assert "the finished training runs are kept; rerun the same command" in capsys.readouterr().err
    kept = sorted((out / "subsets").glob("*.json"))
    assert len(kept) == 4 and not list((out / "subsets").glob("*.part"))
    before = {p: p.read_text() for p in kept}
    calls.clear()
    monkeypatch.setattr(recipe, "fine_tune", real)
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert (
        "gradian validate: LDS over 5 retrained subsets (2 run(s) each)" in printed
        and "retraining noise ceiling" in printed
        and "moves all queries together" in printed
        and "centred LDS" in printed
    )
    assert all(p.read_text() == text for p, text in before.items())  # the finished runs were kept, not redone
    assert len(list((out / "subsets").glob("*.json"))) == 10

    report = json.loads((out / "lds.json").read_text())
    assert [s["name"] for s in report["scorers"]] == ["query.* settings", "score=inner, precondition=none"]
    per_query = [json.loads(line) for line in (out / "lds_per_query.jsonl").read_text().splitlines()]
    assert len(per_query) == 2 * 3

    # Independent recomputation of the inner/none scorer's LDS from what is on disk and gradian query's scores.
    subsets = np.array(json.loads((out / "plan.json").read_text())["subsets"], dtype=bool)
    losses = np.array(
        [
            [
                json.loads((out / "subsets" / f"subset-{m:03d}-repeat-{r}.json").read_text())["query_loss"]
                for m in range(5)
            ]
            for r in range(2)
        ]
    )
    results = tmp_path / "all.jsonl"
    assert (
        main(
            [
                "query",
                *common,
                "query.top_k=all",
                "query.score=inner",
                "query.precondition=none",
                f"query.output={results}",
            ]
        )
        == 0
    )
    scores = np.zeros((3, len(ROWS)))
    for q, line in enumerate(results.read_text().splitlines()):
        for r in json.loads(line)["results"]:
            scores[q, r["index"]] = r["score"]
    outputs = -losses.mean(axis=0)
    expected = [reference_spearman(subsets.astype(float) @ scores[q], outputs[:, q]) for q in range(3)]
    got = [row["lds"] for row in per_query if row["scorer"] == "score=inner, precondition=none"]
    np.testing.assert_allclose(got, expected, atol=1e-9)
    got = [row["centred_lds"] for row in per_query if row["scorer"] == "score=inner, precondition=none"]
    np.testing.assert_allclose(got, reference_centred_lds(scores, subsets, outputs), atol=1e-9)
    assert report["shared_variance"] == pytest.approx(reference_shared_share(outputs), abs=1e-12)
    first, second = -losses[0], -losses[1]
    centred_ceiling = [
        reference_spearman(first[:, q] - first.mean(axis=1), second[:, q] - second.mean(axis=1)) for q in range(3)
    ]
    assert report["ceiling"]["centred_lds"] == pytest.approx(np.nanmean(centred_ceiling), abs=1e-9)


def test_ctrl_c_inside_a_retraining_run_exits_130_with_gradians_line(tmp_path, saved_model, capfd, monkeypatch):
    """Ctrl-C while Lightning trains a subset: Lightning catches the KeyboardInterrupt, logs its own
    line and calls sys.exit(1); `gradian validate` still exits 130 with the line
    docs/troubleshooting.md promises, and the SIGINT handler Lightning ignored is put back."""
    from gradian_lightning.validation.retrain import FineTune

    common = _index(tmp_path, saved_model, capfd)
    real, steps = FineTune.training_step, []

    def interrupted_at_the_third_step(self, batch, batch_idx):
        steps.append(batch_idx)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real(self, batch, batch_idx)

    monkeypatch.setattr(FineTune, "training_step", interrupted_at_the_third_step)
    handler = signal.getsignal(signal.SIGINT)
    settings = ["validate.num_subsets=5", "validate.epochs=1", "validate.batch_size=2", "validate.repeats=1"]
    assert main(["validate", *common, f"validate.output={tmp_path / 'v'}", *settings]) == 130
    out, err = capfd.readouterr()
    assert (
        "gradian validate: interrupted: the finished training runs are kept; rerun the same command to resume from them"
        in err
    )
    assert "Detected KeyboardInterrupt" not in out + err and "Traceback" not in err
    assert len(steps) == 3 and signal.getsignal(signal.SIGINT) is handler


def test_a_parquet_file_with_renamed_columns_validates_as_its_jsonl_twin(tmp_path, saved_model, capsys):
    """validate reads data.train and query.data as gradian index does: any source, through the
    data.*_field mapping; the same rows give the same subsets, losses and LDS."""
    reports = []
    for write, suffix, mapped in ((write_jsonl, ".jsonl", ()), (write_renamed_parquet, ".parquet", MAPPED)):
        folder = tmp_path / suffix[1:]
        folder.mkdir()
        common = [
            f"model.name_or_path={saved_model}",
            f"data.train={write(folder / f'train{suffix}', ROWS)}",
            f"query.data={write(folder / f'queries{suffix}', ROWS[:3])}",
            f"index.path={folder / 'ix'}",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false",
            *mapped,
        ]
        assert main(["index", *common]) == 0
        settings = ["validate.num_subsets=5", "validate.epochs=1", "validate.batch_size=4"]
        assert main(["validate", *common, f"validate.output={folder / 'out'}", *settings]) == 0
        reports.append(json.loads((folder / "out" / "lds.json").read_text()))
    capsys.readouterr()
    assert reports[1] == reports[0] and reports[0]["queries"] == 3


def test_top_k_all_ranks_every_row(tmp_path, saved_model, capsys):
    common = _index(tmp_path, saved_model, capsys)
    results = tmp_path / "r.jsonl"
    assert main(["query", *common, "query.top_k=all", f"query.output={results}"]) == 0
    ranked = [json.loads(line)["results"] for line in results.read_text().splitlines()]
    assert all(sorted(r["index"] for r in rows) == list(range(len(ROWS))) for rows in ranked)


def test_validate_settings_and_a_missing_index_are_one_line(tmp_path, capsys):
    assert main(["validate", "validate.alpha=1.5"]) == 2
    assert "setting 'validate.alpha'=1.5 is not allowed; use a fraction between 0 and 1" in capsys.readouterr().err
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert (
        main(
            [
                "validate",
                "model.name_or_path=x",
                f"data.train={data}",
                f"query.data={data}",
                f"index.path={tmp_path / 'none'}",
            ]
        )
        == 2
    )
    assert "holds no Gradian index; gradian validate scores with the index of data.train" in capsys.readouterr().err


def test_a_finished_run_reads_back_with_the_subsets_and_losses_it_saved(tmp_path):
    plan = {"num_subsets": 3, "alpha": 0.5, "seed": 7, "repeats": 2}
    runs = SubsetRuns(tmp_path / "run", plan, num_rows=10)
    saved = np.arange(3 * 2 * 4, dtype=np.float64).reshape(2, 3, 4) / 7  # [repeats, M, Q]
    for m in range(3):
        for r in range(2):
            runs.save(m, r, seed=m + 1000 * r, query_loss=saved[r, m], seconds=0.0)
    again = SubsetRuns.existing(tmp_path / "run")
    assert np.array_equal(again.subsets, random_subsets(10, 3, 0.5, 7)) and again.repeats == 2
    np.testing.assert_array_equal(again.losses(), saved)
    with pytest.raises(
        ConfigError, match=r"holds no validation run \(no plan.json\); run gradian validate with it first$"
    ):
        SubsetRuns.existing(tmp_path / "nothing")


@pytest.mark.parametrize("subsets", [2, 4])
def test_too_few_subsets_for_a_rank_correlation_are_refused(subsets, capsys):
    # Below 5 subsets even a perfect ranking of every query is as likely as p = 2/4! = 0.083 under
    # random scores: no LDS printed could be told from chance, and 2 subsets always give ±1.
    code = main(
        [
            "validate",
            "model.name_or_path=m",
            "data.train=t.jsonl",
            "query.data=q.jsonl",
            f"validate.num_subsets={subsets}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"setting 'validate.num_subsets'={subsets} is not allowed; use an integer >= 5" in err
