"""benchmarks/gpu_check.py: its arithmetic against independent computations, its refusal without a GPU,
and its `--smoke` run end to end on the CPU (every part that needs no CUDA), so that the script
is ready to run the day a GPU is."""

import json
import sys

import numpy as np
import pytest
import torch
from test_benchmarks_smoke import run_smoke

from benchmarks import gpu_check
from gradian_lightning.gradients.projection import ModuleBlock


def test_without_a_gpu_the_full_run_stops_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--model", str(tmp_path), "--out", str(tmp_path)])
    message = str(stop.value.code)
    assert message.startswith("gpu_check: error: no CUDA device") and "--smoke" in message
    assert "\n" not in message and not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_a_model_that_cannot_be_found_stops_the_full_run_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)  # past the GPU check, to the model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out")])
    message = str(stop.value.code)
    assert message.startswith("gpu_check: error: --model ") and "make-smollm2.sh" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_relative_differences_per_block_and_row_against_numpy():
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(5, 12, generator=generator)
    rows = reference + 0.01 * torch.randn(5, 12, generator=generator)
    rows[2, 4:10] = reference[2, 4:10] * 1.5  # one row of one block far off
    blocks = [ModuleBlock("a", 1, 4, (1, 4), 0), ModuleBlock("b", 1, 8, (1, 8), 4)]
    got = gpu_check.relative_differences(rows, reference, blocks)
    r, x = rows.numpy().astype(np.float64), reference.numpy().astype(np.float64)
    for block, seen in zip(blocks, got["blocks"]):
        part = slice(block.offset, block.offset + block.size)
        rel = np.linalg.norm(r[:, part] - x[:, part], axis=1) / np.linalg.norm(x[:, part], axis=1)
        assert seen["name"] == block.name
        assert seen["median"] == pytest.approx(np.median(rel), rel=1e-5)
        assert seen["max"] == pytest.approx(rel.max(), rel=1e-5)
    whole = np.linalg.norm(r - x, axis=1) / np.linalg.norm(x, axis=1)
    assert got["row_median"] == pytest.approx(np.median(whole), rel=1e-5)
    assert got["row_max"] == pytest.approx(whole.max(), rel=1e-5)
    assert got["blocks"][1]["max"] > 0.4  # the planted difference is the block's worst


def _results(*rankings):
    return [{"results": [{"index": i} for i in ranking]} for ranking in rankings]


def test_ranking_agreement_counts_shared_rows_and_first_places():
    reference = _results(range(10), range(10, 20))
    mine = _results([0, 1, 2, 3, 4, 5, 6, 7, 8, 99], [11, 10, 12, 13, 14, 15, 16, 17, 18, 19])
    got = gpu_check.ranking_agreement(mine, reference)
    assert got == {"top10_overlap_mean": pytest.approx(0.95), "top10_overlap_min": 0.9, "same_top1": 0.5}


def test_long_rows_repeat_the_completions_they_are_made_of():
    facts = [{"prompt": f"p{i}?", "completion": f" c{i}."} for i in range(3)]
    rows = gpu_check.long_rows(facts, 4, 2)
    assert [r["completion"] for r in rows] == [" c0. c1.", " c1. c2.", " c2. c0.", " c0. c1."]
    assert [r["prompt"] for r in rows] == ["p0?", "p1?", "p2?", "p0?"] and len({r["id"] for r in rows}) == 4


def test_a_failed_section_is_recorded_and_the_others_still_written(monkeypatch, tmp_path):
    """A section that raises is named in the files and the exit line; the next section still runs."""

    def broken(run):
        raise RuntimeError("planted failure\nsecond line")

    monkeypatch.setitem(gpu_check.CHECKS, "rows", broken)
    argv = ["--smoke", "--only", "rows,plan", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [str(gpu_check.ROOT / "benchmarks" / "gpu_check.py"), *argv])
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(argv)
    assert str(stop.value.code).startswith("gpu_check: error: section(s) rows failed")
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["rows"]["error"] == "RuntimeError: planted failure" and "ddp" not in sections
    assert len(sections["plan"]["points"]) == 6  # measured after the failure
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "rows: FAILED: RuntimeError: planted failure" in markdown and "ddp: not run (--only)." in markdown
    assert "`gradian plan` against the measured peak" in markdown and "Rows and rankings" not in markdown


@pytest.mark.slow  # the script in a child process, DDP on two CPU processes included
def test_smoke_runs_every_part_that_needs_no_cuda(tmp_path):
    done = run_smoke("gpu_check", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    # rows: bf16 against fp32 on the tiny Llama, as tests/test_precision.py bounds them; same rankings.
    for run in sections["rows"]["runs"][1:]:
        assert run["precision"] in ("bf16-mixed", "bf16-true")
        assert 0 < run["row_max"] < 0.03 and len(run["blocks"]) == 6  # 2 layers × 3 MLP modules
        assert run["top10_overlap_min"] >= 0.8
    plan = sections["plan"]["points"]
    assert len(plan) == 6 and all(p["skipped"].startswith("torch.cuda.max_memory_allocated") for p in plan)
    assert all(p["predicted_bytes"] <= p["predicted_worst_case_bytes"] for p in plan)
    assert all(p["ratio"] > 0 for p in sections["speed"]["points"])
    assert sections["ddp"]["devices"] == 2 and sections["ddp"]["row_max"] < 1e-5
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("Command: `PYTHONPATH=. python -m benchmarks.gpu_check --smoke")
    assert "Device: no CUDA device (smoke run on the CPU); torch " in markdown and "CUDA None" in markdown
    assert "| cpu | bf16-mixed |" in markdown and "| 32-true | 2 |" in markdown
