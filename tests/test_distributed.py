"""Two CPU ranks (gloo, ddp_spawn): each rank computes its share, rank 0 writes every row in place."""

import lightning as L
import torch
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, open_index
from gradian_lightning.data import JsonlDataset, collate

from test_callback import FineTune


def test_two_ranks_write_the_same_index_as_one(tmp_path, model, tokenizer, rows):
    dataset = JsonlDataset(rows, tokenizer, 64)  # 7 rows: the sampler pads rank 1 with a duplicate
    loader = DataLoader(dataset, batch_size=2, collate_fn=collate)
    for name, kwargs in (("one", {"devices": 1}), ("two", {"devices": 2, "strategy": "ddp_spawn"})):
        indexer = GradientIndexer(tmp_path / name, ["down_proj", "lm_head"], projection_dim=4, storage_dtype="float32")
        trainer = L.Trainer(accelerator="cpu", callbacks=[indexer], logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)
        trainer.validate(FineTune(model), dataloaders=loader, verbose=False)
    one, two = open_index(tmp_path / "one"), open_index(tmp_path / "two")
    assert two.meta["complete"] and two.column("complete").all()
    torch.testing.assert_close(two.rows(slice(None)), one.rows(slice(None)), rtol=1e-4, atol=1e-6)
    assert list(two.column("id")) == list(one.column("id"))
