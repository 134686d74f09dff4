"""Integration: `gradian index` on the real SmolLM2-135M-Instruct (skipped when it cannot be built)."""

import numpy as np

from gradian_lightning import open_index
from gradian_lightning.cli import main

from smollm2 import ROOT, smollm2_dir


def test_index_smollm2_down_proj(tmp_path, capsys):
    model = smollm2_dir()
    argv = ["index", str(ROOT / "configs" / "smollm2.yaml"), f"model.name_or_path={model}", f"data.train={ROOT / 'tests/data/prompt_completion.jsonl'}",
            f"index.path={tmp_path / 'ix'}", "grads.module_filter=down_proj", "grads.projection_dim=16", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false"]
    assert main(argv) == 0, capsys.readouterr().err
    index = open_index(tmp_path / "ix")
    rows = index.rows(slice(None)).numpy()
    assert rows.shape == (16, 30 * 16 * 16) and index.meta["complete"]
    assert np.isfinite(rows).all() and (np.abs(rows).sum(axis=1) > 0).all()
    assert (index.column("supervised_tokens") > 0).all() and index.column("finite").all()
