"""query.method=exact: the exact pass (exact.py) as `gradian query`, `gradian validate` and the report use it.

    exact_estimator(QuerySpec)    what the exact pass computes: the one place "auto" is resolved
    resolve_method                query.method=auto: the exact pass within query.exact_budget, else the index
                                  (choose_method: the rule itself, which `gradian plan` applies too)
    TrainBatches                  the index's training rows, tokenised and batched as indexing did
    exact_modules                 the index's modules in a checkpoint's model, checked against it, and
                                  the output head as a second part where the estimator has one
    factor_set_key / factor_set   what a cached factor set was fitted from; `Factors` <-> arrays
    exact_scores                  [Q, N] of one checkpoint, queries taken a memory budget at a time

The recipe (recipes/query.py) loads each checkpoint's model, fits or reads its factors, and sums
the checkpoints' scores with their weights, as the index path sums its scorers.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from gradian_lightning.data import Example, TokenizedRows, collate
from gradian_lightning.gradients.batch import BATCH_KEYS
from gradian_lightning.gradients.factors import Factors
from gradian_lightning.gradients.peft import unwrap_peft
from gradian_lightning.hub import output_head
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.exact import ExactPass
from gradian_lightning.query.rows import check_matches_index
from gradian_lightning.specs import MEMORY_SETTINGS, IndexSpec, QuerySpec, field_names

# What query.precondition=auto computes under the exact pass, chosen by the worst of five LDS sets
# (benchmarks/studies/lds_sets/README.md, "Issue 41"): K-FAC in full space as approximate
# unrolling over this horizon (in units of 1 / the mean eigenvalue, `Factors.precondition`),
# between TracIn's gradient product (short horizons: best on SmolLM2's short fine-tune) and the
# influence function (long ones: best on the tiny models trained from scratch), each checkpoint's
# scores a cosine in that metric before they are summed. K-FAC matched or beat EK-FAC on every set,
# for one fitting pass instead of two.
# With three or more checkpoints (the fine-tune's own, e.g. the callback's checkpoints=True) the
# trajectory itself carries the long-time part and each segment is shorter: a shorter horizon then
# had the best worst-set share (0.86 against 0.82 at 30; 2 checkpoints: 0.79 at 30, 0.77 at 10).
AUTO_FACTORS = "kfac"
AUTO_HORIZON = 30.0
AUTO_HORIZON_TRAJECTORY = 10.0
AUTO_COSINE = True  # query.score=auto: each checkpoint's scores as a cosine in the factors' metric
# precondition=auto adds the output head as a second part (query/exact.py), its G factor diagonal
# (gradients/factors.py), its cosine averaged with the index modules'. On the fact sets the head's
# preconditioned gradient is the strongest single part (an IDF learnt from the softmax): +0.559
# against +0.480 on facts-N256 with 96 queries, 2.9 standard errors above BM25 where the MLP alone
# is 1.2 below, and +0.06 to +0.14 on the other sets but `format` (-0.005, within its noise); in one
# whole-row cosine with the MLP its larger gradients drowned the MLP's on `format`
# (benchmarks/studies/lds_sets/README.md, "the output head in the product's default").
AUTO_HEAD = True
# Bytes of query directions (one [out, in] matrix per module and query) one pass over the training
# rows holds: more queries than fit are scored in several passes.
QUERY_BYTES = 2**31
# Bump when what a factor set holds changes: older sets are then refitted (2: the head's diagonal G).
FACTOR_SET_FORMAT = 2
# The exact pass's fixed cost a checkpoint (the factors' eigendecompositions, the queries' full
# gradients and directions), in supervised tokens of scoring it is worth: ~100 s against ~90 ms a
# token on SmolLM2-135M's MLP (benchmarks/RESULTS.md §13). query.method=auto counts it, so a model
# of that size never goes to the exact pass on a few rows (its query peaked at 17-22 GB).
FIXED_COST_TOKENS = 1_100


@dataclass(frozen=True)
class ExactEstimator:
    """What the exact pass computes. factors: None (no preconditioning), "kfac" or "ekfac";
    cosine: whole-row cosine, in the factors' metric ⟨g, f(H) g⟩ where there are factors;
    damping: λ as a fraction of each module's mean eigenvalue (influence function only);
    horizon: None for the influence function, else approximate unrolling over it;
    head: the output head scored as a second part beside the index's modules (`exact_modules`)."""

    factors: Optional[str]
    cosine: bool
    damping: float
    horizon: Optional[float]
    head: bool = False

    def describe(self) -> str:
        """In the words the query's output, summary line and report use, e.g.
        "exact pass: full-space EK-FAC influence, damping 0.1"."""
        if self.factors is None:
            return f"exact pass: full-space {'whole-row cosine' if self.cosine else 'inner product'}"
        name = {"kfac": "K-FAC", "ekfac": "EK-FAC"}[self.factors]
        cosine = ", whitened cosine" if self.cosine else ""
        head = ", plus the output head as a second part (its G diagonal)" if self.head else ""
        if self.horizon is None:
            return f"exact pass: full-space {name} influence, damping {self.damping:g}{cosine}{head}"
        return f"exact pass: full-space {name} approximate unrolling, horizon {self.horizon:g}{cosine}{head}"


def exact_estimator(spec: QuerySpec, checkpoints: int = 1) -> ExactEstimator:
    """The estimator of a query.method=exact spec (specs.py has refused what cannot be computed).

    precondition=auto: `AUTO_FACTORS` with `AUTO_HORIZON` (`AUTO_HORIZON_TRAJECTORY` where
    `checkpoints`, the number summed, is 3 or more), or with the horizon given, and with a cosine
    the output head as a second part (`AUTO_HEAD`); kfac and
    ekfac: the influence function at query.damping unless a horizon is given; none: the inner
    product, or the whole-row cosine for query.score=cosine. score=auto: cosine if `AUTO_COSINE`
    (in the factors' metric where there are factors), else the inner product."""
    horizon = None if spec.horizon == "auto" else spec.horizon
    cosine = spec.score == "cosine" or (spec.score == "auto" and AUTO_COSINE)
    if spec.precondition == "none":
        return ExactEstimator(None, cosine, float(spec.damping), None)
    if spec.precondition == "auto":
        auto = AUTO_HORIZON_TRAJECTORY if checkpoints >= 3 else AUTO_HORIZON
        horizon = auto if spec.horizon == "auto" else horizon
        return ExactEstimator(AUTO_FACTORS, cosine, float(spec.damping), horizon, head=AUTO_HEAD and cosine)
    return ExactEstimator(spec.precondition, cosine, float(spec.damping), None if horizon is None else float(horizon))


def exact_cost(supervised: int, checkpoints: int, weights: int) -> Tuple[float, str]:
    """What query.method=auto weighs against `query.exact_budget`: (supervised training tokens +
    `FIXED_COST_TOKENS`) x checkpoints summed x the selected modules' weights (out x in summed), and
    the same as the text the summary line shows."""
    value = float((supervised + FIXED_COST_TOKENS) * checkpoints) * weights
    text = f"({supervised:,} supervised tokens + {FIXED_COST_TOKENS:,}) x {checkpoints} checkpoint(s) x {weights:,} weights = {value:.2g}"
    return value, text


def factor_set_bytes(shapes: Iterable[Tuple[int, int]], diagonal: Iterable[Tuple[int, int]] = ()) -> int:
    """Bytes of one checkpoint's factor set in index.path/factors/ before compression, for modules
    of weight shapes (out, in): `Factors.state()` in float32, q_a [in, in], lam_a [in], q_g [out, out],
    lam_g [out] and eigenvalues [out, in] each; a module of `diagonal` (fitted with a diagonal G)
    holds no q_g."""
    return 4 * sum(i * i + i + o * o + o + o * i for o, i in shapes) + 4 * sum(
        i * i + i + o + o * i for o, i in diagonal
    )


def resolve_method(
    spec: QuerySpec, index: IndexReader, checkpoints: int, why_not_exact: Callable[[], Optional[str]] = lambda: None
) -> Tuple[QuerySpec, str]:
    """query.method=auto made concrete for `index` (`choose_method` on its rankable rows' supervised
    tokens and its modules' weights, with the output head's where the estimator scores it and the
    index recorded its size: indexes written before that count the modules alone), and a line
    saying why (empty for an explicit method)."""
    if spec.method != "auto":
        return spec, ""
    supervised = int(index.column("supervised_tokens")[index.rankable(0, len(index))].sum())
    weights = sum(b.out_features * b.in_features for b in index.meta.blocks)
    head = index.meta.model.get("head_features")
    if exact_estimator(spec, checkpoints).head and head:
        weights += int(head[0]) * int(head[1])
    return choose_method(spec, supervised, checkpoints, weights, why_not_exact)


def run_settings_against_exact(engine: str, token_scores: bool) -> Optional[str]:
    """Why the settings of a query run (not of its scoring) keep it off the exact pass, or None:
    `query.engine=dask` and `query.token_scores=true` score and explain the stored rows."""
    if engine == "dask":
        return "query.engine=dask scores the stored rows"
    if token_scores:
        return "query.token_scores=true explains the stored rows' scores"
    return None


def choose_method(
    spec: QuerySpec,
    supervised: int,
    checkpoints: int,
    weights: int,
    why_not_exact: Callable[[], Optional[str]] = lambda: None,
) -> Tuple[QuerySpec, str]:
    """query.method=auto's rule, from the numbers `gradian plan` knows before an index exists too.

    A setting only one method has decides (`QuerySpec.forced_method`); else the exact pass while
    its cost (`exact_cost`) is within `spec.exact_budget`, and the index path past that or where
    `why_not_exact()` (the training data is gone or changed, a Dask engine or token scores were asked
    for) says it cannot run: asked only within the budget, since it reads and fingerprints the
    training data."""
    if spec.method != "auto":
        return spec, ""
    forced = spec.forced_method()
    if forced is not None:
        return replace(spec, method=forced), f"query.method=auto: {forced} (asked for by the query.* settings)"
    value, cost = exact_cost(supervised, checkpoints, weights)
    if value > spec.exact_budget:
        return replace(
            spec, method="index"
        ), f"query.method=auto: index ({cost}, above query.exact_budget={spec.exact_budget:.2g})"
    why = why_not_exact()
    if why:
        return replace(spec, method="index"), f"query.method=auto: index (the exact pass cannot run: {why})"
    return replace(
        spec, method="exact"
    ), f"query.method=auto: exact ({cost}, within query.exact_budget={spec.exact_budget:.2g})"


@dataclass
class ExactModules:
    """What the exact pass runs over at one checkpoint: `modules` by name (the index's, then the
    output head where it is a part of its own), the `spec` it runs with, the `parts` (None: one part
    of every module), the modules fitted with a diagonal G, and `head_note`: why a head the
    estimator asked for is not a part of its own ("" where it is, or was not asked for)."""

    modules: Dict[str, nn.Module]
    spec: IndexSpec
    parts: Optional[List[List[str]]] = None
    diagonal_g: Tuple[str, ...] = ()
    head_note: str = ""


def head_part(
    model: nn.Module, modules: Collection[str], spec: IndexSpec
) -> Tuple[Optional[Tuple[str, nn.Module]], str]:
    """(name, module) of the output head to score as a part of its own beside `modules`, and ""; or
    None and why it cannot be one: no nn.Linear head, the head already among `modules`, or
    grads.loss_chunk_tokens (the chunked loss runs the head outside its module)."""
    found = output_head(model)
    if found is None:
        return None, "the output head is left out: the model has no nn.Linear output head"
    if found[0] in modules:
        return None, "the output head is one of the index's modules, in their one part"
    if spec.loss_chunk_tokens is not None:
        return (
            None,
            "the output head is left out: grads.loss_chunk_tokens runs it outside its module; set grads.loss_chunk_tokens=null to score it",
        )
    return found, ""


def exact_modules(
    index: IndexReader,
    model: nn.Module,
    settings: Optional[IndexSpec] = None,
    given: Optional[Collection[str]] = None,
    head: bool = False,
) -> ExactModules:
    """The index's modules in `model` by name, the spec the exact pass runs with (the index's, with
    the caller's memory-only settings where given, as `index_gradient_rows`) and, with `head`, the
    output head as a second part with a diagonal G, where the model and settings allow it (else
    `head_note` says why not). Raises `IndexMismatchError` where the model or settings cannot match
    the index."""
    model = unwrap_peft(model)
    check_matches_index(index, model, settings, given)
    linears = dict(model.named_modules())
    given = set(field_names(IndexSpec) if given is None else given)
    memory = {k: getattr(settings, k) for k in MEMORY_SETTINGS if settings is not None and k in given}
    modules = {b.name: linears[b.name] for b in index.meta.blocks}
    spec = replace(index.meta.spec, **memory)
    if not head:
        return ExactModules(modules, spec)
    found, note = head_part(model, modules, spec)
    if found is None:
        return ExactModules(modules, spec, head_note=note)
    name, module = found
    return ExactModules({**modules, name: module}, spec, [list(modules), [name]], (name,))


class TrainBatches:
    """The training rows at `positions`, tokenised (`TokenizedRows`) and collated as indexing
    collated them, `batch_size` at a time: each batch's `input_ids`, `attention_mask`, `labels` on
    `device` and its `index` (dataset positions) on the CPU, where `ExactPass.score_all` puts the
    columns. Iterable again and again (a factor fit reads the rows twice), tokenising as it goes:
    memory does not grow with the rows. Collated here, not by a DataLoader, whose iterator draws
    from the caller's RNG."""

    def __init__(
        self,
        rows: TokenizedRows,
        positions: Sequence[int],
        batch_size: int,
        pad_token_id: int,
        device: torch.device,
    ) -> None:
        self.rows, self.positions, self.batch_size = rows, [int(p) for p in positions], batch_size
        self.pad, self.device = pad_token_id, device

    def __len__(self) -> int:
        return -(-len(self.positions) // self.batch_size)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        for lo in range(0, len(self.positions), self.batch_size):
            examples: List[Example] = [self.rows[p] for p in self.positions[lo : lo + self.batch_size]]
            batch = collate(examples, pad_token_id=self.pad)
            yield {**{k: batch[k].to(self.device) for k in BATCH_KEYS}, "index": batch["index"]}


def positions_digest(positions: np.ndarray) -> str:
    """SHA-256 of the positions fitted on (int64): the rows of a factor set."""
    return hashlib.sha256(np.asarray(positions, dtype=np.int64).tobytes()).hexdigest()


def factor_set_key(
    index: IndexReader,
    kind: str,
    positions: np.ndarray,
    max_seq_length: int,
    precision: Any,
    modules: Optional[Sequence[str]] = None,
    diagonal_g: Sequence[str] = (),
) -> Dict[str, Any]:
    """What a factor set of checkpoint `index` was fitted from: any difference refits it. The
    modules (the index's unless given) and those fitted with a diagonal G, the training data (each
    source's fingerprint), the rows fitted on, their tokenisation, the checkpoint's weights (their
    digest, or the model's name where the index has none) and the precision the model ran in."""
    entry = next(e for e in index.checkpoints if int(e["step"]) == index.step)
    return {
        "format": FACTOR_SET_FORMAT,
        "kind": kind,
        "modules": list(modules) if modules is not None else [b.name for b in index.meta.blocks],
        "diagonal_g": list(diagonal_g),
        "data": [s["data"].get("fingerprint") or s["data"].get("sha256") for s in index.meta.data_segments()],
        "rows": positions_digest(positions),
        "max_seq_length": int(max_seq_length),
        "weights": entry.get("weights_sha256") or index.meta.model.get("name_or_path"),
        "precision": str(precision),
    }


def factor_set_name(step: int, kind: str) -> str:
    """The name of checkpoint `step`'s factor set under index.path/factors/."""
    return f"step-{int(step)}-{kind}"


def factor_arrays(factors: Factors) -> Dict[str, np.ndarray]:
    """`Factors.state()` as float32 NumPy arrays, to store."""
    return {k: t.detach().to("cpu", torch.float32).numpy() for k, t in factors.state().items()}


def factors_from_arrays(arrays: Dict[str, np.ndarray], kind: str, device: torch.device) -> Factors:
    """The `Factors` that `factor_arrays` stored, on `device`."""
    return Factors.from_state({k: torch.from_numpy(np.asarray(v)).to(device) for k, v in arrays.items()}, kind)


def return_freed_memory() -> None:
    """Hand the heap memory the process has freed back to the system (glibc's `malloc_trim(0)`).

    Why: glibc keeps freed blocks below its mmap threshold for reuse, and the exact pass frees
    gigabytes of them in tens-of-MB pieces (each query's raw gradients once preconditioned, each
    group's directions), so its RSS would carry the sum of every phase's temporaries: on SmolLM2 up
    to 3.3 GB of the 8.4 GiB peak was freed memory glibc kept (benchmarks/RESULTS.md §13). Called
    between the pass's phases, never inside a batch. Where the C library has no `malloc_trim`
    (macOS, musl, Windows) there is nothing to call and freed memory goes back as that allocator decides."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no handle of the process itself
        return
    trim(0)


def queries_per_pass(modules: Dict[str, nn.Module]) -> int:
    """Queries whose directions (float32, one [out, in] per module) fit in `QUERY_BYTES`."""
    per_query = 4 * sum(int(m.weight.numel()) for m in modules.values())
    return max(1, QUERY_BYTES // max(per_query, 1))


def exact_scores(
    model: nn.Module,
    spec: IndexSpec,
    modules: Dict[str, nn.Module],
    queries: Sequence[Example],
    pad_token_id: int,
    batches: TrainBatches,
    rows: int,
    estimator: ExactEstimator,
    factors: Optional[Factors] = None,
    parts: Optional[Sequence[Sequence[str]]] = None,
) -> torch.Tensor:
    """float32 [Q, rows] on the CPU: each query's exact score of every row `batches` holds, at its
    dataset position (0 elsewhere), one `ExactPass` per `queries_per_pass` queries. `factors` are
    needed when `estimator.factors` is set; `parts` as `ExactModules.parts`."""
    out = []
    step = queries_per_pass(modules)
    for lo in range(0, len(queries), step):
        batch = collate(list(queries[lo : lo + step]), pad_token_id=pad_token_id)
        exact = ExactPass(
            model,
            spec,
            {k: batch[k].to(batches.device) for k in BATCH_KEYS},
            factors=factors if estimator.factors else None,
            damping=estimator.damping,
            cosine=estimator.cosine,
            modules=modules,
            horizon=estimator.horizon,
            parts=parts,
        )
        return_freed_memory()  # the raw gradients and preconditioning temporaries
        out.append(exact.score_all(batches, rows).float())
        del exact  # before the next group's directions are made: one group's held at a time
        return_freed_memory()
    return torch.cat(out)
