"""Sharded models: FSDP2 (fully_shard under Lightning's ModelParallelStrategy) on two CPU ranks with gloo writes the
unsharded rows under the unsharded module names; FSDP1 (FSDPStrategy) is refused in one line; wrapper names map back."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from conftest import ROWS, make_model, make_tokenizer
from test_cli_processes import clean_env
from torch.utils.data import DataLoader

from gradian_lightning import GradientIndexer, open_index, select_modules
from gradian_lightning.callback import check_strategy
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.errors import ConfigError
from gradian_lightning.gradients.capture import unwrapped_name
from gradian_lightning.recipes.index import CausalLMModule

pytestmark = pytest.mark.slow  # two CPU ranks in child processes

TESTS = Path(__file__).resolve().parent
MODULES = ["down_proj", "q_proj", "lm_head"]
SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from conftest import ROWS, make_model, make_tokenizer
from gradian_lightning import GradientIndexer
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.recipes.index import CausalLMModule


class Sharded(CausalLMModule):
    def configure_model(self):  # FSDP2 as Lightning documents it: shard each decoder layer, then the root
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


tokenizer = make_tokenizer()
loader = DataLoader(JsonlDataset([dict(r) for r in ROWS], tokenizer, 64), batch_size=2, collate_fn=collate)
indexer = GradientIndexer({path!r}, {modules!r}, projection_dim=4, storage_dtype="float32")
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), callbacks=[indexer],
                    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
trainer.validate(Sharded(make_model(len(tokenizer))), dataloaders=loader, verbose=False)
weight = trainer.lightning_module.model.lm_head.weight
if trainer.is_global_zero:
    print("RESULT " + json.dumps({{"modules": list(indexer.session.gradient_rows.modules), "weight": type(weight).__name__, "shard_rows": weight.to_local().shape[0], "rows": weight.shape[0]}}))
"""


def test_fsdp2_on_two_cpu_ranks_writes_the_unsharded_rows_and_names(tmp_path):
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    loader = DataLoader(JsonlDataset([dict(r) for r in ROWS], tokenizer, 64), batch_size=2, collate_fn=collate)
    plain = GradientIndexer(tmp_path / "plain", MODULES, projection_dim=4, storage_dtype="float32")
    L.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[plain],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).validate(CausalLMModule(model), dataloaders=loader, verbose=False)
    script = tmp_path / "fsdp2.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), path=str(tmp_path / "sharded"), modules=MODULES))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])
    assert (
        result["weight"] == "DTensor" and result["shard_rows"] * 2 == result["rows"]
    )  # really sharded: half the head per rank
    assert result["modules"] == list(
        plain.session.gradient_rows.modules
    )  # module_filter names the same modules as without FSDP
    sharded, unsharded = open_index(tmp_path / "sharded"), open_index(tmp_path / "plain")
    assert sharded.meta.complete and [b.name for b in sharded.meta.blocks] == [b.name for b in unsharded.meta.blocks]
    torch.testing.assert_close(sharded.rows(slice(None)), unsharded.rows(slice(None)), rtol=1e-4, atol=1e-5)


def test_fsdp1_strategy_is_refused_in_one_line():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    with pytest.raises(
        ConfigError,
        match=r"^GradientIndexer cannot run under Lightning's FSDPStrategy \(FSDP1\).*ModelParallelStrategy with fully_shard \(FSDP2\)",
    ):
        check_strategy(FSDPStrategy())
    check_strategy(DDPStrategy())
    indexer = GradientIndexer("unused", "down_proj")
    with pytest.raises(ConfigError, match="FSDPStrategy"):
        indexer.setup(SimpleNamespace(strategy=FSDPStrategy()), None, "validate")


def test_module_names_through_wrappers_are_the_unwrapped_ones():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = make_model(40)
    plain = list(select_modules(model, MODULES))
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer)
    )  # as Lightning's strategies apply it
    wrapped = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert any("_checkpoint_wrapped_module" in name for name in wrapped)
    assert list(select_modules(model, MODULES)) == plain
    # FSDP1 inserts its own prefix (names as torch 2.13 gives them for a LlamaDecoderLayer auto-wrap policy).
    assert (
        unwrapped_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.down_proj")
        == "model.layers.0.mlp.down_proj"
    )
    assert (
        unwrapped_name("_orig_mod.model.layers.1._checkpoint_wrapped_module.mlp.down_proj")
        == "model.layers.1.mlp.down_proj"
    )
