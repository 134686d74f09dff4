"""Mixed precision: Lightning's bf16-mixed and bf16-true with the indexer (rows against fp32 rows,
the loss still fp32 only at the gathered positions), and `gradian plan` under `trainer.precision`."""

import contextlib
import json

import lightning as L
import pytest
import torch
from conftest import ROWS, ValidateOnly, make_model, saved_activation_bytes, write_jsonl
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, open_index
from gradian_lightning.config import load_config
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.loss import LSE_ROWS, supervised_targets
from gradian_lightning.recipes.plan import make_plan

# Measured on this suite's tiny Llama (hidden 64, random init): the largest per-row relative error
# ‖row - fp32 row‖ / ‖fp32 row‖ was 0.0086 under bf16-mixed and 0.0093 under bf16-true (bf16 keeps
# 8 bits of mantissa: 2^-8 = 0.004 per rounding). The bound leaves room for other seeds and shapes.
ROW_TOLERANCE = 0.03


class Tensors(TorchDispatchMode):
    """Records (dtype, shape) of every tensor an op returns: what was really allocated, in which dtype."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append((t.dtype, tuple(t.shape)))
        return out


def index_rows(tmp_path, tokenizer, dataset, precision, record=None):
    model = make_model(len(tokenizer), hidden=64)
    indexer = GradientIndexer(
        tmp_path / precision, ["down_proj", "q_proj"], projection_dim=8, storage_dtype="float32", verbose=False
    )
    trainer = L.Trainer(
        callbacks=[indexer],
        accelerator="cpu",
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with record or contextlib.nullcontext():
        trainer.validate(ValidateOnly(model), DataLoader(dataset, batch_size=4, collate_fn=collate), verbose=False)
    return open_index(tmp_path / precision)


@pytest.mark.parametrize("precision, weights", [("bf16-mixed", "float32"), ("bf16-true", "bfloat16")])
def test_bf16_rows_are_finite_and_close_to_fp32_rows_and_the_loss_is_fp32_at_gathered_positions(
    tmp_path, tokenizer, precision, weights
):
    dataset = JsonlDataset(ROWS, tokenizer, 64)
    full = index_rows(tmp_path, tokenizer, dataset, "32-true")
    record = Tensors()
    low = index_rows(tmp_path, tokenizer, dataset, precision, record)
    assert low.meta.model["dtype"] == weights and low.meta.complete and low.column("finite").all()
    got, want = low.rows(slice(None)), full.rows(slice(None))
    assert torch.isfinite(got).all()
    error = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
    print(f"{precision}: largest per-row relative error against fp32 rows {error:.4f}")
    assert error < ROW_TOLERANCE
    assert abs(low.column("loss") - full.column("loss")).max() < 0.05 * abs(full.column("loss")).max()

    # Gather, then upcast: the logits come out of the head in bf16 at the supervised positions of a
    # batch only, and the one fp32 tensor as wide as the vocabulary has exactly those rows.
    vocab = len(tokenizer)
    per_batch = [
        int(supervised_targets(collate(dataset.examples[i : i + 4])["labels"]).sum()) for i in range(0, len(dataset), 4)
    ]
    wide = [(dtype, shape) for dtype, shape in record.made if shape and shape[-1] == vocab and len(shape) == 2]
    # ... besides the log-sum-exp's blocks of at most LSE_ROWS rows, bounded whatever the batch
    fp32_rows = {shape[0] for dtype, shape in wide if dtype == torch.float32}
    assert set(per_batch) <= fp32_rows and all(n in per_batch or n <= LSE_ROWS for n in fp32_rows)
    assert {shape[0] for dtype, shape in wide if dtype == torch.bfloat16} >= set(per_batch)
    assert not [
        s for d, s in record.made if d == torch.float32 and len(s) == 3 and s[-1] == vocab
    ]  # never B × T × vocab in fp32


@pytest.fixture
def wide_model(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("wide-llama")
    make_model(4096, hidden=64, layers=3).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def plan_for(tmp_path, model_dir, *more):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return make_plan(
        load_config(
            "configs/smollm2.yaml",
            [f"model.name_or_path={model_dir}", f"data.train={data}", "trainer.accelerator=cpu", *more],
        ),
        10**9,
    )


def test_plan_takes_trainer_precision_into_account(tmp_path, wide_model, tokenizer):
    # grads.recompute=none: the real forwards below keep every activation
    fp32, mixed, true = (
        plan_for(tmp_path, wide_model, "grads.recompute=none", *more)
        for more in ([], ["trainer.precision=bf16-mixed"], ["trainer.precision=bf16-true"])
    )
    model = make_model(4096, hidden=64, layers=3)
    numel = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert fp32["weights_bytes"] == numel * 4 and true["weights_bytes"] == numel * 2
    assert mixed["weights_bytes"] == numel * 4 + linear * 2  # fp32 weights + autocast's bf16 copies
    assert true["precision"] == {"trainer.precision": "bf16-true", "weights_dtype": "bfloat16", "autocast_dtype": None}
    assert mixed["precision"]["autocast_dtype"] == "bfloat16"
    # the fp32 logits alone for an fp32 head; a bf16 head's own output (and its gradient) adds half
    assert (fp32["logit_peak_copies"], mixed["logit_peak_copies"], true["logit_peak_copies"]) == (1.0, 1.5, 1.5)

    # Against real forwards of 2 rows × 20 and × 40 tokens: what they keep is a fixed part (under
    # autocast, its bf16 weight copies) plus a part that grows with the tokens.
    short, long = torch.randint(3, len(tokenizer), (2, 20)), torch.randint(3, len(tokenizer), (2, 40))
    small, large = (
        saved_activation_bytes(model, short, torch.bfloat16),
        saved_activation_bytes(model, long, torch.bfloat16),
    )
    # Plan's per-token figure is an upper bound (its graph starts at the embeddings); measured 0.94 of it.
    assert 0.85 * mixed["activation_bytes_per_token"] <= (large - small) / 40 <= mixed["activation_bytes_per_token"]
    assert 2 * small - large == pytest.approx(linear * 2, rel=0.01)  # the fixed part: the weight copies plan adds
    model = model.to(torch.bfloat16)
    per_token = (saved_activation_bytes(model, long) - saved_activation_bytes(model, short)) / 40
    assert 0.85 * true["activation_bytes_per_token"] <= per_token <= true["activation_bytes_per_token"]
    # Not half: RMSNorm upcasts to fp32 inside, and with no Linear input kept those fp32 tensors are
    # a larger share of what remains (measured 0.60 of fp32).
    assert true["activation_bytes_per_token"] < 0.7 * fp32["activation_bytes_per_token"]
    for key in ("worst_case", "typical"):
        assert true["peak_bytes"][key] < mixed["peak_bytes"][key] and true["peak_bytes"][key] < fp32["peak_bytes"][key]


def test_plan_refuses_a_precision_it_cannot_predict(tmp_path, wide_model):
    with pytest.raises(
        ConfigError, match="setting 'trainer.precision'='transformer-engine' is not one gradian plan can predict"
    ):
        plan_for(tmp_path, wide_model, "trainer.precision=transformer-engine")


def test_an_index_made_in_bf16_true_is_queried_with_the_same_trainer_precision(tmp_path, saved_model, capsys):
    """bf16-true casts the weights: the query's model must be cast as the index's was before the
    index's dtype is checked, or every bf16-true index is refused as 'model dtype float32 here'."""
    from gradian_lightning.cli import main

    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [
        f"model.name_or_path={saved_model}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "trainer.precision=bf16-true",
        "grads.projection_dim=4",
        "grads.module_filter=[down_proj]",
    ]
    assert main(["index", *common, f"data.train={train}", "trainer.enable_progress_bar=false"]) == 0
    assert open_index(tmp_path / "ix").meta.model["dtype"] == "bfloat16"
    out = tmp_path / "results.jsonl"
    assert main(["query", *common, f"query.data={train}", "query.top_k=1", f"query.output={out}"]) == 0, (
        capsys.readouterr()
    )
    # Training rows used as queries find themselves first (bf16 may swap a near tie).
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(r["results"][0]["index"] == i for i, r in enumerate(results)) >= 0.8 * len(ROWS)
