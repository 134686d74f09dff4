import pytest

from gradian_lightning.config import load_config
from gradian_lightning.errors import ConfigError


def test_defaults_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("grads:\n  batch_size: 8\n  module_filter: [q_proj, v_proj]\n")
    cfg = load_config(path, ["grads.batch_size=2", "grads.projection_dim=null", "trainer.precision=bf16-mixed"])
    assert cfg.grads.batch_size == 2 and cfg.grads.projection_dim is None
    assert list(cfg.grads.module_filter) == ["q_proj", "v_proj"] and cfg.grads.storage_dtype == "int8"
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accelerator == "auto"


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("grads.bogus=1", r"'grads.bogus'"),
        ("grads.batch_size=many", r"'grads.batch_size'.*many"),
        ("grads.batch_size=0", r"'grads.batch_size'=0 is not allowed; use an integer >= 1"),
        (
            "grads.storage_dtype=int4",
            r"'grads.storage_dtype'='int4' is not allowed; use float32 or float16 or bfloat16 or int8",
        ),
        ("grads.projection_dim=0", r"'grads.projection_dim'=0"),
        ("query.score=l2", r"'query.score'"),
        ("model.dtype=float64", r"'model.dtype'"),
        ("grads.module_filter=[]", r"'grads.module_filter'"),
        ("batch_size", r"not key=value"),
    ],
)
def test_bad_settings_fail_in_one_line(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grads: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_the_grads_and_query_schema_is_derived_from_the_spec_fields():
    """Each spec field is one schema key with the spec's default: nothing retyped in config.py."""
    import dataclasses

    from omegaconf import OmegaConf

    from gradian_lightning.config import GradianConfig, GradsData, QueryRun
    from gradian_lightning.specs import IndexSpec, QuerySpec

    schema = OmegaConf.structured(GradianConfig)
    for section, spec, extra in (("grads", IndexSpec, GradsData), ("query", QuerySpec, QueryRun)):
        keys = [f.name for f in dataclasses.fields(extra)] + [f.name for f in dataclasses.fields(spec)]
        assert list(schema[section]) == keys
        assert spec.from_config(schema[section]) == spec()


def test_load_config_records_which_settings_were_given(tmp_path):
    from gradian_lightning.config import is_given

    path = tmp_path / "x.yaml"
    path.write_text("grads:\n  seed: 0\nquery:\n  top_k: 3\n")
    cfg = load_config(path, ["grads.projection_dim=8"])
    assert is_given(cfg, "grads.seed") and is_given(cfg, "grads.projection_dim") and is_given(cfg, "query.top_k")
    assert not is_given(cfg, "grads.storage_dtype") and not is_given(cfg, "query.score")
    assert not is_given(load_config(None, []), "grads.seed")  # the default, although equal to the file's 0
