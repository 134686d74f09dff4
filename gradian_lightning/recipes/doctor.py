"""`gradian doctor`: the environment, as a report to paste into a bug report. It reports, it doesn't judge.

The supported window is `gradian_lightning.versions.SUPPORTED`.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

from gradian_lightning.index.location import missing_filesystem
from gradian_lightning.versions import SUPPORTED, package_versions


def release(text: str) -> Tuple[int, ...]:
    """The numeric release of a version string: '2.13.0+cpu' -> (2, 13, 0), '2.6.0rc1' -> (2, 6, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(part) for part in match.group(0).split(".")[:3]) if match else ()


def version_status(name: str, installed: str) -> str:
    """OK, OUTSIDE (of `SUPPORTED[name]`) or MISSING."""
    if installed == "not installed":
        return "MISSING"
    low, high = SUPPORTED[name]
    return "OK" if release(low) <= release(installed) < release(high) else "OUTSIDE"


def versions_report() -> List[Dict[str, str]]:
    installed = package_versions()
    return [
        {
            "name": name,
            "installed": installed[name],
            "supported": f">={low},<{high}",
            "status": version_status(name, installed[name]),
        }
        for name, (low, high) in SUPPORTED.items()
    ]


def _cuda() -> Dict[str, Any]:
    if torch.version.cuda is None:
        return {"available": False, "reason": f"torch {torch.__version__} is a build without CUDA", "devices": []}
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no driver or no GPU found"
        return {
            "available": False,
            "reason": f"torch built with CUDA {torch.version.cuda} sees no device ({why})",
            "devices": [],
        }
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {"index": i, "name": p.name, "memory_bytes": int(p.total_memory), "capability": f"{p.major}.{p.minor}"}
        )
    return {"available": True, "reason": None, "cuda_version": torch.version.cuda, "devices": devices}


def _mps() -> Dict[str, Any]:
    if not torch.backends.mps.is_built():
        return {
            "available": False,
            "reason": "torch was built without MPS (it exists only in macOS builds)",
            "devices": [],
        }
    if not torch.backends.mps.is_available():
        return {
            "available": False,
            "reason": "MPS is built but unavailable (needs macOS 12.3+ on Apple silicon)",
            "devices": [],
        }
    return {
        "available": True,
        "reason": None,
        "devices": [{"index": 0, "name": "mps", "memory_bytes": int(torch.mps.recommended_max_memory())}],
    }


def devices_report() -> Dict[str, Any]:
    return {
        "cuda": _cuda(),
        "mps": _mps(),
        "cpu": {
            "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
        },
    }


def determinism_report(seed: Any) -> Dict[str, Any]:
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "seed": seed,
    }


def _check_hooks() -> Optional[str]:
    """None when forward hooks capture a Linear's output-gradient here, else why not."""
    from gradian_lightning.gradients.capture import LinearCapture

    try:
        linear = torch.nn.Linear(3, 2)
        capture = LinearCapture({"probe": linear})
        with capture:
            y = linear(torch.ones(1, 3))
        grads = capture.output_grads((y * torch.tensor([[1.0, 2.0]])).sum())
        if not torch.equal(grads["probe"], torch.tensor([[1.0, 2.0]])) or linear.weight.grad is not None:
            return "forward hooks ran but gave a wrong output-gradient"
        return None
    except Exception as err:  # a report, not a crash: say what broke
        return f"{type(err).__name__}: {err}"


def _check_local_zarr() -> Optional[str]:
    """None when a zarr v3 group round-trips through a temporary directory, else why not."""
    try:
        import numpy as np
        import zarr

        with tempfile.TemporaryDirectory() as tmp:
            group = zarr.open_group(tmp, mode="w")
            group.create_array("a", shape=(2, 2), chunks=(1, 2), dtype="float16")[:] = np.ones((2, 2))
            if not (zarr.open_group(tmp, mode="r")["a"][:] == 1).all():
                return "zarr wrote data it did not read back"
        return None
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def _installed(module: str, extra: str) -> Optional[str]:
    """None when `module` imports here, else the line saying which extra brings it."""
    try:
        # find_spec("dask.array") imports the parent package, so a missing `dask` raises here.
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module imported without a spec
        found = False
    if not found:
        return f'{module.split(".")[0]} is not installed (pip install "gradian-lightning[{extra}]")'
    return None


# index.path protocols worth a line: the local ones, the usual object stores, and read-only HTTP.
PROTOCOLS = ("file", "memory", "s3", "gs", "az", "https")


def _dask() -> Optional[str]:
    """None when query.engine=dask can run here, else which package is missing."""
    return _installed("dask.array", "cluster") or _installed("distributed", "cluster")


def backends_report() -> List[Dict[str, Any]]:
    """Each backend as {name, kind, available, reason (None when available)}."""
    import torch.distributed as dist

    cuda, mps = _cuda(), _mps()
    dist_ok = dist.is_available()
    rows = [
        ("cuda", "accelerator", cuda["reason"]),
        ("mps", "accelerator", mps["reason"]),
        (
            "nccl",
            "distributed",
            None
            if dist_ok and dist.is_nccl_available()
            else (
                "torch.distributed is not built"
                if not dist_ok
                else "torch was built without NCCL (CUDA builds on Linux have it)"
            ),
        ),
        (
            "gloo",
            "distributed",
            None
            if dist_ok and dist.is_gloo_available()
            else ("torch.distributed is not built" if not dist_ok else "torch was built without Gloo"),
        ),
        ("hooks", "gradient capture", _check_hooks()),
        ("zarr (local)", "storage", _check_local_zarr()),
        # Why a protocol is missing is fsspec's own install hint ("Install s3fs to access S3").
        *((f"zarr via fsspec: {p}://", "storage", missing_filesystem(p)) for p in PROTOCOLS),
        ("dask (query.engine=dask)", "query", _dask()),
        ("matplotlib (benchmark and validate plots)", "plots", _installed("matplotlib", "bench")),
    ]
    return [{"name": n, "kind": k, "available": why is None, "reason": why} for n, k, why in rows]


def configured_seed(config: Optional[str], overrides: List[str]) -> Any:
    """grads.seed of the given config (defaults when no file); the error line when it does not load."""
    from gradian_lightning.config import load_config
    from gradian_lightning.errors import GradianError

    try:
        return load_config(config, overrides).grads.seed
    except GradianError as err:
        return f"config not loaded: {err}"


def doctor_report(config: Optional[str] = None, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    """The whole report as plain data (JSON-serialisable)."""
    return {
        "gradian": package_versions()["gradian-lightning"],
        "platform": platform.platform(),
        "versions": versions_report(),
        "devices": devices_report(),
        "determinism": determinism_report(configured_seed(config, overrides or [])),
        "backends": backends_report(),
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_markdown(report: Dict[str, Any]) -> str:
    """The report as Markdown, for a bug report."""
    out = [
        "## gradian doctor",
        "",
        f"gradian-lightning {report['gradian']} on {report['platform']}",
        "",
        "### Versions",
        "",
        "| package | installed | supported | status |",
        "|---|---|---|---|",
    ]
    out += [f"| {v['name']} | {v['installed']} | {v['supported']} | {v['status']} |" for v in report["versions"]]
    out += ["", "### Devices", ""]
    d = report["devices"]
    for kind in ("cuda", "mps"):
        if d[kind]["available"]:
            for dev in d[kind]["devices"]:
                cap = f", capability {dev['capability']}" if "capability" in dev else ""
                out.append(f"- {kind}:{dev['index']}: {dev['name']}, {_gib(dev['memory_bytes'])}{cap}")
        else:
            out.append(f"- {kind}: none ({d[kind]['reason']})")
    cpu = d["cpu"]
    out.append(
        f"- cpu: {cpu['logical_cores']} logical cores; torch uses {cpu['torch_threads']} threads ({cpu['torch_interop_threads']} inter-op)"
    )
    out += ["", "### Determinism", "", "| setting | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in report["determinism"].items()]
    out += ["", "### Backends", "", "| backend | for | available | reason |", "|---|---|---|---|"]
    out += [
        f"| {b['name']} | {b['kind']} | {'yes' if b['available'] else 'no'} | {b['reason'] or ''} |"
        for b in report["backends"]
    ]
    return "\n".join(out)
