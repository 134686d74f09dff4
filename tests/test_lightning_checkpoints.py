"""Lightning `.ckpt` files in `model.checkpoints`: keyed by global step, with the learning rate saved in them."""

import copy
import json

import lightning as L
import numpy as np
import pytest
import torch
from conftest import make_model, write_jsonl
from omegaconf import OmegaConf
from test_callback import loader

from gradian_lightning import open_index, query_gradients
from gradian_lightning.cli import main
from gradian_lightning.errors import ConfigError
from gradian_lightning.saved_models import load_saved_model, saved_models

GRADS = [
    "grads.storage_dtype=float32",
    "grads.projection_dim=4",
    "grads.module_filter=[down_proj,o_proj]",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "query.method=index",  # these tests check the stored rows' checkpoint sums
]


class Wrapped(L.LightningModule):
    """A user's module: the HF model under an attribute name of its own, next to weights of its own."""

    def __init__(self, lm):
        super().__init__()
        self.net = lm
        self.value_head = torch.nn.Linear(4, 1)  # not the HF model's: outside the prefix, not compared
        self.used = {}  # global step -> the learning rate that step trained at

    def validation_step(self, batch, batch_idx):
        return None

    def training_step(self, batch, batch_idx):
        # The rate each optimizer step trains at, keyed by the global step it makes: the independent record.
        self.used[self.trainer.global_step + 1] = float(self.optimizers().param_groups[0]["lr"])
        return self.net(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.net.parameters(), lr=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.3), "interval": "step"},
        }


class AtSave(L.Callback):
    """What the optimizer's learning rate and the HF model's weights were each time a checkpoint was saved."""

    def __init__(self):
        self.lr, self.weights = {}, {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.lr[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]
        self.weights[trainer.global_step] = copy.deepcopy(pl_module.net.state_dict())


@pytest.fixture
def fitted(tmp_path, tokenizer, rows):
    """A tied tiny Llama saved as `base`, fine-tuned 2 steps with a .ckpt after each, and saved again as `tuned`."""
    from gradian_lightning.data import JsonlDataset

    base = tmp_path / "base"
    lm = make_model(len(tokenizer), tie=True)
    lm.save_pretrained(base)
    tokenizer.save_pretrained(base)
    at_save = AtSave()
    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver, at_save],
    )
    module = Wrapped(lm.train())
    trainer.fit(module, train_dataloaders=loader(JsonlDataset(rows, tokenizer, 64), 4))
    tuned = tmp_path / "tuned"
    module.net.save_pretrained(tuned)  # the weights of step=2.ckpt, as a Hugging Face directory
    tokenizer.save_pretrained(tuned)
    return {
        "base": base,
        "tuned": tuned,
        "ckpt": {s: tmp_path / "ckpt" / f"step={s}.ckpt" for s in (1, 2)},
        "lr": at_save.lr,
        "used": module.used,
        "weights": at_save.weights,
    }


def _all_scores(top, n):
    out = torch.zeros(len(top.indices), n, dtype=torch.float64)
    out.scatter_(1, top.indices, top.scores.double())
    return out.numpy()


def _scores_at(index, step, weights, tokenizer, queries, tie):
    """[Q, N] scores of checkpoint `step` alone, its query rows made by a fresh model holding `weights`."""
    reference = make_model(len(tokenizer), tie=tie)
    reference.load_state_dict(weights)
    rows = query_gradients(index.at(step), reference, tokenizer, queries)
    return _all_scores(index.at(step).topk(rows, k=len(index)), len(index))


def _assert_scores(output, expected):
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(results) == len(expected)
    for qi, result in enumerate(results):
        assert len(result["results"]) == expected.shape[1]
        for r in result["results"]:
            assert abs(r["score"] - expected[qi, r["index"]]) < 1e-5


def test_ckpt_checkpoints_are_keyed_by_global_step_with_their_learning_rate(tmp_path, tokenizer, rows, fitted):
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    queries = write_jsonl(tmp_path / "queries.jsonl", rows[:3])
    listed = [fitted["base"], fitted["ckpt"][1], fitted["ckpt"][2]]
    common = [
        "configs/smollm2.yaml",
        f"model.name_or_path={fitted['base']}",
        f"model.checkpoints=[{','.join(map(str, listed))}]",
        f"index.path={tmp_path / 'ix'}",
        *GRADS,
    ]
    assert main(["index", *common, f"data.train={data}"]) == 0
    index = open_index(tmp_path / "ix")
    used = fitted["used"]
    assert sorted(used) == [1, 2] and fitted["lr"] == {1: used[2], 2: pytest.approx(used[2] * 0.3)}
    assert [e["step"] for e in index.checkpoints] == [0, 1, 2]
    # A .ckpt holds the rate of the step after it: all there is for step=1.ckpt, behind a directory.
    # Behind it, step=2.ckpt's segment is step 2 alone, whose rate step=1.ckpt holds.
    assert [e["lr"] for e in index.checkpoints] == [None, pytest.approx(used[2]), pytest.approx(used[2])]
    lr = {e["step"]: e["lr"] for e in index.checkpoints}

    # the .ckpt's rows are those of the same weights saved with save_pretrained
    plain = [
        "configs/smollm2.yaml",
        f"model.name_or_path={fitted['tuned']}",
        f"index.path={tmp_path / 'plain'}",
        *GRADS,
    ]
    assert main(["index", *plain, f"data.train={data}"]) == 0
    np.testing.assert_allclose(
        index.at(2).rows(slice(0, len(rows))).numpy(),
        open_index(tmp_path / "plain").rows(slice(0, len(rows))).numpy(),
        rtol=1e-6,
        atol=1e-7,
    )

    # loaded from the .ckpt: the tied head is still the embedding, with the fitted weights
    cfg = OmegaConf.create(
        {"name_or_path": str(fitted["base"]), "dtype": "float32", "revision": None, "trust_remote_code": False}
    )
    model, _ = load_saved_model(cfg, str(fitted["ckpt"][2]))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fitted["weights"][2][name]), name

    # query.checkpoints=[1, 2]: scores at each checkpoint's own weights, summed weighted by learning rate
    per = {s: _scores_at(index, s, fitted["weights"][s], tokenizer, rows[:3], tie=True) for s in (1, 2)}
    expected = (lr[1] * per[1] + lr[2] * per[2]) / (lr[1] + lr[2])
    out = tmp_path / "two.jsonl"
    assert (
        main(
            [
                "query",
                *common,
                f"query.data={queries}",
                "query.checkpoints=[1,2]",
                f"query.output={out}",
                f"query.top_k={len(rows)}",
            ]
        )
        == 0
    )
    _assert_scores(out, expected)
    # `all` takes the base directory too, which has no learning rate: equal weights
    assert (
        main(
            [
                "query",
                *common,
                f"query.data={queries}",
                "query.checkpoints=all",
                f"query.output={out}",
                f"query.top_k={len(rows)}",
            ]
        )
        == 0
    )
    base = OmegaConf.create({**cfg, "name_or_path": str(fitted["base"])})
    reference, _ = load_saved_model(base, str(fitted["base"]))
    per[0] = _all_scores(
        index.at(0).topk(query_gradients(index.at(0), reference, tokenizer, rows[:3]), k=len(rows)), len(rows)
    )
    _assert_scores(out, (per[0] + per[1] + per[2]) / 3)

    # a query whose list does not line up with the index's steps fails on the .ckpt's own step
    swapped = [fitted["base"], fitted["ckpt"][2], fitted["tuned"]]
    with pytest.raises(ConfigError, match=r"global step 2\) where the index .* holds step 1"):
        from gradian_lightning.config import load_config
        from gradian_lightning.recipes.query import run_query

        run_query(
            load_config(
                "configs/smollm2.yaml",
                [
                    *common[1:2],
                    f"model.checkpoints=[{','.join(map(str, swapped))}]",
                    f"index.path={tmp_path / 'ix'}",
                    *GRADS,
                    f"query.data={queries}",
                ],
            )
        )


def test_an_index_built_during_fit_is_queried_with_the_fits_ckpt_files(tmp_path, tokenizer, rows, saved_model):
    """GradientIndexer(checkpoints=True) indexes at each validation run, ModelCheckpoint saves a .ckpt
    right after it: a later `gradian query` makes each checkpoint's query rows from its .ckpt."""
    from transformers import AutoModelForCausalLM

    from gradian_lightning import GradientIndexer
    from gradian_lightning.config import load_config
    from gradian_lightning.data import JsonlDataset
    from gradian_lightning.recipes.query import run_query

    dataset = JsonlDataset(rows, tokenizer, 64)
    indexer = GradientIndexer(
        tmp_path / "ix", ["down_proj", "o_proj"], 4, "float32", model_attribute="net", checkpoints=True
    )
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{step}")
    at_save = AtSave()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[indexer, saver, at_save],
    )
    lm = AutoModelForCausalLM.from_pretrained(saved_model)  # as a user would: the index records this name
    trainer.fit(Wrapped(lm), train_dataloaders=loader(dataset, 4), val_dataloaders=loader(dataset))
    index = open_index(tmp_path / "ix")
    steps = [e["step"] for e in index.checkpoints]
    assert steps == sorted(at_save.weights) == [2, 4]
    ckpts = [tmp_path / "ckpt" / f"step={s}.ckpt" for s in steps]
    # GradientIndexer records each segment's mean rate (steps 1-2, 3-4); the .ckpt files are keyed by the same steps
    used = trainer.lightning_module.used
    assert [e["lr"] for e in index.checkpoints] == [
        pytest.approx((used[1] + used[2]) / 2),
        pytest.approx((used[3] + used[4]) / 2),
    ]
    assert [s.step for s in saved_models([str(c) for c in ckpts])] == steps
    queries = write_jsonl(tmp_path / "queries.jsonl", rows[:2])
    out = tmp_path / "all.jsonl"
    overrides = [
        f"model.name_or_path={saved_model}",
        f"model.checkpoints=[{','.join(map(str, ckpts))}]",
        f"index.path={tmp_path / 'ix'}",
        *GRADS,
        f"query.data={queries}",
        "query.checkpoints=all",
        f"query.output={out}",
        f"query.top_k={len(rows)}",
    ]
    run_query(load_config("configs/smollm2.yaml", overrides))
    lrs = [e["lr"] for e in index.checkpoints]
    per = [_scores_at(index, s, at_save.weights[s], tokenizer, rows[:2], tie=False) for s in steps]
    _assert_scores(out, (lrs[0] * per[0] + lrs[1] * per[1]) / sum(lrs))


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_ckpt_list_order_and_files(tmp_path, fitted):
    ckpt = fitted["ckpt"]
    got = saved_models([str(fitted["base"]), str(ckpt[2]), str(fitted["tuned"])])
    assert [(s.step, s.lr) for s in got] == [
        (0, None),
        (2, pytest.approx(fitted["lr"][2])),
        (3, None),
    ]  # a directory: one after the entry before it
    assert [s.step for s in saved_models(["a", "b", "c"])] == [
        0,
        1,
        2,
    ]  # directories only: their positions, as before .ckpt files
    with pytest.raises(ConfigError, match="oldest first") as e:
        saved_models([str(ckpt[2]), str(ckpt[1])])
    assert "model.checkpoints" in _one_line(e)
    step0 = tmp_path / "step0.ckpt"
    torch.save({"global_step": 0, "state_dict": {}}, step0)
    with pytest.raises(ConfigError, match="global step 0"):  # would share step 0 with the base directory
        saved_models([str(fitted["base"]), str(step0)])
    assert saved_models([str(step0)])[0].lr is None  # no optimizer state saved: no learning rate
    torch.save({"state_dict": {}}, tmp_path / "stepless.ckpt")
    with pytest.raises(ConfigError, match="no global_step") as e:
        saved_models([str(tmp_path / "stepless.ckpt")])
    _one_line(e)
    with pytest.raises(ConfigError, match="not a file") as e:
        saved_models([str(tmp_path / "nowhere.ckpt")])
    assert "nowhere.ckpt" in _one_line(e)
    (tmp_path / "sharded.ckpt").mkdir()
    with pytest.raises(ConfigError, match="is a directory") as e:
        saved_models([str(tmp_path / "sharded.ckpt")])
    _one_line(e)
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read") as e:
        saved_models([str(tmp_path / "text.ckpt")])
    _one_line(e)
    torch.save(
        {"global_step": 1, "state_dict": {}, "hyper_parameters": {"when": np.random.default_rng(0)}},
        tmp_path / "pickled.ckpt",
    )
    with pytest.raises(ConfigError, match="does not unpickle") as e:
        saved_models([str(tmp_path / "pickled.ckpt")])
    _one_line(e)


def test_ckpt_whose_weights_do_not_fit_the_model(tmp_path, tokenizer, fitted):
    cfg = OmegaConf.create(
        {"name_or_path": str(fitted["base"]), "dtype": "float32", "revision": None, "trust_remote_code": False}
    )
    good = fitted["weights"][2]

    def attempt(state, match):
        path = tmp_path / "bad.ckpt"
        torch.save({"global_step": 5, "state_dict": state}, path)
        with pytest.raises(ConfigError, match=match) as e:
            load_saved_model(cfg, str(path))
        assert "model.checkpoints" in _one_line(e) and "bad.ckpt" in str(e.value)

    one_layer = make_model(len(tokenizer), layers=1, tie=True).state_dict()
    attempt(
        {f"lm.{k}": v for k, v in one_layer.items()}, r"under the prefix 'lm\.', \d+ of the model's keys are missing"
    )
    attempt({f"lm.{k}": v for k, v in good.items()} | {"lm.model.extra.weight": torch.zeros(1)}, "1 are unexpected")
    attempt({"other.weight": torch.zeros(1)}, "none of its state_dict keys")
    wide = make_model(len(tokenizer), hidden=64, tie=True).state_dict()
    attempt({f"lm.{k}": v for k, v in wide.items()}, "size mismatch")
    attempt({f"a.{k}": v for k, v in good.items()} | {f"b.{k}": v for k, v in good.items()}, "several attributes")
    untied = dict(good) | {"lm_head.weight": good["lm_head.weight"] + 1}
    attempt({f"lm.{k}": v for k, v in untied.items()}, "tied weights")
    lora = {f"lm.{k}": v for k, v in good.items()} | {
        "lm.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(2, 32)
    }
    attempt(lora, "PEFT")
    # a tied twin may be left out: lm_head.weight is the embedding
    path = tmp_path / "head_left_out.ckpt"
    torch.save(
        {"global_step": 5, "state_dict": {f"m.m.{k}": v for k, v in good.items() if k != "lm_head.weight"}}, path
    )
    model, _ = load_saved_model(cfg, str(path))
    assert model.lm_head.weight is model.model.embed_tokens.weight and torch.equal(
        model.lm_head.weight, good["lm_head.weight"]
    )
