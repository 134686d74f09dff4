"""`gradian`: a thin command line over the Python API. Each command is config -> recipe -> print."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from gradian_lightning.errors import GradianError


def _print_index_summary(summary: dict) -> None:
    rows, total = summary["rows"], summary["num_rows"]
    per_row = summary["grads_bytes"] / max(total, 1)
    print(f"gradian index: {rows}/{total} rows written to {summary['path']} ({'complete' if summary['complete'] else 'INCOMPLETE'})")
    print(f"  bytes on disk: {summary['bytes_on_disk']:,} ({per_row:,.0f} bytes per row uncompressed)")
    cut = summary["truncated_rows"]
    print(f"  completions cut by grads.max_seq_length: {cut} ({100.0 * cut / max(total, 1):.1f}%)")
    for key, what in (("empty_rows", "with zero supervised tokens (excluded from ranking)"), ("nonfinite_rows", "with NaN/inf gradients (stored as zeros, excluded from ranking)")):
        found = summary[key]
        shown = ", ".join(map(str, found[:20])) + (" ..." if len(found) > 20 else "")
        print(f"  rows {what}: {len(found)}" + (f" -> rows {shown}" if found else ""))


def _index(args: argparse.Namespace) -> None:
    from gradian_lightning.config import load_config
    from gradian_lightning.indexing import run_index

    _print_index_summary(run_index(load_config(args.config, args.overrides)))


def _quickstart(args: argparse.Namespace) -> None:
    from gradian_lightning.quickstart import run_quickstart

    result = run_quickstart(args.out)
    _print_index_summary(result["summary"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gradian", description="Training-data attribution for causal LMs by gradient indexing.")
    commands = parser.add_subparsers(dest="command", required=True)
    index = commands.add_parser("index", help="index the training data's per-example gradients")
    index.add_argument("config", help="YAML config file (see configs/)")
    index.add_argument("overrides", nargs="*", help="key=value settings, e.g. grads.batch_size=2")
    index.set_defaults(run=_index)
    quick = commands.add_parser("quickstart", help="the embedded default: fine-tune a tiny Llama on bundled data, index it (offline)")
    quick.add_argument("--out", default="runs/quickstart", help="output directory (default: runs/quickstart)")
    quick.set_defaults(run=_quickstart)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except GradianError as err:
        print(f"gradian {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
