"""The rows of each LDS set: fine-tune rows, queries (with planted `sources` where one exists) and,
for the tiny from-scratch models, the disjoint rows their base is trained on first.

    facts     made-up people's facts (the quickstart's attributes); each query asks one training
              row's fact in other words, so its planted source is that row. The base learns both
              phrasings on other people; the fine-tune learns new people.
    shared    the facts, but half the fine-tune rows and every query end in a sign-off the base
              never saw: a half holding more of those rows lowers every query's loss.
    format    rows are lists of words followed by a punctuation mark that names a transform of the
              list (rotate, swap, ...); a query applies a family's transform to words that occur in
              no fine-tune row. Its sources are every row of its family, which shares no content
              word with it, so word overlap (BM25) has nothing to find.
    smollm2   benchmarks/lds_data's fact set (80 rows, 24 paraphrased queries; copied to data/) on
              the real SmolLM2-135M-Instruct; more queries paraphrase further rows the same way.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Dict, List, Tuple

from gradian_lightning.recipes.quickstart.make_data import ATTRIBUTES, SYLLABLES

HERE = Path(__file__).resolve().parent
Rows = List[Dict]
SIGN_OFF = " Signed , the keeper of the old records , with thanks ."


def people(count: int, rng: random.Random) -> List[str]:
    """`count` distinct made-up names of three syllables (6,840 possible)."""
    names: set = set()
    while len(names) < count:
        names.add("".join(rng.sample(SYLLABLES, 3)).capitalize())
    return sorted(names)


def fact_rows(names: List[str], rng: random.Random, paraphrased: bool = False) -> Rows:
    """One row per (person, attribute): the asking phrasing, or the paraphrase (other prompt and
    completion words) with `paraphrased`. The value is drawn by `rng` in the same order either way."""
    rows = []
    for p in names:
        for attribute, (values, ask, paraphrase, answer) in ATTRIBUTES.items():
            v = rng.choice(values)
            prompt = (paraphrase if paraphrased else ask).format(p=p)
            completion = f" The {attribute} of {p} is {v} ." if paraphrased else " " + answer.format(p=p, v=v)
            rows.append({"id": f"{p}-{attribute}", "prompt": prompt, "completion": completion})
    return rows


def facts(rows: int, queries: int, seed: int, base_rows: int) -> Tuple[Rows, Rows, Rows]:
    """(fine-tune rows, queries, base rows) of the facts set: `rows` rows of new people."""
    rng = random.Random(seed)
    per_person = len(ATTRIBUTES)
    names = people(-(-rows // per_person) + -(-base_rows // per_person), rng)
    rng.shuffle(names)
    split = -(-rows // per_person)
    train_rng = random.Random(seed + 1)
    train = fact_rows(names[:split], train_rng)[:rows]
    again = fact_rows(names[:split], random.Random(seed + 1), paraphrased=True)[:rows]  # the same values
    base_people = names[split:]
    base = fact_rows(base_people, random.Random(seed + 2)) + fact_rows(
        base_people, random.Random(seed + 2), paraphrased=True
    )
    base = base[: 2 * base_rows]
    asked = sorted(rng.sample(range(len(train)), queries))
    query_rows = [{**again[i], "id": f"q-{again[i]['id']}", "sources": [train[i]["id"]]} for i in asked]
    return train, query_rows, base


def shared(rows: int, queries: int, seed: int, base_rows: int) -> Tuple[Rows, Rows, Rows]:
    """The facts set with `SIGN_OFF` after every second fine-tune row's and every query's completion."""
    train, query_rows, base = facts(rows, queries, seed, base_rows)
    signed = {r["id"] for r in random.Random(seed + 3).sample(train, len(train) // 2)}
    train = [{**r, "completion": r["completion"] + SIGN_OFF} if r["id"] in signed else r for r in train]
    query_rows = [{**q, "completion": q["completion"] + SIGN_OFF} for q in query_rows]
    return train, query_rows, base


# Each family's mark and transform of a 4-word list; the base learns the first two, the fine-tune the rest.
FAMILIES = {
    "=": lambda w: w,
    "<": lambda w: w[::-1],
    "#": lambda w: w[1:] + w[:1],
    "@": lambda w: w[-1:] + w[:-1],
    "%": lambda w: w[2:] + w[:2],
    "&": lambda w: [w[1], w[0], w[3], w[2]],
    "*": lambda w: [w[0], w[0], w[1], w[1]],
    "~": lambda w: [w[3], w[3], w[2], w[2]],
}
BASE_FAMILIES, NEW_FAMILIES = list(FAMILIES)[:2], list(FAMILIES)[2:]


def words(count: int, rng: random.Random) -> List[str]:
    """`count` distinct lowercase made-up words of two syllables."""
    found: set = set()
    while len(found) < count:
        found.add("".join(rng.sample(SYLLABLES, 2)))
    return sorted(found)


def transform_row(ident: str, family: str, chosen: List[str]) -> Dict:
    return {
        "id": ident,
        "family": family,
        "prompt": " ".join(chosen) + f" {family}",
        "completion": " " + " ".join(FAMILIES[family](chosen)) + " .",
    }


def format_set(rows: int, queries: int, seed: int, base_rows: int) -> Tuple[Rows, Rows, Rows]:
    """(fine-tune rows, queries, base rows) of the format set. The base sees every word (in the two
    base families, and the new families' marks never); fine-tune rows use the first 240 words,
    queries only the other 60, so a query shares no word with any fine-tune row."""
    rng = random.Random(seed)
    vocabulary = words(300, rng)
    rng.shuffle(vocabulary)
    seen, held_out = vocabulary[:240], vocabulary[240:]
    base = [transform_row(f"base-{i}", BASE_FAMILIES[i % 2], rng.sample(vocabulary, 4)) for i in range(base_rows)]
    train = [transform_row(f"row-{i}", NEW_FAMILIES[i % len(NEW_FAMILIES)], rng.sample(seen, 4)) for i in range(rows)]
    by_family = {f: [r["id"] for r in train if r["family"] == f] for f in NEW_FAMILIES}
    query_rows = []
    for q in range(queries):
        family = NEW_FAMILIES[q % len(NEW_FAMILIES)]
        query_rows.append({**transform_row(f"q-{q}", family, rng.sample(held_out, 4)), "sources": by_family[family]})
    return train, query_rows, base


# How data/fact.queries.jsonl asks each attribute's training row in other words (the phrasing of
# benchmarks/ranking_make_data.py, which made the set; removed from the tree since): the training
# completion's pattern (person, value), and the query's prompt and completion.
PARAPHRASES = {
    "fruit": (r" (\w+) likes the (\w+) best\.", "Which fruit is the favourite of {p}?", " The favourite fruit of {p} is the {v}."),
    "city": (r" (\w+) lives in (\w+)\.", "In which city is the home of {p}?", " The home of {p} is in {v}."),
    "pet": (r" (\w+) keeps a (\w+) at home\.", "Which animal lives with {p}?", " A {v} lives with {p}."),
    "job": (r" (\w+) works as a (\w+)\.", "How does {p} earn a living?", " {p} earns a living as a {v}."),
}  # fmt: skip


def paraphrase(row: Dict) -> Dict:
    """The query asking SmolLM2 fact row `row` ("NAME-ATTRIBUTE") in other words, its planted source `row`."""
    pattern, prompt, completion = PARAPHRASES[row["id"].rsplit("-", 1)[1]]
    person, value = re.fullmatch(pattern, row["completion"]).groups()
    return {
        "id": f"q-{row['id']}",
        "sources": [row["id"]],
        "prompt": prompt.format(p=person),
        "completion": completion.format(p=person, v=value),
    }


def smollm2(rows: int, queries: int, seed: int, base_rows: int) -> Tuple[Rows, Rows, Rows]:
    """The copied benchmarks/lds_data fact set (80 rows, 24 queries); no base rows. More than the
    file's 24 queries: the file's first, then `paraphrase` of rows no query asks yet, drawn with
    `seed`; the training rows stay the file's whatever the queries (at most one query a row)."""
    read = lambda name: [json.loads(line) for line in (HERE / "data" / name).read_text().splitlines()]  # noqa: E731
    train = read("fact.train.jsonl")[:rows]
    kept = {r["id"] for r in train}  # a smaller --smoke set keeps only the queries whose sources it holds
    asked = [q for q in read("fact.queries.jsonl") if set(q.get("sources", [])) <= kept][:queries]
    if queries > len(asked):
        sourced = {s for q in asked for s in q["sources"]}
        others = [r for r in train if r["id"] not in sourced]
        if queries - len(asked) > len(others):
            raise ValueError(f"the smollm2 set has {len(train)} rows: at most {len(train)} queries, one a row")
        asked += [paraphrase(r) for r in random.Random(seed).sample(others, queries - len(asked))]
    return train, asked, []


GENERATORS = {"facts": facts, "shared": shared, "format": format_set, "smollm2": smollm2}
