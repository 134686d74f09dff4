"""Distinct rows of the LDS study's facts style for a real model's ANN measurement (RESULTS §15).

The tiny word-level Llamas of benchmarks/studies/lds_sets (`facts-N1024/ft`: trained on made-up
people's facts) know about 680 names, 3 attributes and 8 values each: about 16,000 distinct single
facts, too few for 10⁶ distinct rows. A row here is two facts of one world (each person's value of
each attribute drawn once by the seed, so rows never contradict each other): the prompt asks person
A's attribute (the asking phrasing or its paraphrase, `kinds.fact_rows`'s two), the completion
answers it, then states one attribute of another person B:

    {"prompt": "Where does Kaamafen live ?", "completion": " Kaamafen lives in lima . Bortavzu keeps a owl at home ."}

(A, attribute, phrasing, B, B's attribute): about 8.4 million distinct rows, of which `--rows`
training rows and `--queries` held-out query rows (no two alike, no query among the training rows)
are drawn. Every word is in the model's vocabulary: names are taken from its tokenizer, so that no
row collapses to <unk> tokens.

    PYTHONPATH=. python -m benchmarks.perf.ann_facts --model /tmp/gradian-lds-sets/facts-N1024/ft \
        --rows 1000000 --queries 64 --out /tmp/ann2/facts
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Dict, List, Tuple

from gradian_lightning.recipes.quickstart.make_data import ATTRIBUTES

NOT_NAMES = {"What", "Where", "Which", "In", "The"}


def known_names(model: Path) -> List[str]:
    """The made-up names in a word-level tokenizer's vocabulary (its capitalised words)."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w for w in vocab if w[:1].isupper() and w not in NOT_NAMES)


def fact_pair(world: Dict[Tuple[str, str], str], key: Tuple[str, str, int, str, str]) -> Dict[str, str]:
    """One row of `key` = (person A, A's attribute, phrasing 0 ask / 1 paraphrase, person B, B's attribute)."""
    a, attribute, phrasing, b, other = key
    _, ask, paraphrase, answer = ATTRIBUTES[attribute]
    value = world[a, attribute]
    prompt = (paraphrase if phrasing else ask).format(p=a)
    first = f"The {attribute} of {a} is {value} ." if phrasing else answer.format(p=a, v=value)
    second = ATTRIBUTES[other][3].format(p=b, v=world[b, other])
    return {"prompt": prompt, "completion": f" {first} {second}"}


def fact_pairs(names: List[str], rows: int, queries: int, seed: int) -> Tuple[List[Dict], List[Dict]]:
    """(`rows` training rows, `queries` query rows), all distinct, ids "r<i>" and "q<i>"."""
    rng = random.Random(seed)
    world = {(p, a): rng.choice(ATTRIBUTES[a][0]) for p in names for a in ATTRIBUTES}
    attributes = list(ATTRIBUTES)
    possible = len(names) * len(attributes) * 2 * (len(names) - 1) * len(attributes)
    if rows + queries > possible // 2:
        raise SystemExit(f"--rows + --queries must be at most {possible // 2:,} (half the {possible:,} distinct rows)")
    seen: set = set()
    keys = []
    while len(keys) < rows + queries:
        a, b = rng.sample(names, 2)
        key = (a, rng.choice(attributes), rng.randrange(2), b, rng.choice(attributes))
        if key not in seen:
            seen.add(key)
            keys.append(key)
    train = [{"id": f"r{i}", **fact_pair(world, k)} for i, k in enumerate(keys[:rows])]
    asked = [{"id": f"q{i}", **fact_pair(world, k)} for i, k in enumerate(keys[rows:])]
    return train, asked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a word-level tiny Llama's directory (its tokenizer)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="folder for train.jsonl and queries.jsonl")
    args = parser.parse_args()
    train, asked = fact_pairs(known_names(args.model), args.rows, args.queries, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("queries.jsonl", asked)):
        with open(args.out / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{len(train):,} training rows and {len(asked):,} queries in {args.out}")


if __name__ == "__main__":
    main()
