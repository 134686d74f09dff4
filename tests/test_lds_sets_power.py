"""benchmarks/studies/lds_sets at more subsets and queries (issue 41's margin over BM25): more
queries on a set leave its training rows (and the tiny sets' tokenizer vocabulary, hence their
base model) as they were; a run still training is scored on its finished subsets; the paired
difference against BM25 is the mean and standard error of per-query differences."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.studies.lds_sets.common import noise_ceiling, paired_difference, subset_standard_error
from benchmarks.studies.lds_sets.kinds import facts, paraphrase, smollm2
from benchmarks.studies.lds_sets.run import sized, spec_for
from benchmarks.studies.lds_sets.trajectory import finished_runs, on_first_subsets
from gradian_lightning.recipes.quickstart import word_tokenizer
from gradian_lightning.validation.subsets import SubsetRuns

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "studies" / "lds_sets" / "data"


def test_paraphrase_remakes_every_committed_smollm2_query_from_its_source():
    # The committed queries were made by another generator (benchmarks/ranking_make_data.py): an
    # independent record of the phrasing that `paraphrase` must reproduce word for word.
    train = {r["id"]: r for r in map(json.loads, (DATA / "fact.train.jsonl").read_text().splitlines())}
    committed = [json.loads(line) for line in (DATA / "fact.queries.jsonl").read_text().splitlines()]
    assert len(committed) == 24
    assert [paraphrase(train[q["sources"][0]]) for q in committed] == committed


def test_more_smollm2_queries_keep_the_rows_and_the_first_24_queries():
    train24, queries24, _ = smollm2(80, 24, 0, 0)
    train48, queries48, _ = smollm2(80, 48, 0, 0)
    assert train48 == train24 and queries48[:24] == queries24 and len(queries48) == 48
    sources = [q["sources"][0] for q in queries48]
    assert len(set(sources)) == 48 and set(sources) <= {r["id"] for r in train48}
    assert smollm2(80, 48, 0, 0) == (train48, queries48, [])  # deterministic
    assert len(smollm2(80, 80, 0, 0)[1]) == 80
    with pytest.raises(ValueError, match="at most 80 queries"):
        smollm2(80, 81, 0, 0)


def test_more_facts_queries_keep_the_rows_and_the_tokenizer():
    train24, queries24, base24 = facts(256, 24, 0, 1024)
    train96, queries96, base96 = facts(256, 96, 0, 1024)
    assert train96 == train24 and base96 == base24
    sources = [q["sources"][0] for q in queries96]
    assert len(set(sources)) == 96
    # run.py's tokenizer is built over every text of the set, queries included: the same vocabulary
    # means the same base model (tiny_base) and fine-tune, trained from the same rows and seeds.
    texts = lambda *sets: [r["prompt"] + r["completion"] for s in sets for r in s]  # noqa: E731
    assert (
        word_tokenizer(texts(train96, queries96, base96)).get_vocab()
        == word_tokenizer(texts(train24, queries24, base24)).get_vocab()
    )


def test_more_subsets_or_queries_name_their_own_set_and_the_defaults_keep_theirs():
    spec = spec_for("facts", 256, smoke=False)
    assert (spec.num_subsets, spec.queries, spec.repeats, spec.name) == (24, 24, 2, "facts-N256")
    assert sized(spec_for("facts", 256, smoke=False), None, 24, 24).name == "facts-N256"
    spec = sized(spec_for("smollm2", 80, smoke=False), None, 48, 48)
    assert (spec.num_subsets, spec.queries, spec.name) == (48, 48, "smollm2-N80-M48-Q48")
    assert sized(spec_for("facts", 512, smoke=False), 1e-3, 96, None).name == "facts-N512-lr0.001-M96"


def test_paired_difference_is_the_mean_and_standard_error_of_per_query_differences():
    a, b = [0.5, 0.2, float("nan"), 0.9, 0.1], [0.1, 0.4, 0.3, 0.2, 0.0]
    kept = [0.4, -0.2, 0.7, 0.1]  # the third query has no LDS on one side
    mean = sum(kept) / 4
    se = (sum((x - mean) ** 2 for x in kept) / 3 / 4) ** 0.5
    assert paired_difference(a, b) == pytest.approx((mean, se), abs=1e-12)
    assert paired_difference([float("nan")] * 3, b[:3]) is None


def test_a_run_still_training_is_scored_on_its_finished_subsets(tmp_path):
    plan = {"num_subsets": 4, "alpha": 0.5, "seed": 3, "repeats": 2}
    runs = SubsetRuns(tmp_path, plan, 10)
    done = [(m, r) for m in range(2) for r in range(2)] + [(2, 0)]  # subset 2's second repeat is unfinished
    for m, r in done:
        runs.save(m, r, 0, np.array([m + 10.0 * r, 1.0]), 0.0)
    with pytest.raises(SystemExit, match="3 training runs are unfinished"):
        finished_runs(tmp_path, partial=False)
    subsets, losses = finished_runs(tmp_path, partial=True)
    assert np.array_equal(subsets, runs.subsets[:2])
    assert losses.tolist() == [[[0.0, 1.0], [1.0, 1.0]], [[10.0, 1.0], [11.0, 1.0]]]  # [repeats, M', Q]


def test_noise_ceiling_is_the_spearman_of_one_retraining_against_the_other():
    rng = np.random.default_rng(0)
    first = rng.standard_normal((12, 3))
    second = first + 0.5 * rng.standard_normal((12, 3))
    ceiling = noise_ceiling(np.stack([first, second]))

    def ranks(x):
        return np.argsort(np.argsort(x))

    per_query = [np.corrcoef(ranks(first[:, q]), ranks(second[:, q]))[0, 1] for q in range(3)]
    assert ceiling["lds"] == pytest.approx(np.mean(per_query), abs=1e-12)
    assert ceiling["standard_error"] == pytest.approx(np.std(per_query, ddof=1) / np.sqrt(3), abs=1e-12)
    assert noise_ceiling(first[None]) is None


def test_lds_on_the_first_subsets_is_the_lds_of_those_subsets_alone():
    from gradian_lightning.validation.lds import linear_datamodeling_score

    rng = np.random.default_rng(1)
    scores, subsets, outputs = rng.standard_normal((3, 8)), rng.random((10, 8)) < 0.5, rng.standard_normal((10, 3))
    found = on_first_subsets(scores, subsets, outputs, [4, 6, 10, 12])
    assert list(found) == ["4", "6"]  # m at or past M is the full figure, already kept
    assert found["6"] == linear_datamodeling_score(scores, subsets[:6], outputs[:6]).tolist()
    assert found["4"] != found["6"]


def test_the_subsets_standard_error_is_a_jackknife_over_blocks_of_subsets():
    from gradian_lightning.validation.lds import linear_datamodeling_score

    rng = np.random.default_rng(2)
    scores, other = rng.standard_normal((4, 9)), rng.standard_normal((4, 9))
    subsets, outputs = rng.random((12, 9)) < 0.5, rng.standard_normal((12, 4))

    def mean_without(m, minus):  # delete-one jackknife by hand: the mean over queries without subset m
        keep = [i for i in range(12) if i != m]
        lds = linear_datamodeling_score(scores, subsets[keep], outputs[keep])
        if minus:
            lds = lds - linear_datamodeling_score(other, subsets[keep], outputs[keep])
        return lds.mean()

    for minus in (False, True):
        means = np.array([mean_without(m, minus) for m in range(12)])
        expected = np.sqrt(11 / 12 * np.sum((means - means.mean()) ** 2))
        found = subset_standard_error(scores, subsets, outputs, other if minus else None, groups=12)
        assert found == pytest.approx(expected, rel=1e-12)
