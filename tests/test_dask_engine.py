"""query.engine=dask on a real two-worker LocalCluster: the same ranking as the local scorer and the float64 reference,
never a row that is not rankable; `gradian query` with it on a file:// index; bad input in one line.

The cluster runs in a child process: distributed leaves threads behind in whatever process starts a
Client, and a later test that forks (Lightning's ddp_fork in test_distributed.py) would deadlock.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROWS, write_jsonl
from test_bad_input import run
from test_cli_processes import clean_env
from test_query import argsort_ranking, build_index

from gradian_lightning.cli import main
from gradian_lightning.errors import ConfigError
from gradian_lightning.index import layout
from gradian_lightning.query import dask_engine
from gradian_lightning.query.dask_engine import dask_client, dask_topk
from gradian_lightning.query.scorer import Scorer, checkpoint_scorers
from gradian_lightning.query.topk import streaming_topk
from gradian_lightning.specs import QuerySpec

pytest.importorskip("distributed")  # the `cluster` extra; `dev` installs it, so CI runs these

CASES = [("cosine", "module"), ("cosine", "row"), ("inner", "module")]
SCRIPT = """
import json, sys
import numpy as np, torch
from distributed import Client, LocalCluster
from gradian_lightning import open_index
from gradian_lightning.cli import main
from gradian_lightning.query.dask_engine import dask_topk
from gradian_lightning.query.scorer import Scorer
from gradian_lightning.specs import QuerySpec

if __name__ == "__main__":  # worker processes re-import this file as __mp_main__
    job = json.loads(sys.argv[1])
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        out = {{"workers": len(client.scheduler_info()["workers"]), "rankings": []}}
        index, queries = open_index(job["index"]), torch.from_numpy(np.load(job["queries"]))
        for score, normalize, k in job["cases"]:
            spec = QuerySpec(top_k=k, bottom_k=k, score=score, normalize=normalize, precondition="none")
            top, bottom = dask_topk(Scorer(index, spec).prepare(queries), client=client)
            out["rankings"].append([r.tolist() for r in (top.indices, top.scores, bottom.indices, bottom.scores)])
        out["query_exit"] = main(job["query"] + [f"query.dask_scheduler={{cluster.scheduler_address}}"])
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow  # a two-worker LocalCluster
def test_dask_ranks_like_the_local_scorer_on_two_workers(tmp_path, saved_model, monkeypatch, capsys):
    n, d, chunk = 41, 8, 6  # 7 chunks, the last one short: several blocks on each worker
    monkeypatch.setattr(layout, "CHUNK_BYTES", chunk * d * 2)
    g = torch.Generator().manual_seed(1)
    grads = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 5
    grads[13] = float("nan")  # stored as zeros, finite=False
    supervised = torch.full((n,), 3)
    supervised[[5, 6, 30]] = 0
    blocks = [(0, 3), (3, 5)]
    index = build_index(
        tmp_path / "ix",
        grads,
        supervised,
        written=[i for i in range(n) if i not in (9, 35)],
        storage_dtype="float16",
        modules=[{"offset": o, "size": z} for o, z in blocks],
    )
    assert index.grads.chunks[0] == chunk
    valid = np.ones(n, dtype=bool)
    valid[[5, 6, 9, 13, 30, 35]] = False
    queries = torch.randn(3, d, generator=g)
    np.save(tmp_path / "queries.npy", queries.numpy())
    cases = [
        (score, normalize, k) for score, normalize in CASES for k in (4, n + 5)
    ]  # k past N: only rankable rows come back

    # `gradian query` with query.engine=dask on a file:// index, against the local engine's answer.
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [
        "configs/smollm2.yaml",
        f"model.name_or_path={saved_model}",
        f"index.path=file://{tmp_path}/cli-ix",
        "trainer.accelerator=cpu",
        "grads.projection_dim=8",
        "grads.module_filter=[down_proj,q_proj]",
    ]
    assert (
        main(["index", *common, f"data.train={train}", "grads.batch_size=3", "trainer.enable_progress_bar=false"]) == 0
    )
    query = ["query", *common, f"query.data={train}", "query.top_k=4", "query.bottom_k=2", "query.method=index"]
    assert main(query + [f"query.output={tmp_path / 'local.jsonl'}"]) == 0
    capsys.readouterr()

    script = tmp_path / "dask_job.py"
    script.write_text(SCRIPT.format())
    job = {
        "index": str(tmp_path / "ix"),
        "queries": str(tmp_path / "queries.npy"),
        "cases": cases,
        "query": query + [f"query.output={tmp_path / 'dask.jsonl'}", "query.engine=dask"],
    }
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(job)],
        cwd=Path(__file__).resolve().parents[1],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    assert (
        result["workers"] == 2
        and result["query_exit"] == 0
        and "queries ranked" in done.stdout
        and "on Dask scheduler tcp://" in done.stdout
    )

    stored = index.rows(slice(None))  # the float16-rounded rows both engines score
    for (score, normalize, k), ranking in zip(cases, result["rankings"]):
        top_i, top_s, bottom_i, bottom_s = (np.asarray(r) for r in ranking)
        spec = QuerySpec(top_k=k, bottom_k=k, score=score, normalize=normalize, precondition="none")
        local_top, local_bottom = streaming_topk(checkpoint_scorers(index, queries, spec))
        np.testing.assert_array_equal(top_i, local_top.indices.numpy())
        np.testing.assert_array_equal(bottom_i, local_bottom.indices.numpy())
        np.testing.assert_allclose(top_s, local_top.scores.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bottom_s, local_bottom.scores.numpy(), rtol=1e-5, atol=1e-6)
        want, _ = argsort_ranking(queries, stored, valid, k, score, blocks=blocks if normalize == "module" else None)
        np.testing.assert_array_equal(top_i, want)
        assert valid[top_i].all() and valid[bottom_i].all()  # never a row that is not rankable
        assert top_i.shape == (3, min(k, int(valid.sum())))

    local = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    dask = [json.loads(line) for line in (tmp_path / "dask.jsonl").read_text().splitlines()]
    assert len(dask) == len(local) == len(ROWS)
    for a, b in zip(local, dask):
        for key in ("results", "opponents"):
            assert [h["index"] for h in b[key]] == [h["index"] for h in a[key]]
            np.testing.assert_allclose([h["score"] for h in b[key]], [h["score"] for h in a[key]], rtol=1e-5, atol=1e-6)


def test_dask_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dask_engine, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(
        ConfigError,
        match=r"setting 'query.dask_scheduler'='tcp://127.0.0.1:9' does not answer \(.*\); start a scheduler there",
    ):
        with dask_client("tcp://127.0.0.1:9"):
            pass
    index = build_index("memory://gradian-dask-test/ix", torch.ones(3, 2))
    with pytest.raises(ConfigError, match="a memory:// store lives in this process and Dask workers see an empty one"):
        dask_topk(Scorer(index, QuerySpec(top_k=1)).prepare(torch.ones(1, 2)))
    code, _, err = run(
        capsys,
        "query",
        "configs/smollm2.yaml",
        "model.name_or_path=unused",
        f"index.path={tmp_path}/ix",
        "query.data=q.jsonl",
        "query.engine=spark",
    )
    assert code == 2 and err == "gradian query: error: setting 'query.engine'='spark' is not allowed; use local or dask"


@pytest.mark.parametrize("storage_dtype", ["float16", "int8"])
def test_dask_blocks_decode_like_the_local_reader(tmp_path, monkeypatch, storage_dtype):
    """Each Dask block decodes its own rows (int8: with its rows' scales, which are chunked apart
    from the grads) exactly as the local scorer does; dask's synchronous scheduler, no cluster."""
    n, d, chunk = 29, 8, 4
    monkeypatch.setattr(layout, "CHUNK_BYTES", chunk * d * layout.NUMPY_DTYPE[storage_dtype]().itemsize)
    g = torch.Generator().manual_seed(2)
    grads = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 5
    blocks = [(0, 3), (3, 5)]
    index = build_index(
        tmp_path / "ix", grads, storage_dtype=storage_dtype, modules=[{"offset": o, "size": z} for o, z in blocks]
    )
    assert index.grads.chunks[0] == chunk
    queries = torch.randn(3, d, generator=g)
    for score, normalize in CASES:
        spec = QuerySpec(top_k=6, bottom_k=2, score=score, normalize=normalize, precondition="none")
        top, bottom = dask_topk(Scorer(index, spec).prepare(queries), client="sync")
        local_top, local_bottom = streaming_topk(checkpoint_scorers(index, queries, spec))
        np.testing.assert_array_equal(top.indices.numpy(), local_top.indices.numpy())
        np.testing.assert_array_equal(bottom.indices.numpy(), local_bottom.indices.numpy())
        np.testing.assert_allclose(top.scores.numpy(), local_top.scores.numpy(), rtol=1e-5, atol=1e-6)
