"""The architecture matrix: `gradian index` then `gradian query` at the default module filter on tiny
random Llama, Qwen2, Mistral, Gemma, Phi-3, Phi, GPT-NeoX and GPT-2 models saved with `save_pretrained`,
and rows against exact per-example gradients where the MLP is not Llama's (GPT-2's Conv1D above all)."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
import zarr
from conftest import ROWS, make_tokenizer, write_jsonl

from gradian_lightning import open_index
from gradian_lightning.cli import main
from gradian_lightning.data import JsonlDataset
from gradian_lightning.gradients.capture import select_modules, weight_is_transposed
from gradian_lightning.gradients.memory import human_bytes
from gradian_lightning.gradients.projection import KroneckerProjector
from gradian_lightning.gradients.recompute import recomputed_units

# hidden 32, MLP 64 wide, 2 layers: every MLP matrix has both sides >= 32, the default projection_dim.
LLAMA_LIKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
# name -> (config class, its settings, where the layers are, the MLP's capturable modules in model order)
ARCHITECTURES = {
    "llama": ("LlamaConfig", LLAMA_LIKE, "model.layers", ("gate_proj", "up_proj", "down_proj")),
    "qwen2": ("Qwen2Config", LLAMA_LIKE, "model.layers", ("gate_proj", "up_proj", "down_proj")),
    "mistral": ("MistralConfig", LLAMA_LIKE, "model.layers", ("gate_proj", "up_proj", "down_proj")),
    "gemma": ("GemmaConfig", {**LLAMA_LIKE, "head_dim": 8}, "model.layers", ("gate_proj", "up_proj", "down_proj")),
    "phi3": ("Phi3Config", LLAMA_LIKE, "model.layers", ("gate_up_proj", "down_proj")),
    "phi": ("PhiConfig", LLAMA_LIKE, "model.layers", ("fc1", "fc2")),
    "gpt_neox": ("GPTNeoXConfig", LLAMA_LIKE, "gpt_neox.layers", ("dense_h_to_4h", "dense_4h_to_h")),
    "gpt2": (
        "GPT2Config",
        dict(n_embd=32, n_inner=64, n_layer=2, n_head=4, n_positions=128),
        "transformer.h",
        ("c_fc", "c_proj"),
    ),
}


def mlp_names(arch: str) -> list:
    _, _, layers, mlp = ARCHITECTURES[arch]
    return [f"{layers}.{i}.mlp.{m}" for i in range(2) for m in mlp]


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """arch -> a local from_pretrained directory holding a random-init model and the tests' tokenizer."""
    tokenizer, out = make_tokenizer(), {}
    for arch, (config_class, settings, _, _) in ARCHITECTURES.items():
        config = getattr(transformers, config_class)(
            vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=0, **settings
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        out[arch] = tmp_path_factory.mktemp(arch)
        model.save_pretrained(out[arch])
        tokenizer.save_pretrained(out[arch])
    return out


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_index_then_query_at_the_default_filter(arch, saved_models, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    common = [
        f"model.name_or_path={saved_models[arch]}",
        f"index.path={tmp_path / 'ix'}",
        "trainer.accelerator=cpu",
        "grads.max_seq_length=64",
    ]
    assert (
        main(["index", *common, f"data.train={train}", "grads.batch_size=3", "trainer.enable_progress_bar=false"]) == 0
    )
    index = open_index(tmp_path / "ix")
    # What `gradian index` predicted before the first batch (recipes/plan.py) is what it wrote.
    group = zarr.open_group(str(tmp_path / "ix"))
    written = sum(group[name].nbytes for name in ("grads", "norms", "scales"))
    written += sum(a.nbytes for a in group["statistics"].array_values())
    assert f"-> {human_bytes(written)} predicted for" in capsys.readouterr().out.splitlines()[0]
    # The default filter names the MLP block by its role: this architecture's own MLP matrices, nothing else.
    assert [b.name for b in index.meta.blocks] == mlp_names(arch)
    assert index.meta.spec.module_filter == ("mlp",) and index.meta.complete
    rows = index.rows(slice(None))
    assert rows.shape == (len(ROWS), 32 * 32 * len(mlp_names(arch))) and rows.isfinite().all() and rows.abs().sum() > 0
    out_file = tmp_path / "results.jsonl"
    assert main(["query", *common, f"query.data={train}", f"query.top_k={len(ROWS)}", f"query.output={out_file}"]) == 0
    results = [json.loads(line) for line in out_file.read_text().splitlines()]
    # Each training row used as a query is made like its stored row: its cosine with itself is 1, the
    # top score (a random tiny model may give another row the same direction, never a higher one).
    for position, result in enumerate(results):
        own = next(hit["score"] for hit in result["results"] if hit["index"] == position)
        assert own == pytest.approx(1.0, abs=1e-3) and own >= result["results"][0]["score"] - 1e-3


def exact_weight_grads(model, examples, names):
    """Each example's d loss / d weight of the named modules, flattened as `.grad` holds them: [N, sum of sizes].

    Independent of gradian's loss and hooks: a copy of the model, one example at a time, the summed
    cross-entropy of the supervised next tokens, `loss.backward()`."""
    reference = copy.deepcopy(model).float().eval()
    modules = dict(reference.named_modules())
    out = []
    for example in examples:
        ids, labels = torch.tensor([example.input_ids]), torch.tensor(example.labels)
        reference.zero_grad(set_to_none=True)
        logits = reference(input_ids=ids).logits[0, :-1]
        F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum").backward()
        out.append(torch.cat([modules[n].weight.grad.reshape(-1) for n in names]))
    return torch.stack(out).double()


def relative_error(got, want):
    """Largest per-row ‖got - want‖ / ‖want‖."""
    return ((got.double() - want).norm(dim=1) / want.norm(dim=1)).max().item()


@pytest.mark.parametrize("arch", ["gpt2", "phi"])
def test_rows_are_the_exact_per_example_gradients(arch, saved_models, tokenizer, tmp_path):
    """projection_dim=null rows are each example's weight gradients of the default selection, laid
    out as the weights are (Conv1D: [in, out]); projected rows are their projection."""
    model = transformers.AutoModelForCausalLM.from_pretrained(saved_models[arch]).eval()
    if arch == "gpt2":
        assert recomputed_units(model, "mlp")  # so the default recompute=mlp runs, and is checked, here too
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    examples = JsonlDataset(ROWS, tokenizer, 64).examples
    modules = select_modules(model, ["mlp"])
    assert list(modules) == mlp_names(arch)
    assert all(weight_is_transposed(m) == (arch == "gpt2") for m in modules.values())
    exact = exact_weight_grads(model, examples, list(modules))
    common = [
        f"model.name_or_path={saved_models[arch]}",
        f"data.train={train}",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "grads.max_seq_length=64",
        "grads.batch_size=3",  # padded batches: rows of other lengths share each one
        "grads.storage_dtype=float32",
    ]
    assert main(["index", *common, f"index.path={tmp_path / 'exact'}", "grads.projection_dim=null"]) == 0
    index = open_index(tmp_path / "exact")
    assert [list(b.shape) for b in index.meta.blocks] == [list(modules[n].weight.shape) for n in modules]
    assert relative_error(index.rows(slice(None)), exact) < 1e-5

    k, seed = 8, 3
    assert (
        main(
            [
                "index",
                *common,
                f"index.path={tmp_path / 'projected'}",
                f"grads.projection_dim={k}",
                f"grads.seed={seed}",
            ]
        )
        == 0
    )
    projector = KroneckerProjector(modules, k, seed)
    want, offset = [], 0
    for name, module in modules.items():  # each weight gradient G, projected on both its sides
        shape = module.weight.shape
        g = exact[:, offset : offset + shape.numel()].reshape(-1, *shape)
        p_out, p_in = (p.double() for p in projector.matrices(name))
        first, second = (p_in, p_out) if weight_is_transposed(module) else (p_out, p_in)
        want.append((first @ g @ second.T).reshape(len(g), -1))
        offset += shape.numel()
    assert relative_error(open_index(tmp_path / "projected").rows(slice(None)), torch.cat(want, dim=1)) < 1e-5


def test_lora_on_gpt2_wraps_a_conv1d_and_the_default_still_selects_the_mlp(saved_models):
    """PEFT wraps GPT-2's Conv1D like a Linear: its `base_layer` is the Conv1D, captured in its own
    layout; the adapter matrices around it are not added to what the default selects."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_fc"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(saved_models["gpt2"]), config)
    chosen = select_modules(model.get_base_model(), ["mlp"])
    assert list(chosen) == [f"transformer.h.{i}.mlp.{m}" for i in range(2) for m in ("c_fc.base_layer", "c_proj")]
    assert all(weight_is_transposed(m) for m in chosen.values())
    assert KroneckerProjector(chosen, None, 0).blocks[0].shape == (32, 64)  # c_fc: [in, out]
