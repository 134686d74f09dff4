"""`query.engine: dask`: rank an index on a Dask cluster, for indexes too big for one machine's memory or patience.

    grads [N, D] --dask.array.from_zarr--> blocks of the stored row chunks [c, D]
      --map_blocks(Scorer.score, the local engine's own scorer)--> scores [N, Q], blocks [c, Q]
      --masked: rows not rankable get -inf (top) / +inf (bottom)--> dask.array.argtopk / topk
        along the rows: tree reductions over the blocks --> [k, Q] indices and scores

The query rows are prepared once by the same `Scorer` (scorer.py) that `streaming_topk` uses,
and every block is scored by its `score`, so both engines compute the same numbers; only the
reduction differs. The workers open `index.path` themselves (the graph carries zarr arrays, not
bytes): it must name the same store for them as for this process, e.g. a shared filesystem or an
s3:// / gs:// URL. `dask[array]` and `distributed` come with `pip install "gradian-lightning[cluster]"`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np
import torch

from gradian_lightning.errors import ConfigError, GradianError
from gradian_lightning.extras import require_extra
from gradian_lightning.index.layout import SCALES, decode
from gradian_lightning.index.reader import IndexReader
from gradian_lightning.query.scorer import Scorer
from gradian_lightning.query.topk import Ranking

# Seconds to wait for a scheduler at query.dask_scheduler before saying it does not answer.
CONNECT_TIMEOUT_S = 10


def _require_dask() -> None:
    for module in ("dask.array", "distributed"):
        require_extra(module, "cluster", "setting 'query.engine'='dask'")


@contextlib.contextmanager
def dask_client(scheduler: Optional[str] = None) -> Iterator[Any]:
    """A `distributed.Client` on the scheduler at `scheduler`, or on a fresh `LocalCluster` (closed on exit)."""
    _require_dask()
    from distributed import Client, LocalCluster

    if scheduler:
        try:
            client = Client(scheduler, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"setting 'query.dask_scheduler'={scheduler!r} does not answer ({first}); start a scheduler there (`dask scheduler`) and check the address, or leave it unset to start a LocalCluster on this machine"
            ) from None
        with client:
            yield client
        return
    with LocalCluster() as cluster, Client(cluster) as client:
        yield client


def check_workers_can_open(index: IndexReader) -> None:
    """Refuse an index that Dask workers cannot open: a memory:// store exists only in this process."""
    if index.path.protocol == "memory":
        raise ConfigError(
            f"setting 'query.engine'='dask' cannot read index.path={str(index.path)!r}: a memory:// store lives in this process and Dask workers see an empty one; use query.engine=local, or write the index to a directory or bucket the workers can reach"
        )


def _score_block(block: np.ndarray, scales: Optional[np.ndarray], scorer: Scorer, storage_dtype: str) -> np.ndarray:
    # Runs on a worker: one stored chunk [c, D] (and its int8 scales [c, M]) -> its scores [c, Q]
    # (rows along axis 0, as grads).
    rows = decode(block, storage_dtype, scales=scales, blocks=scorer.blocks)
    return scorer.score(rows).T.numpy()


def dask_topk(
    scorer: Scorer, *, scheduler: Optional[str] = None, client: Optional[Any] = None
) -> tuple[Ranking, Optional[Ranking]]:
    """`streaming_topk`'s answer for one prepared CPU `Scorer` (one checkpoint: sums of
    checkpoints are the local engine's), computed on a Dask cluster: (top, bottom or None),
    `Ranking`s on the CPU.

    Runs on `client` (a `distributed.Client`) when given, else on the scheduler at `scheduler`, else
    on a `distributed.LocalCluster` started for this call.
    Rows that are unwritten, non-finite or have no supervised token are never ranked.
    """
    _require_dask()
    import dask
    import dask.array as da

    index = scorer.index
    check_workers_can_open(index)
    k, bottom_k = scorer.spec.rows_wanted(len(index)), scorer.spec.bottom_k
    group = index.group
    grads = da.from_zarr(index.grads)  # blocks are the stored chunks: [c, D], one read each
    rows = grads.chunks[0]
    # int8 rows' scales [N, M], in the grads' row blocks so that each task reads its own rows' scales.
    scales = da.from_zarr(group[SCALES]).rechunk((rows, -1)) if index.storage_dtype == "int8" else None
    scores = da.map_blocks(
        _score_block,
        grads,
        scales,
        scorer,
        index.storage_dtype,
        dtype=np.float32,
        chunks=(rows, (len(scorer.queries),)),
        meta=np.empty((0, 0), np.float32),
    )
    rankable = (
        da.from_zarr(group["complete"]) & da.from_zarr(group["finite"]) & (da.from_zarr(group["supervised_tokens"]) > 0)
    ).rechunk((rows,))
    n = len(index)

    def best(masked: Any, k: int, largest: bool) -> Any:
        """Lazy ([k, Q] indices, [k, Q] scores), best first, as Dask tree reductions over the blocks."""
        if (
            k >= n
        ):  # dask's argtopk fails for k >= N (dask 2026.8); then the whole [N, Q] is at most k rows: sort it here
            return masked
        signed = k if largest else -k
        return da.argtopk(masked, signed, axis=0), da.topk(masked, signed, axis=0)

    wanted = [rankable.sum(), best(da.where(rankable[:, None], scores, -np.inf), k, True)]  # masked rows never win
    if bottom_k:
        wanted.append(best(da.where(rankable[:, None], scores, np.inf), bottom_k, False))
    with contextlib.nullcontext(client) if client is not None else dask_client(scheduler) as client:
        found = dask.compute(*wanted, scheduler=client)
    count = int(found[0])
    # The same count read here: workers that opened another store at index.path (a local path on
    # another machine reads as empty) would otherwise return a plausible, empty ranking.
    expected = int(index.rankable(0, n).sum())  # per-row flags: 6 bytes a row, next to the grads' kilobytes
    if count != expected:
        raise GradianError(
            f"the Dask workers see {count} rankable rows at index.path={str(index.path)!r}, this process {expected}; give index.path as a path or URL the workers reach at the same name (a shared filesystem, s3:// or gs://)"
        )

    def ranking(reduced: Any, k: int, largest: bool) -> Ranking:
        if isinstance(reduced, np.ndarray):  # the whole masked [N, Q]
            order = np.argsort(-reduced if largest else reduced, axis=0, kind="stable")
            reduced = (order, np.take_along_axis(reduced, order, axis=0))
        indices, values = reduced
        kept = min(k, count)  # fewer rankable rows than k: the rest are the masked +-inf
        return Ranking(
            torch.from_numpy(np.ascontiguousarray(indices.T[:, :kept])).long(),
            torch.from_numpy(np.ascontiguousarray(values.T[:, :kept])).float(),
        )

    top = ranking(found[1], k, True)
    bottom = ranking(found[2], bottom_k, False) if bottom_k else None
    return top, bottom
