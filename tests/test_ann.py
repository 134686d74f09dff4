"""query.search=ann (query/ann.py): candidates from FAISS indexes of the rows as compared, re-scored
exactly. Its recall against the exact scan, its scores against the exact scorer's, the refusal
without the extra, and a build killed half-way is rebuilt, never searched."""

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
from conftest import WORDS, tiny_settings, write_jsonl

from gradian_lightning import open_index
from gradian_lightning.config import load_config
from gradian_lightning.errors import ConfigError, IndexMismatchError, MissingExtraError
from gradian_lightning.index.location import Location
from gradian_lightning.index.writer import IndexWriter
from gradian_lightning.query import ann
from gradian_lightning.query.scorer import checkpoint_scorers
from gradian_lightning.query.topk import streaming_topk
from gradian_lightning.recipes.index import run_index
from gradian_lightning.recipes.query import run_query
from gradian_lightning.specs import QuerySpec

# The `ann` extra; `dev` installs it, so CI runs these. The refusal without it runs either way.
needs_faiss = pytest.mark.skipif(importlib.util.find_spec("faiss") is None, reason="faiss-cpu (the ann extra)")

N, MODULES, SIZE = 3000, 4, 64  # 4 modules of k² = 64: D = 256
D = MODULES * SIZE


def structured_rows(n: int, generator: torch.Generator) -> torch.Tensor:
    """[n, D] rows with a low-rank part (as gradients have) plus noise, so that neighbours are real."""
    basis = torch.randn(16, D, generator=torch.Generator().manual_seed(123))
    return torch.randn(n, 16, generator=generator) @ basis + 0.5 * torch.randn(n, D, generator=generator)


@pytest.fixture(scope="module")
def index_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("ann") / "ix"
    blocks = [{"name": f"m{i}", "offset": i * SIZE, "size": SIZE} for i in range(MODULES)]
    writer = IndexWriter(path, N, D, "int8", {"fingerprint": "ann-test", "modules": blocks})
    rows = structured_rows(N, torch.Generator().manual_seed(0))
    supervised = torch.ones(N)
    supervised[7] = 0  # never ranked: must not come back from the ANN path either
    for lo in range(0, N, 500):
        hi = lo + 500
        writer.write(
            range(lo, hi), rows[lo:hi], torch.zeros(500), supervised[lo:hi], torch.zeros(500), list(range(lo, hi))
        )
    assert writer.close()
    return path


def queries():
    return structured_rows(8, torch.Generator().manual_seed(1))


def both(path, **settings):
    """(exact top, ann top) for the same queries and settings."""
    index = open_index(path)
    spec = QuerySpec(**settings)
    exact, _ = streaming_topk(checkpoint_scorers(index.reader, queries(), spec))
    approximate, _ = ann.ann_topk(checkpoint_scorers(index.reader, queries(), spec, shortcut=False))
    return exact, approximate


def recall(exact, approximate) -> float:
    hits = [len(set(e.tolist()) & set(a.tolist())) for e, a in zip(exact.indices, approximate.indices)]
    return sum(hits) / exact.indices.numel()


@needs_faiss
@pytest.mark.parametrize(
    "settings",
    [
        {},  # auto: fisher, whole-row cosine
        {"precondition": "none"},  # per-module cosine
        {"score": "inner", "precondition": "none"},
        {"ann_sketch_dim": 128, "ann_shard_rows": 1000},  # rows sketched to half their width, 3 shards
    ],
)
def test_recall_at_10_against_the_exact_scan(index_path, settings):
    exact, approximate = both(index_path, search="ann", **settings)
    assert recall(exact, approximate) >= 0.95
    assert 7 not in approximate.indices


@needs_faiss
@pytest.mark.parametrize(
    "settings",
    [
        {},  # auto: fisher, whole-row cosine
        {"precondition": "fisher", "normalize": "module", "damping": 0.3},
        {"precondition": "ekfac"},
        {"precondition": "diag", "score": "inner"},
        {"precondition": "none"},
    ],
)
def test_rescored_scores_are_the_exact_scorers(index_path, settings):
    # Candidates are scored with the preconditioner on the queries and the rows' norms from the
    # ANN index: the numbers must be the exact scan's, whatever the preconditioner and normalisation.
    _, approximate = both(index_path, search="ann", ann_candidates=30, **settings)
    every = open_index(index_path).score_all(queries(), **settings)  # the exact scan's scores of every row, [Q, N]
    torch.testing.assert_close(approximate.scores, every.gather(1, approximate.indices), rtol=1e-5, atol=1e-6)
    # best first, by those scores
    assert (approximate.scores[:, :-1] >= approximate.scores[:, 1:]).all()


@needs_faiss
def test_bottom_k_comes_from_the_negated_queries(index_path):
    index = open_index(index_path)
    spec = QuerySpec(search="ann", bottom_k=5, precondition="none")
    _, exact = streaming_topk(checkpoint_scorers(index.reader, queries(), spec))
    _, approximate = ann.ann_topk(checkpoint_scorers(index.reader, queries(), spec, shortcut=False))
    assert recall(exact, approximate) >= 0.95
    assert (approximate.scores < 0).all()


@needs_faiss
def test_the_build_is_kept_and_reused(index_path, monkeypatch):
    both(index_path, search="ann", precondition="none")  # built (or already there)
    monkeypatch.setattr(ann, "build_shard", lambda *a: pytest.fail("a finished ANN index was rebuilt"))
    both(index_path, search="ann", precondition="none")


@needs_faiss
def test_a_killed_build_is_rebuilt_never_searched(tmp_path, index_path, monkeypatch):
    import shutil

    path = tmp_path / "ix"
    shutil.copytree(index_path, path, ignore=shutil.ignore_patterns("ann"))
    spec = QuerySpec(search="ann", ann_shard_rows=1000, precondition="none")
    scorer = checkpoint_scorers(open_index(path).reader, queries(), spec, shortcut=False)[0]
    real = ann.build_shard
    built = []

    def killed_after_one(scorer, number):
        if number == 1:
            raise KeyboardInterrupt  # the process dies while shard 1 is written
        built.append(number)
        return real(scorer, number)

    monkeypatch.setattr(ann, "build_shard", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        ann.open_ann(scorer)
    where = ann.folder(scorer)
    assert not (tmp_path / where / ann.MANIFEST).exists()
    # half a shard file, as a kill in the middle of its write leaves it: its marker is not there
    (tmp_path / where / "shard-00001.faiss").write_bytes(b"half")
    first = tmp_path / where / "shard-00000.faiss"
    finished = first.stat().st_mtime_ns
    monkeypatch.setattr(ann, "build_shard", real)
    opened = ann.open_ann(scorer)
    assert built == [0] and first.stat().st_mtime_ns == finished  # the finished shard 0 was kept
    assert json.loads((tmp_path / where / ann.MANIFEST).read_text())["shards"][1]["rows"] == 1000
    assert sum(s.ntotal for s in opened.shards) == N - 1  # every rankable row: all but row 7


@needs_faiss
def test_an_index_that_changed_is_rebuilt(tmp_path, index_path):
    import shutil

    path = tmp_path / "ix"
    shutil.copytree(index_path, path, ignore=shutil.ignore_patterns("ann"))
    spec = QuerySpec(search="ann", precondition="none")
    scorer = checkpoint_scorers(open_index(path).reader, queries(), spec, shortcut=False)[0]
    manifest = ann.open_ann(scorer).manifest
    stale = {**manifest, "identity": {**manifest["identity"], "written": 5}}  # as if built on an unfinished index
    (tmp_path / ann.folder(scorer) / ann.MANIFEST).write_text(json.dumps(stale))
    for marker in (tmp_path / ann.folder(scorer)).glob("shard-*.json"):
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "identity": stale["identity"]}))
    assert ann.open_ann(scorer).manifest["identity"] == manifest["identity"]


@needs_faiss
def test_shards_are_memory_mapped_opened_once_and_never_stale(tmp_path, index_path, monkeypatch):
    import shutil

    import faiss
    import fsspec

    path = tmp_path / "ix"
    shutil.copytree(index_path, path, ignore=shutil.ignore_patterns("ann"))
    spec = QuerySpec(search="ann", precondition="none", ann_shard_rows=1000)
    scorer = checkpoint_scorers(open_index(path).reader, queries(), spec, shortcut=False)[0]
    flags, real = [], faiss.read_index
    monkeypatch.setattr(faiss, "read_index", lambda where, flag=0: flags.append(flag) or real(where, flag))
    first = ann.open_ann(scorer)
    assert flags == [faiss.IO_FLAG_MMAP] * 3  # a local folder: each of the 3 shards mapped, not read
    again = checkpoint_scorers(open_index(path).reader, queries(), spec, shortcut=False)[0]
    assert ann.open_ann(again) is first and len(flags) == 3  # the next batch: opened once per process
    # The same shards read whole, as from an fsspec URL, find the same candidates.
    memory = fsspec.filesystem("memory")
    for shard in (tmp_path / ann.folder(scorer)).glob("shard-*"):
        memory.pipe_file(f"/ann-{tmp_path.name}/{shard.name}", shard.read_bytes())
    read = ann.AnnIndex(memory, f"/ann-{tmp_path.name}", first.manifest, first.sketch, MODULES)
    np.testing.assert_array_equal(read.candidates(scorer.queries, 20, 4), first.candidates(scorer.queries, 20, 4))
    everywhere = np.array([0, 7, 999, 1000, 2500, 2999])  # in each of the 3 shards, row 7 unrankable
    assert torch.equal(read.norms_at(everywhere), first.norms_at(everywhere))
    # Another state of the index (here: fewer rows written) is another manifest: rebuilt, opened afresh.
    now = ann.identity
    monkeypatch.setattr(ann, "identity", lambda s: {**now(s), "written": 5})
    changed = ann.open_ann(again)
    assert changed is not first and changed.manifest["identity"]["written"] == 5
    assert flags.count(faiss.IO_FLAG_MMAP) == 6


def test_without_the_extra_the_refusal_is_one_line(index_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # what an environment without faiss-cpu imports
    refusal = (
        "setting 'query.search'='ann' needs faiss, which is not installed here; "
        + 'pip install "gradian-lightning[ann]"'
    )
    with pytest.raises(MissingExtraError) as err:
        both(index_path, search="ann")
    assert str(err.value) == refusal
    # gradian query refuses before any model loads: the model named here does not exist
    cfg = load_config(None, ["model.name_or_path=no/such-model", f"index.path={index_path}", "query.search=ann"])
    with pytest.raises(MissingExtraError) as err:
        run_query(cfg, queries=[{"prompt": "a", "completion": " b"}])
    assert str(err.value) == refusal


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="query.search"):
        QuerySpec(search="fast")
    with pytest.raises(ConfigError, match="query.top_k=all"):
        QuerySpec(search="ann", top_k="all")
    with pytest.raises(ConfigError, match="query.ann_candidates"):
        QuerySpec(ann_candidates=0)
    assert not ann.uses_ann(QuerySpec(search="auto"), ann.AUTO_ANN_ROWS - 1)
    assert ann.uses_ann(QuerySpec(search="auto"), ann.AUTO_ANN_ROWS)
    assert not ann.uses_ann(QuerySpec(search="auto", top_k="all"), 10 * ann.AUTO_ANN_ROWS)
    assert ann.uses_ann(QuerySpec(search="ann"), 1)


def test_index_topk_is_the_exact_scan_and_says_so(index_path):
    with pytest.raises(
        ConfigError, match=r"Index.topk\(search='ann'\) is the exact scan; for the two-stage search call"
    ):
        open_index(index_path).topk(queries(), 10, search="ann")


def test_sketch_keeps_inner_products_unbiased():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 4096, generator=g), torch.randn(1, 4096, generator=g)
    b = 0.6 * a + 0.8 * b  # cosine about 0.6
    a, b = a / a.norm(), b / b.norm()
    estimates = [(ann.Sketch(4096, 256, seed)(a) @ ann.Sketch(4096, 256, seed)(b).T).item() for seed in range(200)]
    exact = float(a @ b.T)
    assert abs(np.mean(estimates) - exact) < 0.02  # standard error about 0.07 / √200
    assert 0.03 < np.std(estimates) < 0.12  # about 1/√256


ROWS = [{"id": f"r{i}", "prompt": f"what is {WORDS[i]} ?", "completion": f" {WORDS[i + 20]} ."} for i in range(20)]


@needs_faiss
def test_gradian_query_with_search_ann_answers_like_the_exact_scan(tmp_path, saved_model):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    queries = write_jsonl(tmp_path / "q.jsonl", ROWS[3:5])
    path = tmp_path / "ix"
    run_index(tiny_settings(saved_model, train, path))
    answers = {
        search: run_query(
            tiny_settings(
                saved_model,
                train,
                path,
                f"query.data={queries}",
                "query.top_k=5",
                "query.bottom_k=2",
                f"query.search={search}",
                "query.method=index",  # the stored rows' scan and ANN search, not the exact pass
            )
        )
        for search in ("exact", "ann")
    }
    for exact, approximate in zip(answers["exact"]["results"], answers["ann"]["results"]):
        for key in ("results", "opponents"):  # 20 rows: every row is a candidate, so the rankings agree
            assert [r["id"] for r in exact[key]] == [r["id"] for r in approximate[key]]
            np.testing.assert_allclose(
                [r["score"] for r in exact[key]], [r["score"] for r in approximate[key]], rtol=1e-5, atol=1e-6
            )
        assert "ANN candidates" in approximate["scoring"] and "ANN" not in exact["scoring"]
    assert (path / "ann").is_dir()
    with pytest.raises(ConfigError, match="query.search'='ann' runs on the local engine"):
        run_query(
            tiny_settings(saved_model, train, path, f"query.data={queries}", "query.search=ann", "query.engine=dask")
        )
    Location(path).remove_index(holds_index=True)  # index.overwrite=true takes the ANN index with it
    assert Location(path).entries() == []


@needs_faiss
def test_an_index_without_rankable_rows_ranks_nothing(tmp_path):
    blocks = [{"name": "m0", "offset": 0, "size": D}]
    writer = IndexWriter(tmp_path / "ix", 20, D, "float16", {"fingerprint": "empty", "modules": blocks})
    writer.write(range(20), torch.randn(20, D), torch.zeros(20), torch.zeros(20), torch.zeros(20), list(range(20)))
    writer.close()
    spec = QuerySpec(search="ann", precondition="none", bottom_k=2)
    top, bottom = ann.ann_topk(checkpoint_scorers(open_index(tmp_path / "ix").reader, queries(), spec, shortcut=False))
    assert top.indices.shape == (8, 0) and bottom.scores.shape == (8, 0)


def compress(group, name):
    """Array `name` of `group` written again with zarr's default compressor (zstd)."""
    old = group[name]
    values, chunks = old[:], old.chunks
    del group[name]
    group.create_array(name, shape=values.shape, chunks=chunks, dtype=values.dtype)[:] = values


@pytest.mark.parametrize("storage", ["int8", "float16", "int8 zstd scales", "int8 memory://"])
def test_rows_read_by_the_row_are_the_chunk_reads_bit_for_bit(tmp_path, storage):
    # 203 rows of 16 a chunk: the last stored chunk holds 11 rows, and the writer leaves chunk 3
    # unwritten (rows 48..63 never written read as the fill value, as zarr reads them). A local
    # folder is read by pread, a memory:// URL through zarr's ranged reads of its store.
    rows, width = 203, 96
    blocks = [{"name": f"m{i}", "offset": i * 32, "size": 32} for i in range(3)]
    dtype = storage.split()[0]
    path = f"memory://rows-{tmp_path.name}" if storage.endswith("memory://") else str(tmp_path / "ix")
    writer = IndexWriter(path, rows, width, dtype, {"fingerprint": "rows", "modules": blocks}, rows_per_chunk=16)
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, width)
    for lo in [a for a in range(0, rows, 16) if a != 48]:
        hi = min(lo + 16, rows)
        n = hi - lo
        writer.write(range(lo, hi), values[lo:hi], torch.zeros(n), torch.ones(n), torch.zeros(n), list(range(lo, hi)))
    writer.close()  # False: chunk 3 is missing
    if "zstd scales" in storage:  # as indexes written before scales were stored raw hold them
        compress(Location(path).open_group("r+"), "scales")
    reader = open_index(path).reader
    assert reader_layouts(reader) == ((True, None) if dtype == "float16" else (True, "zstd" not in storage))
    order = np.random.default_rng(0).permutation(rows)
    for positions in (
        np.arange(rows),  # every row: runs of whole chunks and the short last one
        np.array([202, 0, 17, 17, 201, 50, 5, 16, 15, 202]),  # unsorted, repeated, the last rows, an unwritten chunk
        order[:40],
        np.array([], dtype=np.int64),
    ):
        expected = reader.rows(positions)
        got = reader.rows_at(positions)
        assert got.dtype == torch.float32 and got.shape == (len(positions), width)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bit for bit
    with pytest.raises(
        IndexMismatchError, match=r"row position 203 is not a row of the index at .*, which holds 203 rows \(0..202\)"
    ):
        reader.rows_at([5, rows])


def reader_layouts(reader):
    """(grads read by the row, scales read by the row or None without scales)."""
    from gradian_lightning.index.reader import raw_row_dtype

    scales = None if reader._scales_array is None else raw_row_dtype(reader._scales_array) is not None
    return raw_row_dtype(reader.grads) is not None, scales
