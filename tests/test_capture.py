import pytest

from gradian_lightning.gradients.capture import select_modules
from gradian_lightning.errors import ConfigError


def test_module_filter_selects_exactly(model):
    assert list(select_modules(model, ["down_proj"])) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert list(select_modules(model, ["layers.1.mlp.down_proj"])) == ["model.layers.1.mlp.down_proj"]
    assert list(select_modules(model, ["q_proj", "v_proj"])) == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj",
    ]
    assert list(select_modules(model, ["*.layers.0.mlp.*"])) == [f"model.layers.0.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    assert len(select_modules(model, ["*"])) == 2 * 7 + 1  # every Linear, lm_head included


def test_partial_component_matches_nothing_and_lists_candidates(model):
    with pytest.raises(ConfigError) as err:
        select_modules(model, ["proj"])
    message = str(err.value)
    assert "grads.module_filter" in message and "model.layers.N.mlp.down_proj" in message and "\n" not in message
