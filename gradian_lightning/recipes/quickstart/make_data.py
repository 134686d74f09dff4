"""Regenerates the bundled quickstart data (run once; the JSONL files are committed).

Each training row states one fact about a made-up person; each query asks for a fact in other
words, so its planted source is the one training row with the same person and attribute.
    python -m gradian_lightning.recipes.quickstart.make_data
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SYLLABLES = "ka lo mi zu ren tav bor eli nash quo fen dra vik sol ama tor lun pe gri hal".split()
ATTRIBUTES = {
    "fruit": (
        ["mango", "plum", "cherry", "lemon", "apple", "pear", "fig", "grape"],
        "What fruit does {p} like ?",
        "Which fruit is the favourite of {p} ?",
        "{p} likes the {v} best .",
    ),
    "city": (
        ["paris", "lima", "oslo", "cairo", "tokyo", "rome", "quito", "dakar"],
        "Where does {p} live ?",
        "In which city is the home of {p} ?",
        "{p} lives in {v} .",
    ),
    "pet": (
        ["cat", "dog", "parrot", "rabbit", "turtle", "horse", "goat", "owl"],
        "What pet does {p} keep ?",
        "Which animal lives with {p} ?",
        "{p} keeps a {v} at home .",
    ),
}


def main(people: int = 40, queries: int = 30, seed: int = 0) -> None:
    rng = random.Random(seed)
    names = set()
    while len(names) < people:
        names.add("".join(rng.sample(SYLLABLES, 2)).capitalize())
    train, sources = [], []
    for p in sorted(names):
        for attribute, (values, ask, _, answer) in ATTRIBUTES.items():
            v = rng.choice(values)
            train.append(
                {"id": f"{p}-{attribute}", "prompt": ask.format(p=p), "completion": " " + answer.format(p=p, v=v)}
            )
            sources.append((p, attribute, v))
    rows = rng.sample(range(len(train)), queries)
    query_rows = []
    for i in rows:
        p, attribute, v = sources[i]
        _, _, paraphrase, answer = ATTRIBUTES[attribute]
        query_rows.append(
            {
                "id": f"q-{p}-{attribute}",
                "source": train[i]["id"],
                "prompt": paraphrase.format(p=p),
                "completion": " " + answer.format(p=p, v=v),
            }
        )
    for name, data in (("train.jsonl", train), ("queries.jsonl", query_rows)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main()
