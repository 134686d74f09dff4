import pytest

from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.capture import select_modules


def test_module_filter_selects_exactly(model):
    assert list(select_modules(model, ["down_proj"])) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
    ]
    assert list(select_modules(model, ["layers.1.mlp.down_proj"])) == ["model.layers.1.mlp.down_proj"]
    assert list(select_modules(model, ["q_proj", "v_proj"])) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert list(select_modules(model, ["*.layers.0.mlp.*"])) == [
        f"model.layers.0.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")
    ]
    assert len(select_modules(model, ["*"])) == 2 * 7 + 1  # every Linear, lm_head included


def test_partial_component_matches_nothing_and_lists_candidates(model):
    with pytest.raises(ConfigError) as err:
        select_modules(model, ["proj"])
    message = str(err.value)
    assert "grads.module_filter" in message and "model.layers.N.mlp.down_proj" in message and "\n" not in message


def test_a_block_selects_the_linear_modules_inside_it(model):
    assert list(select_modules(model, ["mlp"])) == [
        f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("gate_proj", "up_proj", "down_proj")
    ]
    assert list(select_modules(model, ["layers.1.self_attn", "lm_head"])) == [
        *(f"model.layers.1.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
        "lm_head",
    ]
    assert list(select_modules(model, ["*.layers.0.mlp"])) == list(select_modules(model, ["layers.0.mlp"]))


def test_a_pattern_that_matches_nothing_is_an_error_even_beside_one_that_does(model):
    with pytest.raises(ConfigError) as err:
        select_modules(model, ["mlp", "dwon_proj"])
    message = str(err.value)
    assert "pattern 'dwon_proj' matches no nn.Linear or Conv1D module" in message
    assert "model.layers.N.mlp.down_proj" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"patterns \['proj', 'layer'\] match no"):
        select_modules(model, ["proj", "down_proj", "layer"])


def test_output_transform_gets_each_output_gradient_as_the_backward_reaches_it(model, tokenizer, rows):
    """With an output_transform the capture keeps no output and no full gradient: each module's
    output-gradient passes through its tap. It equals the transform of the gradient autograd takes
    with respect to the kept outputs, and a module the loss never reaches gets the transform of zeros."""
    import torch

    from gradian_lightning.data import collate, tokenize_row
    from gradian_lightning.gradients.capture import LinearCapture
    from gradian_lightning.gradients.loss import supervised_token_loss

    batch = collate([tokenize_row(tokenizer, r, i, 64) for i, r in enumerate(rows[:3])])
    modules = select_modules(model, ["down_proj", "lm_head"])
    torch.manual_seed(0)
    mixes = {name: torch.randn(m.out_features, 3) for name, m in modules.items()}
    transform = lambda name, g: g.float() @ mixes[name]  # noqa: E731
    with torch.enable_grad():
        plain = LinearCapture(modules)
        with plain:
            want = {
                n: transform(n, g) for n, g in plain.output_grads(supervised_token_loss(model, batch).sum()).items()
            }
        tapped = LinearCapture(modules, output_transform=transform)
        with tapped:
            got = tapped.output_grads(supervised_token_loss(model, batch).sum())
            assert tapped.outputs == {}  # nothing held for the backward but what the model's own ops save
        # a loss that the last layer does not reach: its down_proj gets zeros, not a missing entry
        hidden = {}
        handle = model.model.layers[0].register_forward_hook(
            lambda m, a, out: hidden.setdefault("h", out[0] if isinstance(out, tuple) else out)
        )
        with tapped:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            partial = tapped.output_grads(hidden["h"].sum())
        handle.remove()
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        assert got[name].abs().sum() > 0
    assert partial["model.layers.0.mlp.down_proj"].abs().sum() > 0
    assert (
        partial["model.layers.1.mlp.down_proj"].shape == want["model.layers.1.mlp.down_proj"].shape
        and not partial["model.layers.1.mlp.down_proj"].any()
    )
