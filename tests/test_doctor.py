"""`gradian doctor`: a report of what is installed and set, in Markdown or JSON, always exit 0."""

import importlib.util
import json
import re
import sys
from importlib.metadata import version
from pathlib import Path

import tomllib
import torch

from gradian_lightning.cli import main
from gradian_lightning.recipes.doctor import SUPPORTED, release, version_status

ROOT = Path(__file__).resolve().parents[1]


def doctor(capsys, *argv):
    assert main(["doctor", *argv]) == 0
    return capsys.readouterr().out


def test_json_report_matches_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        report = json.loads(doctor(capsys, "configs/smollm2.yaml", "grads.seed=7", "--json"))
    finally:
        torch.use_deterministic_algorithms(False)
    versions = {v["name"]: v for v in report["versions"]}
    assert set(versions) == set(SUPPORTED)
    assert versions["torch"]["installed"] == version("torch") and versions["zarr"]["installed"] == version("zarr")
    # Independently of the implementation: the installed releases against pyproject's own bounds.
    bounds = {
        re.match(r"[a-z]+", dep).group(): re.findall(r"[\d.]+", dep)
        for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    for name, (low, high) in bounds.items():
        installed = tuple(int(p) for p in re.match(r"[\d.]+", version(name)).group().rstrip(".").split("."))
        inside = tuple(map(int, low.split("."))) <= installed < tuple(map(int, high.split(".")))
        assert versions[name]["status"] == ("OK" if inside else "OUTSIDE"), name
    d = report["determinism"]
    assert d["seed"] == 7 and d["deterministic_algorithms"] is True and d["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (
        d["tf32_matmul"] == torch.backends.cuda.matmul.allow_tf32
        and d["cudnn_benchmark"] == torch.backends.cudnn.benchmark
    )
    backends = {b["name"]: b for b in report["backends"]}
    assert (
        backends["cuda"]["available"] == torch.cuda.is_available()
        and backends["gloo"]["available"] == torch.distributed.is_gloo_available()
    )
    assert backends["hooks"]["available"] and backends["zarr (local)"]["available"]
    s3 = importlib.util.find_spec("s3fs") is not None
    assert backends["zarr via fsspec: s3://"]["available"] == s3
    assert s3 or "s3fs" in backends["zarr via fsspec: s3://"]["reason"]  # names the package that enables it
    assert backends["zarr via fsspec: file://"]["available"] and backends["zarr via fsspec: memory://"]["available"]
    dask = importlib.util.find_spec("distributed") is not None and importlib.util.find_spec("dask") is not None
    assert backends["dask (query.engine=dask)"]["available"] == dask
    assert all((b["reason"] is None) == b["available"] for b in report["backends"])  # every missing one says why
    if not torch.cuda.is_available():
        assert report["devices"]["cuda"]["reason"] and report["devices"]["cuda"]["devices"] == []
    assert report["devices"]["cpu"]["torch_threads"] == torch.get_num_threads()


def test_markdown_report_and_exit_0_on_a_broken_config(capsys, tmp_path):
    out = doctor(capsys, str(tmp_path / "missing.yaml"))
    assert out.startswith("## gradian doctor") and "### Versions" in out and "### Backends" in out
    assert re.search(r"\| torch \| [^|]+ \| >=2\.4,<2\.14 \| (OK|OUTSIDE) \|", out)
    assert "| seed | config not loaded: config file" in out
    assert "| seed | 0 |" in doctor(capsys)  # no config: the schema default


def test_version_window():
    assert release("2.13.0+cpu") == (2, 13, 0) and release("2.6.0rc1") == (2, 6, 0)
    assert version_status("torch", "2.13.0+cpu") == "OK"
    assert version_status("torch", "2.14.0") == "OUTSIDE" and version_status("torch", "2.3.1") == "OUTSIDE"
    assert version_status("zarr", "not installed") == "MISSING"


def test_pyproject_bounds_are_the_supported_window():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        name, low, high = re.fullmatch(r"([a-z]+)>=([\d.]+),<([\d.]+)", dep).groups()
        assert SUPPORTED[name] == (low, high), dep
    assert project["requires-python"] == f">={SUPPORTED['python'][0]}"


def test_doctor_runs_without_the_optional_extras(capsys, monkeypatch):
    # A plain `pip install` has no dask, distributed or matplotlib; None in sys.modules makes their import fail.
    for name in ("dask", "dask.array", "distributed", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)
    report = json.loads(doctor(capsys, "--json"))
    backends = {b["name"]: b for b in report["backends"]}
    dask = backends["dask (query.engine=dask)"]
    assert (
        not dask["available"] and dask["reason"] == 'dask is not installed (pip install "gradian-lightning[cluster]")'
    )
    plots = backends["matplotlib (benchmark and validate plots)"]
    assert not plots["available"] and '"gradian-lightning[bench]"' in plots["reason"]
    assert "Traceback" not in doctor(capsys)
