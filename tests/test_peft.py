"""PEFT LoRA: the indexer finds the causal LM inside a PeftModel, `module_filter` selects the LoRA
matrices or the base layers, and the rows are the exact per-example gradients of what was selected."""

import lightning as L
import pytest
import torch
from conftest import ValidateOnly, make_model
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, open_index, query_gradients
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.gradients.loss import supervised_token_loss
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.specs import DEFAULT_MODULE_FILTER

peft = pytest.importorskip("peft")


def lora(tokenizer, targets, r=4):
    # init_lora_weights=False: B starts random, not zero, so A's gradients are not all zero.
    config = peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(make_model(len(tokenizer), hidden=32), config)


def run(tmp_path, model, dataset, module_filter, dim):
    indexer = GradientIndexer(
        tmp_path / "ix", module_filter, projection_dim=dim, storage_dtype="float32", seed=5, verbose=False
    )
    L.Trainer(
        callbacks=[indexer],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).validate(ValidateOnly(model), DataLoader(dataset, batch_size=3, collate_fn=collate), verbose=False)
    return open_index(tmp_path / "ix")


def assert_rows_close(got, want, tol=1e-5):
    """Per-row relative error ‖got - want‖ / ‖want‖ below `tol` (float32 sums in another order differ in the last bits)."""
    error = ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max().item()
    print(f"max per-row relative error {error:.2e}")
    assert got.shape == want.shape and error < tol, error
    return error


def per_example_weight_grads(model, dataset, names):
    """Exact per-example d loss / d weight of each named Linear, one example at a time: [N, sum of out×in]."""
    modules = dict(model.named_modules())
    weights = [modules[n].weight for n in names]
    flags = [w.requires_grad for w in weights]
    out = []
    try:
        for w in weights:
            w.requires_grad_(True)  # base layers are frozen; the reference needs their gradient too
        for example in dataset.examples:
            loss = supervised_token_loss(model, collate([example]))[0]
            out.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, weights)]))
    finally:
        for w, flag in zip(weights, flags):
            w.requires_grad_(flag)
    return torch.stack(out)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_lora_rows_are_the_exact_per_example_gradients_of_the_adapter(tmp_path, tokenizer, rows, targets):
    model = lora(tokenizer, targets)
    dataset = JsonlDataset(rows, tokenizer, 64)
    before = {n: (p.requires_grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    index = run(tmp_path, model, dataset, ["lora_A", "lora_B"], dim=None)
    causal_lm = model.get_base_model()
    names = [m.name for m in index.meta.blocks]
    wanted = [n for n, _ in causal_lm.named_parameters() if ".lora_" in n]
    assert names == [n.rsplit(".", 1)[0] for n in wanted]  # every adapter matrix, in model order, nothing else
    exact = per_example_weight_grads(causal_lm, dataset, names)
    assert_rows_close(index.rows(slice(None)), exact)
    # Frozen base stays frozen, the adapter's .grad and requires_grad are as they were.
    after = {n: (p.requires_grad, p.grad) for n, p in model.named_parameters()}
    assert {n: v[0] for n, v in after.items()} == {n: v[0] for n, v in before.items()}
    assert all(after[n][1] is None and before[n][1] is None for n in after)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_projected_lora_rows_match_the_projection_of_the_exact_gradients(tmp_path, tokenizer, rows):
    model = lora(tokenizer, ["q_proj", "v_proj"], r=4)
    dataset = JsonlDataset(rows, tokenizer, 64)
    index = run(tmp_path, model, dataset, ["q_proj.lora_A", "q_proj.lora_B", "v_proj.lora_B"], dim=4)
    causal_lm = model.get_base_model()
    names = [m.name for m in index.meta.blocks]
    assert (
        all(n.endswith((".q_proj.lora_A.default", ".q_proj.lora_B.default", ".v_proj.lora_B.default")) for n in names)
        and len(names) == 6
    )
    modules = select_modules(causal_lm, names)
    projector = KroneckerProjector(modules, 4, 5)
    exact = per_example_weight_grads(causal_lm, dataset, names)
    want, offset = [], 0
    for name, module in modules.items():  # P_out G P_inᵀ for each example's exact G, independently of project()
        size = module.out_features * module.in_features
        p_out, p_in = projector.matrices(name)
        g = exact[:, offset : offset + size].reshape(-1, module.out_features, module.in_features)
        want.append((p_out @ g @ p_in.T).reshape(len(g), -1))
        offset += size
    assert_rows_close(index.rows(slice(None)), torch.cat(want, dim=1))


def test_base_layers_answer_to_the_layer_name(tmp_path, tokenizer, rows):
    model = lora(tokenizer, ["q_proj", "v_proj"])
    dataset = JsonlDataset(rows, tokenizer, 64)
    index = run(tmp_path, model, dataset, ["q_proj", "down_proj"], dim=None)
    causal_lm = model.get_base_model()
    names = [m.name for m in index.meta.blocks]
    assert names == [
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj.base_layer", "mlp.down_proj")
    ]
    assert_rows_close(index.rows(slice(None)), per_example_weight_grads(causal_lm, dataset, names))
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_model_attribute_naming_the_peft_model_and_queries_through_it(tmp_path, tokenizer, rows):
    model = lora(tokenizer, ["q_proj", "v_proj"])
    dataset = JsonlDataset(rows, tokenizer, 64)
    indexer = GradientIndexer(
        tmp_path / "ix", "lora_B", projection_dim=4, storage_dtype="float32", model_attribute="model", verbose=False
    )
    L.Trainer(
        callbacks=[indexer], accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    ).validate(ValidateOnly(model), DataLoader(dataset, batch_size=4, collate_fn=collate), verbose=False)
    index = open_index(tmp_path / "ix")
    assert [m.name for m in index.meta.blocks] == [
        f"model.layers.{i}.self_attn.{p}.lora_B.default" for i in range(2) for p in ("q_proj", "v_proj")
    ]
    # A PeftModel handed to query_gradients runs like the indexed one: training rows score as their own rows.
    assert_rows_close(query_gradients(index, model, tokenizer, rows[:3]), index.rows([0, 1, 2]))


def test_inactive_adapters_are_no_candidates(tokenizer):
    model = lora(tokenizer, ["q_proj"])
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))  # added, never activated
    chosen = select_modules(model.get_base_model(), ["lora_A"])
    assert list(chosen) == [f"model.layers.{i}.self_attn.q_proj.lora_A.default" for i in range(2)]
    with pytest.raises(ConfigError, match="pattern 'lora_A.other' matches no nn.Linear or Conv1D module"):
        select_modules(model.get_base_model(), ["lora_A.other"])


def test_the_default_filter_selects_the_mlp_base_layers_not_the_adapters(tokenizer):
    """`mlp` names the block: under LoRA it selects the MLP's frozen base layers (what the layers
    are without LoRA), and the adapter matrices inside them only when a pattern names them."""
    model = lora(tokenizer, "all-linear").get_base_model()
    mlp = [f"model.layers.{i}.mlp.{m}.base_layer" for i in range(2) for m in ("gate_proj", "up_proj", "down_proj")]
    assert list(select_modules(model, list(DEFAULT_MODULE_FILTER))) == mlp
    assert list(select_modules(model, ["mlp", "mlp.down_proj.lora_B"])) == [
        f"model.layers.{i}.mlp.{m}"
        for i in range(2)
        for m in ("gate_proj.base_layer", "up_proj.base_layer", "down_proj.base_layer", "down_proj.lora_B.default")
    ]
