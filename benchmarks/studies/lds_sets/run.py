"""One LDS set end to end: its rows, base and fine-tuned models, indexes, retrained subsets,
exact-gradient reference and every scorer's raw and centred LDS and retrieval.

    PYTHONPATH=. python -m benchmarks.studies.lds_sets.run facts --rows 2048   # -> results/facts-N2048.json
    PYTHONPATH=. python -m benchmarks.studies.lds_sets.run shared              # N = 512
    PYTHONPATH=. python -m benchmarks.studies.lds_sets.run format              # N = 512
    PYTHONPATH=. python -m benchmarks.studies.lds_sets.run smollm2             # SmolLM2-135M, 80 fact rows
    PYTHONPATH=. python -m benchmarks.studies.lds_sets.run --report            # the README's tables
    PYTHONPATH=. python -m benchmarks.studies.lds_sets.run facts --rows 256 --subsets 96 --queries 96 --retrain-only
                                                        # more power: work folder facts-N256-M96-Q96
    ... --smoke --work /tmp/x                                                  # tiny sizes, checks it runs

The work (models, indexes, retrained subsets) goes to --work (default /tmp/gradian-lds-sets/NAME);
a killed run resumes from the finished training runs kept there.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Optional

from benchmarks.studies.lds_sets.common import (
    FORMATS,
    SMOLLM2,
    SetSpec,
    across_sets,
    formats_side_by_side,
    measure,
    seed_averaged,
    table,
)
from benchmarks.studies.lds_sets.kinds import GENERATORS

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEFAULT_ROWS = {"facts": 2048, "shared": 512, "format": 512, "smollm2": 80}


def spec_for(kind: str, rows: int, smoke: bool) -> SetSpec:
    """The set's sizes and recipe: the tiny sets train the quickstart's model from a base of 1,024
    disjoint rows; SmolLM2 is fine-tuned with validate's defaults (2 epochs, AdamW 1e-4, batch 8) and
    indexed with 5 projection draws, since issue 29 measures the fine-tune's LDS spread over 5 seeds."""
    if kind == "smollm2":
        spec = SetSpec(
            kind, rows, base_rows=0, epochs=2, learning_rate=1e-4, batch_size=8, max_seq_length=64,
            seeds=[0, 1, 2, 3, 4], base=str(SMOLLM2), exact_filter=["*.layers.2[89].mlp.*"],
        )  # fmt: skip
    else:
        spec = SetSpec(kind, rows)
    if smoke:
        spec.rows, spec.queries, spec.base_rows, spec.base_epochs = min(rows, 48), 6, 48, 2
        spec.num_subsets, spec.repeats, spec.epochs, spec.seeds = 5, 2, 1, [0]  # 5: validate's least
        spec.formats = spec.formats[:1]
    return spec


def sized(spec: SetSpec, learning_rate: Optional[float], subsets: Optional[int], queries: Optional[int]) -> SetSpec:
    """`spec` with another learning rate, number of retrained subsets M or of queries Q, each named
    in the set's name (its result file and default work folder: "facts-N256-M96-Q96"), so figures
    measured at the defaults keep their names and caches."""
    if learning_rate is not None:
        spec.learning_rate, spec.variant = learning_rate, spec.variant + f"-lr{learning_rate:g}"
    if subsets is not None and subsets != spec.num_subsets:
        spec.num_subsets, spec.variant = subsets, spec.variant + f"-M{subsets}"
    if queries is not None and queries != spec.queries:
        spec.queries, spec.variant = queries, spec.variant + f"-Q{queries}"
    return spec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="?", choices=sorted(GENERATORS))
    parser.add_argument("--rows", type=int, help="training rows N (default: facts 2048, shared/format 512, smollm2 80)")
    parser.add_argument(
        "--learning-rate", type=float, help="the fine-tune's and every subset's AdamW rate (tiny default 3e-3)"
    )
    parser.add_argument(
        "--formats", nargs="+", choices=sorted(FORMATS), help="projected index formats (default: all of FORMATS)"
    )
    parser.add_argument(
        "--scorers",
        type=json.loads,
        default=[],
        help="more scorers for the projected indexes, a JSON list of query.* overrides, e.g. '[{\"damping\": 3}]'",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="projection draws (default: 0-2; SmolLM2 0-4)")
    parser.add_argument(
        "--subsets", type=int,
        help="retrained half-subsets M (default 24); another M names the set NAME-M{M}, its own work folder",
    )  # fmt: skip
    parser.add_argument(
        "--queries", type=int,
        help="queries Q (default 24; the training rows stay the same, kinds.py); another Q names the set NAME-Q{Q}",
    )  # fmt: skip
    parser.add_argument(
        "--retrain-only", action="store_true",
        help="build the models and the first projected index, retrain the subsets and stop (work/result.json "
        "holds the spec; trajectory.py and estimators.py score them)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline, not the figures")
    parser.add_argument(
        "--work", type=Path, help="models, indexes and retrained subsets (default /tmp/gradian-lds-sets/NAME)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="where NAME.json goes")
    parser.add_argument("--report", action="store_true", help="print the tables of every result in --results")
    args = parser.parse_args(argv)
    if args.report:
        results = [json.loads(path.read_text()) for path in sorted(args.results.glob("*.json"))]
        results = [r for r in results if "exact" in r["indexes"]]  # --retrain-only's have no scorers' table
        for result in results:
            print(
                f"### {result['kind']}, N = {result['spec']['rows']}{result['spec'].get('variant', '')}\n\n`{result['command']}`\n\n{table(result)}"
            )
        print(f"### Across the sets\n\n{across_sets(results)}")
        if any(len({r.get("format") for r in seed_averaged(x)} - {None}) > 1 for x in results):
            print(f"### Index formats side by side\n\n{formats_side_by_side(results)}")
        return 0
    if args.kind is None:
        parser.error("give a KIND, or --report")
    spec = spec_for(args.kind, args.rows or DEFAULT_ROWS[args.kind], args.smoke)
    if args.formats:
        spec.formats = args.formats
    if args.seeds:
        spec.seeds = args.seeds
    spec.extra_scorers = args.scorers
    sized(spec, args.learning_rate, args.subsets, args.queries)
    rows, queries, base_rows = GENERATORS[args.kind](spec.rows, spec.queries, spec.seed, spec.base_rows)
    work = args.work or Path("/tmp/gradian-lds-sets") / spec.name
    command = "PYTHONPATH=. python -m benchmarks.studies.lds_sets.run " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    if len(queries) != spec.queries:
        parser.error(f"the {args.kind} generator made {len(queries)} queries, not --queries {spec.queries}")
    result = measure(spec, work, rows, queries, base_rows, command, retrain_only=args.retrain_only)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{spec.name}{'-smoke' if args.smoke else ''}.json").write_text(json.dumps(result, indent=1))
    if args.retrain_only:  # no exact index: not a table of run.py's scorers
        print(
            f"{spec.name}: {result['num_subsets']} subsets x {result['repeats']} repeats retrained in {work / 'runs'}"
        )
        return 0
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
