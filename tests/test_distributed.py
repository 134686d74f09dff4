"""Two CPU ranks (gloo, ddp_fork): each rank computes its share, rank 0 writes every row in place."""

import lightning as L
import pytest
import torch
from test_callback import FineTune
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, open_index
from gradian_lightning.data import JsonlDataset, collate

pytestmark = pytest.mark.slow  # two CPU ranks in child processes


class RecordingIndexer(GradientIndexer):
    """Also notes which dataset positions each rank computed, to prove the work was shared."""

    def __init__(self, *args, notes, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes = notes

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        with open(self.notes / f"rank{trainer.global_rank}.txt", "a") as f:
            f.write("".join(f"{int(i)}\n" for i in batch["index"]))
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)


def test_two_ranks_write_the_same_index_as_one(tmp_path, model, tokenizer, rows):
    rows[0]["id"] = "café ☕"  # ids cross ranks as UTF-8 bytes, of other lengths on each rank
    dataset = JsonlDataset(rows, tokenizer, 64)  # 7 rows: the sampler pads rank 1 with a duplicate
    loader = DataLoader(dataset, batch_size=2, collate_fn=collate)
    for name, kwargs in (("one", {"devices": 1}), ("two", {"devices": 2, "strategy": "ddp_fork"})):
        (tmp_path / name / "notes").mkdir(parents=True)
        indexer = RecordingIndexer(
            tmp_path / name / "ix",
            ["down_proj", "lm_head"],
            projection_dim=4,
            storage_dtype="float32",
            notes=tmp_path / name / "notes",
        )
        trainer = L.Trainer(
            accelerator="cpu",
            callbacks=[indexer],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **kwargs,
        )
        trainer.validate(FineTune(model), dataloaders=loader, verbose=False)
    shares = [{int(i) for i in (tmp_path / "two" / "notes" / f"rank{r}.txt").read_text().split()} for r in (0, 1)]
    assert shares[0] | shares[1] == set(range(len(rows))) and shares[0] != shares[1]  # both ranks worked
    one, two = open_index(tmp_path / "one" / "ix"), open_index(tmp_path / "two" / "ix")
    assert two.meta.complete and two.column("complete").all()
    torch.testing.assert_close(two.rows(slice(None)), one.rows(slice(None)), rtol=1e-4, atol=1e-6)
    assert list(two.column("id")) == list(one.column("id"))
