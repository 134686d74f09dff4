"""`gradian`: a thin command line over the Python API. Each command is config -> recipe -> print."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, List, Optional

from gradian_lightning.errors import GradianError

PACKAGE = str(Path(__file__).resolve().parent)
# Lightning's info lines ("GPU available: False, used: False", "TPU available: ...") speak to a
# Trainer's user; a gradian user asked for an index. Its warnings still show.
LIGHTNING_INFO = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


@contextlib.contextmanager
def gradian_output(command: str) -> Iterator[None]:
    """While a command runs: Gradian's own warnings as `gradian COMMAND: warning: ...` lines (not
    Python's `.../cli.py:111: UserWarning:` form), Lightning's info lines and torch's LeafSpec
    deprecation (raised by Lightning's code, nothing a gradian user can act on) not shown. The CLI's
    only: the library warns Python API users as Python does. Everything is restored on exit."""
    formatwarning = warnings.formatwarning

    def gradian_format(message: Any, category: type, filename: str, lineno: int, line: Optional[str] = None) -> str:
        if str(Path(filename).resolve()).startswith(PACKAGE):  # warned by gradian (its stacklevel stays inside)
            return f"gradian {command}: warning: {message}\n"
        return formatwarning(message, category, filename, lineno, line)

    levels = {name: logging.getLogger(name).level for name in LIGHTNING_INFO}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated", category=FutureWarning)
        warnings.formatwarning = gradian_format
        for name in LIGHTNING_INFO:
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            yield
        finally:
            warnings.formatwarning = formatwarning
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _print_index_summary(summary: Optional[dict]) -> None:
    if summary is None:  # a rank other than 0 of a multi-process run: rank 0 reports
        return
    if "checkpoints" not in summary:
        return _print_rows_summary(summary, f"gradian index: {{}} written to {summary['path']}", "  ")
    done = "complete" if summary["complete"] else "INCOMPLETE"
    steps = ", ".join(str(c["step"]) for c in summary["checkpoints"])
    print(
        f"gradian index: {len(summary['checkpoints'])} checkpoints (steps {steps}) written to {summary['path']} ({done})"
    )
    print(f"  bytes on disk: {summary['bytes_on_disk']:,} (the whole index)")
    for checkpoint in summary["checkpoints"]:
        _print_rows_summary(checkpoint, f"  step {checkpoint['step']}: {{}}", "    ")


def _print_rows_summary(summary: dict, head: str, indent: str) -> None:
    """What one indexing run wrote: `head` with "{}" for its row count, then lines at `indent`."""
    rows, total = summary["rows"], summary["num_rows"]
    per_row = summary["grads_bytes"] / max(total, 1)
    print(head.format(f"{rows}/{total} rows") + f" ({'complete' if summary['complete'] else 'INCOMPLETE'})")
    if summary.get("kept_rows") == total and not summary.get("computed_rows"):
        print(f"{indent}already complete: an earlier run wrote every row, so nothing was computed")
    elif summary.get("kept_rows"):
        print(
            f"{indent}resumed: {summary['kept_rows']} rows kept from an interrupted run, {summary['computed_rows']} computed now"
        )
    print(f"{indent}bytes on disk: {summary['bytes_on_disk']:,} ({per_row:,.0f} bytes per row uncompressed)")
    cut = summary["truncated_rows"]
    print(f"{indent}completions cut by grads.max_seq_length: {cut} ({100.0 * cut / max(total, 1):.1f}%)")
    for key, what in (
        ("empty_rows", "with zero supervised tokens (excluded from ranking)"),
        ("nonfinite_rows", "with NaN/inf gradients (stored as zeros, excluded from ranking)"),
    ):
        found = summary[key]
        ids = summary.get("ids", {})
        shown = ", ".join(f"{i} (id {ids[i]!r})" if i in ids else str(i) for i in found[:20]) + (
            " ..." if len(found) > 20 else ""
        )
        print(f"{indent}rows {what}: {len(found)}" + (f" -> rows {shown}" if found else ""))


# The paths each command reads, checked on the disk before torch imports (check_before_torch).
DATA_KEYS = {
    "index": ("data.train",),
    "plan": ("data.train",),
    "query": ("query.data",),
    "report": ("query.data",),
    "validate": ("data.train", "query.data"),
}


def check_before_torch(cfg: Any, command: str) -> None:
    """The checks that need only the settings and the disk, made before torch, Lightning and
    transformers import (seconds of start-up): the settings `command` needs (unset), the model (a
    folder that is not there, a file), the data paths `command` reads, and `index.path` (a URL
    without its filesystem; for index, a file where its folder should be; for query and report,
    which only read it, a local path with nothing there). What needs a model or a parsed file is
    checked by the recipe."""
    from omegaconf import OmegaConf

    from gradian_lightning.config import require_for
    from gradian_lightning.data_sources import check_source_path
    from gradian_lightning.errors import ConfigError
    from gradian_lightning.hub import check_model_source
    from gradian_lightning.index.location import Location

    def given(key: str) -> Optional[str]:
        value = OmegaConf.select(cfg, key, throw_on_missing=False)  # None when unset or "???"
        return None if value is None else str(value)

    require_for(cfg, command)  # an unset setting is named before torch imports too
    if given("model.name_or_path") and not given("model.checkpoints"):
        check_model_source(given("model.name_or_path"))
    for key in DATA_KEYS.get(command, ()):
        if given(key):
            check_source_path(given(key), key)
    path = given("index.path")
    if path and command in ("index", "query", "report"):
        where = Location(path)  # a URL whose filesystem is not installed fails here
        if command == "index":
            where.check_creatable()
        elif where.local is not None and not where.exists():  # a bucket is asked by the reader; a file is not an index
            raise ConfigError(
                f"setting 'index.path'={path!r}: nothing is there; point index.path at the folder `gradian index` wrote (the index.path it ran with)"
            )


def _index(args: argparse.Namespace) -> None:
    from gradian_lightning.config import load_config

    cfg = load_config(args.config, args.overrides)  # settings errors before torch and Lightning import
    check_before_torch(cfg, "index")
    from gradian_lightning.recipes.index import run_index

    _print_index_summary(run_index(cfg, announce=lambda line: print(line, flush=True)))


def _doctor(args: argparse.Namespace) -> None:
    import json

    from gradian_lightning.recipes.doctor import doctor_report, format_markdown

    report = doctor_report(args.config, list(args.overrides))
    print(json.dumps(report, indent=2) if args.json else format_markdown(report))


def _plan(args: argparse.Namespace) -> None:
    import json

    from gradian_lightning.config import load_config

    cfg = load_config(args.config, args.overrides)
    check_before_torch(cfg, "plan")
    from gradian_lightning.recipes.plan import format_plan, make_plan, parse_bytes

    memory = parse_bytes(args.device_memory) if args.device_memory else None
    plan = make_plan(cfg, memory)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))


def _print_query_table(
    results: List[dict], queries: List[dict], train_rows: Optional[List[dict]], shown: int = 10, width: int = 72
) -> None:
    from gradian_lightning.data import row_snippet as _snippet

    for result, query in zip(results, queries):
        print(f"\nquery {result['query_id']}: {_snippet(query, width)}")
        for key, label in (("results", "rank"), ("opponents", "opp.")):
            for hit in result.get(key, [])[:shown]:
                row = train_rows[hit["index"]] if train_rows is not None else None
                print(
                    f"  {label} {hit['rank']:>3}  {hit['score']:+.4f}  {str(hit['id'])[:24]:<24}  {_snippet(row, width)}"
                )


def _rows_ranked(answer: dict) -> str:
    ranked, total = answer["ranked_rows"], len(answer["index"])
    return f"{total} rows" if ranked == total else f"the {ranked} written rows (of {total}: the index is unfinished)"


def _query(args: argparse.Namespace) -> None:
    from gradian_lightning.config import load_config

    cfg = load_config(args.config, args.overrides)
    check_before_torch(cfg, "query")
    from gradian_lightning.recipes.query import run_query

    answer = run_query(cfg)
    _print_query_table(answer["results"], answer["queries"], answer["train_rows"])
    where = f"; written to {cfg.query.output}" if cfg.query.output else " (set query.output=FILE.jsonl to keep them)"
    print(
        f"\ngradian query: {len(answer['results'])} queries ranked against {_rows_ranked(answer)} of {cfg.index.path} by {answer['scoring']}, on {answer['device']}{where}"
    )


def _validate(args: argparse.Namespace) -> None:
    from gradian_lightning.config import load_config

    cfg = load_config(args.config, args.overrides)
    check_before_torch(cfg, "validate")
    from gradian_lightning.recipes.validate import run_validate

    report = run_validate(cfg)
    n = report["num_subsets"]
    print(
        f"\ngradian validate: LDS over {n} retrained subsets ({report['repeats']} run(s) each), mean ± standard error over {report['queries']} queries"
    )
    print(
        f"  {100 * report['shared_variance']:.0f}% of the query losses' variance across subsets moves all queries together."
        " raw: would removing these rows change this answer (the shared movement included);"
        " centred: which rows move this answer more than the others (each subset's mean over queries removed)"
    )
    rows = [(s["name"], s) for s in report["scorers"]] + [("random scores", report["random"])]
    if "ceiling" in report:
        rows.append(("retraining noise ceiling", report["ceiling"]))
    width = max(len(name) for name, _ in rows)
    print(f"  {'':<{width}}  {'raw LDS':>14}  {'centred LDS':>14}")
    for name, entry in rows:
        print(
            f"  {name:<{width}}  {entry['lds']:+.3f} ± {entry['standard_error']:.3f}  {entry['centred_lds']:+.3f} ± {entry['centred_standard_error']:.3f}"
        )
    print(
        f"  report: {report['output']}/lds.json, per query: {report['output']}/lds_per_query.jsonl; chart: {report['chart']}"
    )


def _report(args: argparse.Namespace) -> None:
    from gradian_lightning.config import load_config

    cfg = load_config(args.config, args.overrides)
    check_before_torch(cfg, "report")
    from gradian_lightning.recipes.report import run_report

    print(f"gradian report: written to {run_report(cfg)}")


def _quickstart(args: argparse.Namespace) -> None:
    from gradian_lightning.recipes.quickstart import run_quickstart

    result = run_quickstart(args.out)
    _print_index_summary(result["summary"])
    _print_query_table(result["results"], result["queries"], result["train_rows"], shown=3)
    n = len(result["queries"])
    print(
        f"\ngradian quickstart: {n} queries, each a paraphrase of one training row (its planted source); full top-10 in {result['results_path']}"
    )
    for k in (1, 10):
        print(
            f"  recall@{k}: {result[f'recall@{k}']:.3f} ({round(result[f'recall@{k}'] * n)}/{n} queries have their source in the top {k})"
        )
    print(f"  report: {result['report_path']} (open it in a browser: top rows, percentiles, token shares)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradian", description="Training-data attribution for causal LMs by gradient indexing."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: Any, help: str, config: str, example: str) -> argparse.ArgumentParser:
        """A subcommand that takes an optional YAML file and key=value overrides, as most do."""
        sub = commands.add_parser(name, help=help)
        sub.add_argument("config", nargs="?", help=config)
        sub.add_argument("overrides", nargs="*", help=f"key=value settings, e.g. {example}")
        sub.set_defaults(run=run)
        return sub

    yaml = "YAML config file (see configs/)"
    command("index", _index, "index the training data's per-example gradients", yaml, "grads.batch_size=2")
    plan = command(
        "plan",
        _plan,
        "predict peak memory and index size from the config and data, without loading weights",
        yaml,
        "grads.batch_size=2",
    )
    plan.add_argument(
        "--device-memory", help="memory to fit the batch in, e.g. 24GiB (default: the visible accelerator's)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    doctor = command(
        "doctor",
        _doctor,
        "report versions, devices, determinism and backends (Markdown; --json for JSON)",
        "optional YAML config file, for the configured seed",
        "grads.seed=1",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    command(
        "query",
        _query,
        "rank the indexed training rows for each query (query.data, query.top_k, query.score, query.output)",
        "YAML config file (see configs/); index.path names the index",
        "query.data=q.jsonl query.top_k=5",
    )
    command(
        "report",
        _report,
        "one static HTML page of a query run: top rows, opponents, percentiles, token shares",
        "YAML config file: the settings gradian query ran with",
        "report.output=runs/report.html",
    )
    command(
        "validate",
        _validate,
        "measure the scores' Linear Datamodeling Score: retrain on random subsets, see if the query losses move as the scores say",
        "YAML config file (see configs/); validate.* sets the subsets",
        "validate.num_subsets=24",
    )
    quick = commands.add_parser(
        "quickstart", help="the embedded default: fine-tune a tiny Llama on bundled data, index it, query it (offline)"
    )
    quick.add_argument("--out", default="runs/quickstart", help="output directory (default: runs/quickstart)")
    quick.set_defaults(run=_quickstart)
    args = parser.parse_args(argv)
    config = getattr(args, "config", None)
    if config is not None and "=" in config and not Path(config).exists():
        args.config, args.overrides = None, [config, *args.overrides]  # every setting an override, no YAML
    try:
        with gradian_output(args.command):
            args.run(args)
    except GradianError as err:
        print(f"gradian {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resume = {
            "index": "the rows written so far are kept; rerun the same command to resume from them",
            "validate": "the finished training runs are kept; rerun the same command to resume from them",
        }
        resume = resume.get(args.command, "nothing was written")
        print(f"gradian {args.command}: interrupted: {resume}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
