"""Render the generated blocks of benchmarks/RESULTS.md, RANKING.md and docs/configuration.md from the result files.

    PYTHONPATH=. python -m benchmarks.tables           # rewrite every block in place
    PYTHONPATH=. python -m benchmarks.tables --check   # exit 1 naming the stale files (tests/test_benchmark_tables.py)

A block is the text between `<!-- generated: SOURCE -->` and `<!-- end generated -->`. SOURCE is a
result file under benchmarks/ (`results/<name>.json`, written by a perf script with its command and
machine) or the name of a study's report in REPORTS. Nothing else in the Markdown is touched: the
prose around the blocks says what the figures mean, the blocks say what was measured.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict

from benchmarks.common import render_result

HERE = Path(__file__).resolve().parent
DOCUMENTS = (HERE / "RESULTS.md", HERE / "RANKING.md", HERE.parent / "docs" / "configuration.md")
BLOCK = re.compile(r"(<!-- generated: (?P<source>[^>]+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def _lds_seeds() -> str:
    from benchmarks.studies import lds

    return lds.report(lds.saved_results())


def _peer_kronfluence(kind: str) -> Callable[[], str]:
    def render() -> str:
        from benchmarks.perf.peer_kronfluence import report

        return report(json.loads((HERE / "lds_results" / f"peer_kronfluence.{kind}.json").read_text()))

    return render


def _index_formats() -> str:
    from benchmarks.studies.index_format.run import RESULTS, report

    result = json.loads(RESULTS.read_text())
    return f"Command: `{result['command']}`\n\nMachine: {result['machine']}\n\n{report(result)}"


LDS_SETS = HERE / "studies" / "lds_sets"


def _lds_results(folder: str) -> list:
    """The result files of benchmarks/studies/lds_sets/<folder>, one a set, in name order."""
    return [json.loads(p.read_text()) for p in sorted((LDS_SETS / folder).glob("*.json"))]


def _commands(results: list) -> str:
    return "\n".join(f"    {r['command']}" for r in results)


def _lds_formats() -> str:
    from benchmarks.studies.lds_sets.common import formats_side_by_side

    results = _lds_results("formats")
    folder = (LDS_SETS / "formats").relative_to(HERE.parent)
    return f"Commands (one a set; `--report --results {folder}` prints every table):\n\n{_commands(results)}\n\n{formats_side_by_side(results)}"


def _auto_sweep() -> str:
    from benchmarks.studies.lds_sets.common import auto_sweep

    return auto_sweep(_lds_results("formats"), "k32-int8")


# The defaults, the default before them, the other projected scorers a default could be, and exact gradients.
WORST_SET_PICKS = (
    ("query.* settings", "k32-int8"),
    ("query.* settings", "k16-float16"),
    ("precondition=ekfac, normalize=module", "k32-int8"),
    ("precondition=fisher, normalize=row", "k32-int8"),
    ("precondition=diag, normalize=module", "k32-int8"),
    ("precondition=none, normalize=module", "k32-int8"),
    ("precondition=none, score=inner", "exact"),
    ("precondition=none, normalize=row", "exact"),
    ("precondition=none, normalize=module", "exact"),
)


def _worst_sets() -> str:
    from benchmarks.studies.lds_sets.common import worst_sets

    return worst_sets(_lds_results("formats"), WORST_SET_PICKS)


def _lds_damping() -> str:
    from benchmarks.studies.lds_sets.common import damping_sweep

    results = _lds_results("damping")
    return f"Commands (one a set, on the work folders of the formats runs above):\n\n{_commands(results)}\n\n{damping_sweep(results, 'k32-int8')}"


REPORTS: Dict[str, Callable[[], str]] = {
    "index formats": _index_formats,
    "lds formats": _lds_formats,
    "lds damping": _lds_damping,
    "lds auto sweep": _auto_sweep,
    "lds worst sets": _worst_sets,
    "lds seeds": _lds_seeds,
    "peer_kronfluence fact": _peer_kronfluence("fact"),
    "peer_kronfluence newword": _peer_kronfluence("newword"),
}


def render(source: str) -> str:
    """The Markdown of one block."""
    if source in REPORTS:
        return REPORTS[source]()
    path = HERE / source
    if not path.is_file():
        raise SystemExit(f"benchmarks/tables.py: error: no result file benchmarks/{source} (run its command first)")
    return render_result(json.loads(path.read_text()))


def regenerate(text: str) -> str:
    """`text` with every generated block rendered afresh."""
    return BLOCK.sub(lambda m: m.group(1) + "\n" + render(m.group("source")).strip() + "\n\n" + m.group(4), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a document is stale")
    args = parser.parse_args()
    stale = []
    for document in DOCUMENTS:
        text = document.read_text()
        fresh = regenerate(text)
        if fresh != text:
            stale.append(document.name)
            if not args.check:
                document.write_text(fresh)
    if args.check and stale:
        sys.exit(f"stale: {', '.join(stale)}; run PYTHONPATH=. python -m benchmarks.tables")
    print(("stale: " if args.check else "rewrote: ") + (", ".join(stale) or "nothing") if stale else "up to date")


if __name__ == "__main__":
    main()
