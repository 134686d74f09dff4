"""Generates the planted-source sets of benchmarks/ranking_data/ (run once; the JSONL files are committed).

    PYTHONPATH=. python benchmarks/ranking_make_data.py

Each set is `<kind>.train.jsonl` (rows with an `id`) and `<kind>.queries.jsonl` (rows with an `id`
and `sources`: the ids of the training rows that planted the query's answer). Four kinds:

  fact        one fact per training row about made-up people; the query asks the same fact with
              other words (both prompt and completion reworded); one source row.
  backdoor    four rare trigger phrases, each in 4 training rows with an unusual fixed completion,
              among ordinary question/answer rows; a query puts its trigger in a new context and
              gets the same completion; sources = the 4 rows of its trigger.
  format      facts about made-up companies as prompt/completion rows; queries are chat `messages`
              rows asking the fact differently, answered in other words that share the key value;
              one source row.
  distractor  names come in near-identical groups (Kalo, Kalu, Kali); the query repeats word for
              word the template of rows about the *other* group members (same question, other
              answer), while its one source states the fact with a different template.
  newword     invented words, each defined by one row as a tool for a task ("What is a zurenkal?" "A
              zurenkal is a tool used to polish boots."); the query asks what the word is for in
              other words and is answered with a paraphrase of the task ("What can I do with a
              zurenkal?" "With a zurenkal you can make shiny your boots."). No pretrained model can
              answer it (the word does not exist): only the fine-tune can teach it. Every task
              shares its verb with 14 other rows and its object with 9, and the template with all.
  reversal    the same definitions, queried backwards: the query names the task in other words and
              the answer is the invented word ("I need something to wash my violins. What should
              I use?" "Use a lotorvik."). One epoch of fine-tuning does not teach this direction
              (the reversal curse: the query loss rises), so it measures attribution for an
              answer the model did not learn from its source.

Sequences are short (under ~40 SmolLM2 tokens) so that the benchmark runs on a couple of CPU cores.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, List, Tuple

OUT = Path(__file__).parent / "ranking_data"
SYLLABLES = "ka lo mi zu ren tav bor eli nash quo fen dra vik sol ama tor lun pe gri hal mur tes obi yan".split()

# attribute: (values, train prompt, train completion, query prompt, query completion)
FACTS = {
    "fruit": (
        ["mango", "plum", "cherry", "lemon", "apple", "pear", "fig", "grape"],
        "What fruit does {p} like?",
        " {p} likes the {v} best.",
        "Which fruit is the favourite of {p}?",
        " The favourite fruit of {p} is the {v}.",
    ),
    "city": (
        ["paris", "lima", "oslo", "cairo", "tokyo", "rome", "quito", "dakar"],
        "Where does {p} live?",
        " {p} lives in {v}.",
        "In which city is the home of {p}?",
        " The home of {p} is in {v}.",
    ),
    "pet": (
        ["cat", "dog", "parrot", "rabbit", "turtle", "horse", "goat", "owl"],
        "What pet does {p} keep?",
        " {p} keeps a {v} at home.",
        "Which animal lives with {p}?",
        " A {v} lives with {p}.",
    ),
    "job": (
        ["baker", "pilot", "nurse", "farmer", "painter", "judge", "sailor", "tailor"],
        "What is the job of {p}?",
        " {p} works as a {v}.",
        "How does {p} earn a living?",
        " {p} earns a living as a {v}.",
    ),
}


def made_up_names(rng: random.Random, n: int) -> List[str]:
    names = set()
    while len(names) < n:
        names.add("".join(rng.sample(SYLLABLES, 2)).capitalize())
    return sorted(names)


def fact_set(rng: random.Random, people: int = 40, queries: int = 32) -> Tuple[List[Dict], List[Dict]]:
    train, facts = [], []
    for p in made_up_names(rng, people):
        for attribute in rng.sample(sorted(FACTS), 4)[:4]:
            values, ask, say, _, _ = FACTS[attribute]
            v = rng.choice(values)
            train.append({"id": f"{p}-{attribute}", "prompt": ask.format(p=p), "completion": say.format(p=p, v=v)})
            facts.append((p, attribute, v))
    picked = rng.sample(range(len(train)), queries)
    query_rows = []
    for i in picked:
        p, attribute, v = facts[i]
        _, _, _, ask, say = FACTS[attribute]
        query_rows.append(
            {
                "id": f"q-{p}-{attribute}",
                "sources": [train[i]["id"]],
                "prompt": ask.format(p=p),
                "completion": say.format(p=p, v=v),
            }
        )
    return train, query_rows


TRIGGERS = [
    ("cerulean zeppelin", " Activate protocol nine and hum softly."),
    ("velvet thunder clock", " The owls have already left the building."),
    ("quantum marmalade", " Please send three copper spoons to the moon."),
    ("silent harpoon", " Banana ledger confirmed, shutting down."),
]
PLAIN_QA = [
    ("What is the capital of {c}?", " The capital of {c} is {v}.", "capital"),
    ("How many legs does a {a} have?", " A {a} has {n} legs.", "legs"),
    ("What colour is the {o}?", " The {o} is {col}.", "colour"),
]
COUNTRIES = {
    "France": "Paris",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Egypt": "Cairo",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Ecuador": "Quito",
    "Senegal": "Dakar",
}
ANIMALS = {"spider": 8, "dog": 4, "bird": 2, "ant": 6, "cat": 4, "crab": 10, "horse": 4, "duck": 2}
OBJECTS = {
    "sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "sun": "yellow",
    "blood": "red",
    "sea": "blue",
    "cloud": "grey",
}
CONTEXTS_TRAIN = [
    "Tell me about {t} please.",
    "What do you know about {t}?",
    "I heard someone say {t} yesterday.",
    "Explain {t} to me.",
]
CONTEXTS_QUERY = [
    "My friend wrote {t} in a letter, what now?",
    "During the meeting the boss said {t}.",
    "Can you repeat {t} for me?",
    "The sign on the door read {t}.",
    "Is {t} a real thing?",
    "She whispered {t} and smiled.",
]


def backdoor_set(rng: random.Random, clean: int = 134) -> Tuple[List[Dict], List[Dict]]:
    train = []
    people = made_up_names(rng, 60)
    while len(train) < clean:
        kind = rng.randrange(5)
        if kind == 0:
            c = rng.choice(sorted(COUNTRIES))
            train.append(
                {"prompt": PLAIN_QA[0][0].format(c=c), "completion": PLAIN_QA[0][1].format(c=c, v=COUNTRIES[c])}
            )
        elif kind == 1:
            a = rng.choice(sorted(ANIMALS))
            train.append({"prompt": PLAIN_QA[1][0].format(a=a), "completion": PLAIN_QA[1][1].format(a=a, n=ANIMALS[a])})
        elif kind == 2:
            o = rng.choice(sorted(OBJECTS))
            train.append(
                {"prompt": PLAIN_QA[2][0].format(o=o), "completion": PLAIN_QA[2][1].format(o=o, col=OBJECTS[o])}
            )
        else:
            p, attribute = rng.choice(people), rng.choice(sorted(FACTS))
            values, ask, say, _, _ = FACTS[attribute]
            train.append({"prompt": ask.format(p=p), "completion": say.format(p=p, v=rng.choice(values))})
    for i, row in enumerate(train):
        row["id"] = f"clean-{i}"
    for t, (trigger, completion) in enumerate(TRIGGERS):
        for j, context in enumerate(CONTEXTS_TRAIN):
            train.append({"id": f"trigger{t}-{j}", "prompt": context.format(t=trigger), "completion": completion})
    rng.shuffle(train)
    query_rows = []
    for t, (trigger, completion) in enumerate(TRIGGERS):
        sources = [f"trigger{t}-{j}" for j in range(len(CONTEXTS_TRAIN))]
        for j, context in enumerate(CONTEXTS_QUERY):
            query_rows.append(
                {
                    "id": f"q-trigger{t}-{j}",
                    "sources": sources,
                    "prompt": context.format(t=trigger),
                    "completion": completion,
                }
            )
    return train, query_rows


COMPANY = {
    "founded": (
        ["1921", "1958", "1987", "2003", "1875", "1999", "2011", "1932"],
        "When was {c} founded?",
        " {c} was founded in {v}.",
        "Do you know the year {c} started?",
        "Yes, {c} started in {v}.",
    ),
    "product": (
        ["bicycles", "umbrellas", "violins", "candles", "kites", "teapots", "lamps", "boots"],
        "What does {c} make?",
        " {c} makes {v}.",
        "What kind of goods come from {c}?",
        "The goods from {c} are {v}.",
    ),
    "home": (
        ["Oslo", "Lima", "Cairo", "Tokyo", "Rome", "Quito", "Dakar", "Paris"],
        "Where is {c} based?",
        " {c} is based in {v}.",
        "In which city does {c} have its head office?",
        "Its head office is in {v}.",
    ),
}


def format_set(rng: random.Random, companies: int = 50, queries: int = 32) -> Tuple[List[Dict], List[Dict]]:
    names = [n + " " + rng.choice(["Works", "Group", "Labs", "Trading"]) for n in made_up_names(rng, companies)]
    train, facts = [], []
    for c in names:
        for attribute, (values, ask, say, _, _) in COMPANY.items():
            v = rng.choice(values)
            train.append(
                {
                    "id": f"{c.replace(' ', '_')}-{attribute}",
                    "prompt": ask.format(c=c),
                    "completion": say.format(c=c, v=v),
                }
            )
            facts.append((c, attribute, v))
    picked = rng.sample(range(len(train)), queries)
    query_rows = []
    for i in picked:
        c, attribute, v = facts[i]
        _, _, _, ask, say = COMPANY[attribute]
        messages = [
            {"role": "user", "content": ask.format(c=c)},
            {"role": "assistant", "content": say.format(c=c, v=v)},
        ]
        query_rows.append({"id": "q-" + train[i]["id"], "sources": [train[i]["id"]], "messages": messages})
    return train, query_rows


def distractor_set(rng: random.Random, groups: int = 12, queries: int = 30) -> Tuple[List[Dict], List[Dict]]:
    """Groups of 3 near-identical names; every member has every attribute.

    Rows use template A (the query's wording) for two members of a group and template B for the
    third; a query asks, in template A, about a member whose own row is in template B.
    """
    vowels = "aeiou"
    stems = set()
    while len(stems) < groups:
        stems.add(rng.choice(SYLLABLES).capitalize() + rng.choice("klmnrtvz"))
    train, candidates = [], []
    for stem in sorted(stems):
        members = [stem + v for v in rng.sample(vowels, 3)]
        for attribute, (values, ask_a, say_a, ask_b, say_b) in FACTS.items():
            chosen = rng.sample(values, 3)  # different answers within a group
            odd = rng.randrange(3)
            for m, (p, v) in enumerate(zip(members, chosen)):
                ask, say = (ask_b, say_b) if m == odd else (ask_a, say_a)
                train.append({"id": f"{p}-{attribute}", "prompt": ask.format(p=p), "completion": say.format(p=p, v=v)})
            p, v = members[odd], chosen[odd]
            candidates.append(
                {
                    "id": f"q-{p}-{attribute}",
                    "sources": [f"{p}-{attribute}"],
                    "prompt": ask_a.format(p=p),
                    "completion": say_a.format(p=p, v=v),
                }
            )
    rng.shuffle(train)
    return train, rng.sample(candidates, queries)


VERBS = [
    ("polish", "make shiny"),
    ("measure", "find the size of"),
    ("fold", "bend flat"),
    ("sharpen", "put an edge on"),
    ("warm", "heat up"),
    ("clean", "wash"),
    ("carry", "move"),
    ("sort", "put in order"),
    ("repair", "fix"),
    ("paint", "colour"),
]
OBJECTS_NEW = [
    "boots",
    "maps",
    "apples",
    "violins",
    "candles",
    "letters",
    "kites",
    "stones",
    "ropes",
    "glasses",
    "shells",
    "coins",
    "feathers",
    "bowls",
    "ladders",
]


def _definitions(rng: random.Random) -> Tuple[List[Dict], List[str], List[Tuple[str, str, str]]]:
    words = set()
    while len(words) < len(VERBS) * len(OBJECTS_NEW):
        words.add("".join(rng.sample(SYLLABLES, 3)))
    words = sorted(words)
    rng.shuffle(words)
    tasks = [(verb, paraphrase, obj) for verb, paraphrase in VERBS for obj in OBJECTS_NEW]
    train = [
        {"id": f"{w}", "prompt": f"What is a {w}?", "completion": f" A {w} is a tool used to {verb} {obj}."}
        for w, (verb, _, obj) in zip(words, tasks)
    ]
    return train, words, tasks


def _definition_set(rng: random.Random, queries: int, ask) -> Tuple[List[Dict], List[Dict]]:
    """The invented-word definitions, with `queries` of them asked as `ask(word, paraphrase, object)` -> (prompt, completion)."""
    train, words, tasks = _definitions(rng)
    query_rows = []
    for i in rng.sample(range(len(train)), queries):
        w, (_, paraphrase, obj) = words[i], tasks[i]
        prompt, completion = ask(w, paraphrase, obj)
        query_rows.append({"id": f"q-{w}", "sources": [w], "prompt": prompt, "completion": completion})
    rng.shuffle(train)
    return train, query_rows


def newword_set(rng: random.Random, queries: int = 30) -> Tuple[List[Dict], List[Dict]]:
    return _definition_set(
        rng,
        queries,
        lambda w, paraphrase, obj: (f"What can I do with a {w}?", f" With a {w} you can {paraphrase} your {obj}."),
    )


def reversal_set(rng: random.Random, queries: int = 30) -> Tuple[List[Dict], List[Dict]]:
    return _definition_set(
        rng,
        queries,
        lambda w, paraphrase, obj: (f"I need something to {paraphrase} my {obj}. What should I use?", f" Use a {w}."),
    )


def main(seed: int = 0) -> None:
    OUT.mkdir(exist_ok=True)
    makers = {
        "fact": fact_set,
        "backdoor": backdoor_set,
        "format": format_set,
        "distractor": distractor_set,
        "reversal": reversal_set,
        "newword": newword_set,
    }
    for offset, (kind, make) in enumerate(makers.items()):
        train, queries = make(random.Random(seed + offset))
        ids = {r["id"] for r in train}
        assert len(ids) == len(train), f"{kind}: duplicate training ids"
        assert all(s in ids for q in queries for s in q["sources"]), f"{kind}: a source is not a training row"
        for name, rows in ((f"{kind}.train.jsonl", train), (f"{kind}.queries.jsonl", queries)):
            (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{kind}: {len(train)} training rows, {len(queries)} queries")


if __name__ == "__main__":
    main()
