"""benchmarks/studies/lds_sets/kinds.py: more queries on a set leave its training rows (and the
tiny sets' tokenizer vocabulary, hence their base model) as they were, so a study with more
queries measures the same models."""

import json
from pathlib import Path

import pytest

from benchmarks.studies.lds_sets.kinds import facts, paraphrase, smollm2
from benchmarks.studies.lds_sets.run import sized, spec_for
from gradian_lightning.recipes.quickstart import word_tokenizer

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
