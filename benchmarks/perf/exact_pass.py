"""Full-space factors and the exact pass (issue 41): their bytes, fit time, and the exact pass's cost
as a ratio to an index capture pass over the same rows, and its memory per query.

One process, on the same synthetic rows (`common.synthetic_examples`, half of each row supervised):
  - capture: `GradientRows` at the index's defaults (k = 32) over every batch: the rows an index
    pass computes (its zarr writing left out), the denominator of every ratio;
  - fit: `FactorFit.covariances` over every batch, `Eigenbases.from_sums`, `FactorFit.lambdas`
    over every batch (EK-FAC); the factors' bytes in float32;
  - exact: `ExactPass` for Q queries (their gradients and the EK-FAC preconditioning), then
    `score_all` over every batch, in each contraction order; a query's directions' bytes.
`--head` adds the output head as the second part that `query.precondition=auto` scores (its G
factor diagonal; query/exact_scoring.py), to every step but the capture.
Each timed step runs `--repeats` times, interleaved, and the median is kept; ratios are of CPU
seconds (one torch thread), which the other jobs on the shared machine do not inflate as they do
wall seconds.

    PYTHONPATH=. python -m benchmarks.perf.exact_pass --model smollm2 --rows 16 --queries 8
    PYTHONPATH=. python -m benchmarks.perf.exact_pass --model tiny --rows 64 --queries 8
    PYTHONPATH=. python -m benchmarks.perf.exact_pass --model tiny --rows 64 --queries 8 --head
    PYTHONPATH=. python -m benchmarks.perf.exact_pass --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

from benchmarks.common import emit, fmt_bytes, load_model, peak_rss_rise, run_child, synthetic_examples, write_result

FILTERS = {"mlp": ["gate_proj", "up_proj", "down_proj"], "down_proj": ["down_proj"]}


def timed(run: Callable[[], Any]) -> tuple:
    """(wall seconds, CPU seconds of this process) of `run()`. On the shared box the CPU seconds
    are the work itself (one torch thread), the wall seconds also the wait for a core."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def child_args(args: argparse.Namespace) -> List[str]:
    return [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("model", "filter", "rows", "batch_size", "seq_len", "threads")
    ] + (["--head"] if args.head else [])


def exact_modules(model, spec, head: bool) -> tuple:
    """(modules by name, parts or None, the modules with a diagonal G): the filter's, and with
    `head` the output head as a part of its own, as the exact pass's default runs them."""
    from gradian_lightning.gradients.capture import select_modules
    from gradian_lightning.hub import output_head

    modules = select_modules(model, spec.module_filter)
    if not head:
        return modules, None, ()
    name, module = output_head(model)
    return {**modules, name: module}, [list(modules), [name]], (name,)


def data(args: argparse.Namespace, vocab: int) -> tuple:
    """(training batches, one query batch) of synthetic rows."""
    from gradian_lightning.data import collate

    keys = ("input_ids", "attention_mask", "labels", "index")
    examples = synthetic_examples(args.rows, args.seq_len, vocab)
    batches = [
        {k: v for k, v in collate(examples[i : i + args.batch_size]).items() if k in keys}
        for i in range(0, args.rows, args.batch_size)
    ]
    queries = collate(synthetic_examples(args.queries, args.seq_len, vocab, seed=1))
    return batches, {k: queries[k] for k in keys[:3]}


def memory_child(args: argparse.Namespace) -> None:
    """Peak RSS rises of the plain exact pass's two steps, emitted as JSON (`run_child`)."""
    import torch

    from gradian_lightning.query.exact import ExactPass
    from gradian_lightning.specs import IndexSpec

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    batches, queries = data(args, model.config.vocab_size)
    spec = IndexSpec(module_filter=FILTERS[args.filter])
    modules, parts, _ = exact_modules(model, spec, args.head)
    made = {}
    prepare = peak_rss_rise(
        lambda: made.setdefault(
            "exact", ExactPass(model, spec, queries, order=args.order, modules=modules, parts=parts)
        )
    )
    score = peak_rss_rise(lambda: made["exact"].score_all(batches, args.rows))
    emit({"prepare": prepare, "score": score})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny or smollm2")
    parser.add_argument("--filter", default="mlp", choices=sorted(FILTERS))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--head", action="store_true", help="the output head as a second part, as the default exact pass"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, 4 short rows, 2 queries: seconds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--order", default="tokens", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="directory of the JSON result (default benchmarks/results)")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.rows, args.batch_size, args.seq_len, args.queries, args.repeats = "tiny", 4, 2, 16, 2, 1
    if args.child:
        return memory_child(args)

    import torch

    from gradian_lightning.gradients.batch import GradientRows
    from gradian_lightning.gradients.factors import Eigenbases, FactorFit, Factors
    from gradian_lightning.query.exact import ExactPass
    from gradian_lightning.specs import IndexSpec

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    batches, queries = data(args, model.config.vocab_size)
    spec = IndexSpec(module_filter=FILTERS[args.filter])
    rows = GradientRows(model, spec)
    modules, parts, diagonal = exact_modules(model, spec, args.head)
    fit = FactorFit(model, spec, modules, diagonal_g=diagonal)
    state: Dict[str, Any] = {}

    def fit_covariances() -> None:
        state["cov"] = fit.covariances(batches[0])
        for batch in batches[1:]:  # summed as they come: one batch's sums alive beside the total
            state["cov"] = state["cov"] + fit.covariances(batch)

    def fit_lambdas() -> None:
        total = fit.lambdas(batches[0], state["bases"])
        for batch in batches[1:]:
            total = total + fit.lambdas(batch, state["bases"])
        state["factors"] = Factors(state["bases"], total)

    def prepare() -> None:
        state["exact"] = ExactPass(model, spec, queries, state["factors"], damping=0.1, modules=modules, parts=parts)

    steps: Dict[str, Callable[[], Any]] = {
        "capture (GradientRows, k = 32)": lambda: [rows(b) for b in batches],
        "fit: A, G sums": fit_covariances,
        "fit: eigendecomposition": lambda: state.__setitem__("bases", Eigenbases.from_sums(state["cov"])),
        "fit: EK-FAC Λ sums": fit_lambdas,
        f"exact: {args.queries} query gradients, preconditioned": prepare,
        "exact: score every row, order=tokens": lambda: (
            state["exact"].__setattr__("order", "tokens") or state["exact"].score_all(batches, args.rows)
        ),
        "exact: score every row, order=examples": lambda: (
            state["exact"].__setattr__("order", "examples") or state["exact"].score_all(batches, args.rows)
        ),
    }
    times: Dict[str, List[tuple]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, run in steps.items():
            times[name].append(timed(run))
    # Memory in fresh processes, where nothing measured before has raised the peak already: the
    # plain inner product (its directions are as large as EK-FAC's) at 1 and at Q queries.
    peak = {
        f"{order}, {q} queries": run_child(
            "benchmarks.perf.exact_pass",
            [*child_args(args), "--order", order, "--queries", str(q)],
            timeout=3600,
        )
        for order in ("tokens", "examples")
        for q in (1, args.queries)
    }
    capture = statistics.median(c for _, c in times["capture (GradientRows, k = 32)"])
    table_rows = []
    for name, t in times.items():
        wall, cpu = statistics.median(w for w, _ in t), statistics.median(c for _, c in t)
        table_rows.append([name, f"{wall:.2f}", f"{cpu:.2f}", f"{cpu / capture:.2f}"])
    factors, exact = state["factors"], state["exact"]
    params = sum(m.weight.numel() for m in modules.values())
    head = ", and the output head as a second part (G diagonal)" if args.head else ""
    text = (
        f"{args.model}, module filter {args.filter}{head} ({len(modules)} modules, {params:,} weights), "
        f"{args.rows} rows of {args.seq_len} tokens (half supervised) in batches of {args.batch_size}, "
        f"{args.queries} queries, float32 on the CPU, {args.threads} thread(s); median of {args.repeats}. "
        f"Factors (Q_A, Q_G, λ_A, λ_G, Λ): {fmt_bytes(factors.nbytes())}. "
        f"Directions per query: {fmt_bytes(exact.nbytes_per_query())}. "
        "Peak RSS rise above the loaded model and batches, in a fresh process, of making the query "
        "directions / of scoring every row: "
        + "; ".join(f"{k}: {fmt_bytes(v['prepare'])} / {fmt_bytes(v['score'])}" for k, v in peak.items())
        + "."
    )
    write_result(
        "exact_pass" if args.smoke else f"exact_pass.{args.model}" + ("-head" if args.head else ""),
        text,
        [{"title": "", "header": ["step", "wall s", "CPU s", "CPU ÷ capture"], "rows": table_rows}],
        out=args.out,
        times=times,
        factor_bytes=factors.nbytes(),
        query_bytes=exact.nbytes_per_query(),
        peak_rss_rise=peak,
    )


if __name__ == "__main__":
    main()
