"""query.engine=dask on a real two-worker LocalCluster: the same ranking as the local scorer and the float64 reference,
never a row that is not rankable; `gradian query` with it on a file:// index; bad input in one line."""

import json

import numpy as np
import pytest
import torch

from gradian_lightning.cli import main
from gradian_lightning.errors import ConfigError
from gradian_lightning.index import layout
from gradian_lightning.query import dask_engine
from gradian_lightning.query.dask_engine import dask_client, dask_topk
from gradian_lightning.query.topk import streaming_topk

from conftest import ROWS, write_jsonl
from test_bad_input import run
from test_query import argsort_ranking, build_index

distributed = pytest.importorskip("distributed")  # the `cluster` extra; `dev` installs it, so CI runs these


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        yield cluster


@pytest.mark.parametrize("score, normalize", [("cosine", "module"), ("cosine", "row"), ("inner", "module")])
def test_dask_ranks_like_the_local_scorer_on_two_workers(tmp_path, monkeypatch, cluster, score, normalize):
    n, d, chunk = 41, 8, 6  # 7 chunks, the last one short: several blocks on each worker
    monkeypatch.setattr(layout, "CHUNK_BYTES", chunk * d * 2)
    g = torch.Generator().manual_seed(1)
    grads = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 5
    grads[13] = float("nan")  # stored as zeros, finite=False
    supervised = torch.full((n,), 3)
    supervised[[5, 6, 30]] = 0
    blocks = [(0, 3), (3, 5)]
    index = build_index(tmp_path / "ix", grads, supervised, written=[i for i in range(n) if i not in (9, 35)], storage_dtype="float16",
                        modules=[{"offset": o, "size": z} for o, z in blocks])
    assert index.grads.chunks[0] == chunk
    valid = np.ones(n, dtype=bool)
    valid[[5, 6, 9, 13, 30, 35]] = False
    queries = torch.randn(3, d, generator=g)
    stored = index.rows(slice(None))  # the float16-rounded rows both engines score
    with distributed.Client(cluster) as client:
        assert len(client.scheduler_info()["workers"]) == 2
        for k in (4, int(valid.sum()), n + 5):  # k past the rankable rows: only rankable ones come back
            top, bottom = dask_topk(index, queries, k, score, bottom_k=k, normalize=normalize, client=client)
            local_top, local_bottom = streaming_topk(index, queries, k, score, bottom_k=k, normalize=normalize)
            assert torch.equal(top.indices, local_top.indices) and torch.equal(bottom.indices, local_bottom.indices)
            torch.testing.assert_close(top.scores, local_top.scores, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(bottom.scores, local_bottom.scores, rtol=1e-5, atol=1e-6)
            want, _ = argsort_ranking(queries, stored, valid, k, score, blocks=blocks if normalize == "module" else None)
            np.testing.assert_array_equal(top.indices.numpy(), want)
            assert valid[top.indices.numpy()].all() and valid[bottom.indices.numpy()].all()
            assert top.indices.shape == (3, min(k, int(valid.sum())))


def test_gradian_query_on_dask_against_a_file_url(tmp_path, saved_model, cluster, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = ["configs/smollm2.yaml", f"model.name_or_path={saved_model}", f"index.path=file://{tmp_path}/ix", "trainer.accelerator=cpu",
              "grads.projection_dim=8", "grads.module_filter=[down_proj,q_proj]"]
    assert main(["index", *common, f"data.train={train}", "grads.batch_size=3", "trainer.enable_progress_bar=false"]) == 0
    answers = {}
    for engine in ("local", "dask"):
        out = tmp_path / f"{engine}.jsonl"
        assert main(["query", *common, f"query.data={train}", "query.top_k=4", "query.bottom_k=2", f"query.output={out}",
                     f"query.engine={engine}", f"query.dask_scheduler={cluster.scheduler_address}"]) == 0
        answers[engine] = [json.loads(line) for line in out.read_text().splitlines()]
    assert f"on Dask scheduler {cluster.scheduler_address}" in capsys.readouterr().out
    for local, dask in zip(answers["local"], answers["dask"]):
        for key in ("results", "opponents"):
            assert [h["index"] for h in dask[key]] == [h["index"] for h in local[key]]
            np.testing.assert_allclose([h["score"] for h in dask[key]], [h["score"] for h in local[key]], rtol=1e-5, atol=1e-6)


def test_dask_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dask_engine, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(ConfigError, match=r"setting 'query.dask_scheduler'='tcp://127.0.0.1:9' does not answer \(.*\); start a scheduler there"):
        with dask_client("tcp://127.0.0.1:9"):
            pass
    index = build_index("memory://gradian-dask-test/ix", torch.ones(3, 2))
    with pytest.raises(ConfigError, match="a memory:// store lives in this process and Dask workers see an empty one"):
        dask_topk(index, torch.ones(1, 2), 1)
    code, _, err = run(capsys, "query", "configs/smollm2.yaml", "model.name_or_path=unused", f"index.path={tmp_path}/ix", "query.data=q.jsonl", "query.engine=spark")
    assert code == 2 and err == "gradian query: error: setting 'query.engine'='spark' is not allowed; use local or dask"
