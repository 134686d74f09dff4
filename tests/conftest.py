"""Tiny, local, random-init models and tokenizers: no download anywhere in the suite."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from gradian_lightning.recipes.quickstart import tiny_llama

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
WORDS = (
    "the a an is was of to and in on at for with by from what who where when why how "
    "capital city country river mountain color number sky sea tree bird cat dog red blue green "
    "one two three four five six seven eight nine ten paris rome tokyo lima cairo oslo "
    "answer question tell me please say yes no it this that . , ? !"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
    "{% else %}<|assistant|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer over a small fixed vocabulary, with BOS/EOS/PAD and a chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(
    vocab_size: int, hidden: int = 32, layers: int = 2, seed: int = 0, tie: bool = False
) -> LlamaForCausalLM:
    """A random-init Llama small enough to run per-example loops in a test."""
    return tiny_llama(vocab_size, hidden, layers, seed, max_positions=128, tie=tie).eval()


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture
def model(tokenizer) -> LlamaForCausalLM:
    return make_model(len(tokenizer))


ROWS = [
    {"id": "paris", "prompt": "what is the capital of the country ?", "completion": " paris is the capital ."},
    {"id": "sky", "prompt": "what color is the sky ?", "completion": " blue"},
    {"id": "count", "prompt": "tell me a number .", "completion": " one two three four five six seven eight nine ten"},
    {
        "id": "chat",
        "messages": [
            {"role": "user", "content": "who is it ?"},
            {"role": "assistant", "content": "a cat"},
            {"role": "user", "content": "what color ?"},
            {"role": "assistant", "content": "red and green"},
        ],
    },
    {"text": "the river in the city is blue and the tree is green ."},
    {"id": "rome", "prompt": "what city ?", "completion": " rome"},
    {"id": "dog", "prompt": "tell me what the dog is .", "completion": " the dog is red , the cat is blue ."},
]


@pytest.fixture
def rows() -> list:
    return [dict(r) for r in ROWS]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RENAMED = {"prompt": "question", "completion": "answer", "messages": "turns", "text": "body", "id": "key"}
MAPPED = tuple(f"data.{part}_field={column}" for part, column in RENAMED.items())  # read RENAMED's columns back


def write_renamed_parquet(path: Path, rows: list) -> Path:
    """`rows` as a parquet file whose columns are named otherwise (RENAMED; the settings MAPPED map them back)."""
    import datasets

    columns = sorted({k for r in rows for k in r})  # every row every column: a missing one is null
    datasets.Dataset.from_list([{RENAMED[k]: r.get(k) for k in columns} for r in rows]).to_parquet(str(path))
    return path


@pytest.fixture
def saved_model(tmp_path_factory, tokenizer) -> Path:
    """A tiny Llama and its tokenizer saved as a local from_pretrained directory."""
    out = tmp_path_factory.mktemp("tiny-llama")
    make_model(len(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class ValidateOnly(L.LightningModule):
    """Holds a model; its validation step does nothing, so a GradientIndexer's work is the only work."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def validation_step(self, batch, batch_idx):
        return None


def saved_activation_bytes(model, ids, autocast=None, recompute="none") -> int:
    """All bytes indexing one batch keeps for backward at once (weights themselves excepted).

    The real path, `GradientRows` without recomputation, from the first layer's modules on
    (the graph plan bounds), with one supervised token so that the loss's share is the same at
    every length; each saved tensor is attributed to the decoder layer that saved it, or to none.
    With `recompute` "none" that is everything saved. With "layers" (recompute.py) each layer's own
    tensors are alive one layer at a time: what is kept is what no layer saved, the largest layer's
    share, and every layer's input (the tensors the recomputation starts from). With "mlp" the same
    for each layer's MLP block: all but the blocks' shares, the largest block's, and the blocks' inputs.
    """
    from gradian_lightning.gradients.batch import GradientRows
    from gradian_lightning.gradients.capture import select_modules
    from gradian_lightning.gradients.recompute import recomputed_units
    from gradian_lightning.specs import IndexSpec

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}  # storage -> (layer or None, bytes); the first layer to save a storage owns it
    inputs = {}  # storage -> bytes of each layer's input hidden states
    current = [None]

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved.setdefault(t.untyped_storage().data_ptr(), (current[0], t.untyped_storage().nbytes()))
        return t

    def enter(i):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            inputs[hidden.untyped_storage().data_ptr()] = hidden.untyped_storage().nbytes()
            current[0] = i

        return hook

    def leave(module, args, output):
        current[0] = None

    labels = torch.full_like(ids, -100)
    labels[0, -1] = ids[0, -1]
    modules = select_modules(model, ["*.layers.*"])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    mixed = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    layers = recomputed_units(model, "mlp" if recompute == "mlp" else "layers")
    hooks = [layer.register_forward_pre_hook(enter(i), with_kwargs=True) for i, layer in enumerate(layers)] + [
        layer.register_forward_hook(leave) for layer in layers
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
            GradientRows(model, IndexSpec(projection_dim=4, seed=0, recompute="none"), modules)(batch, mixed)
    finally:
        for hook in hooks:
            hook.remove()
    if recompute == "none":
        return sum(size for _, size in saved.values())
    outside = sum(size for layer, size in saved.values() if layer is None)
    largest = max(sum(size for layer, size in saved.values() if layer == i) for i in range(len(layers)))
    return outside + largest + sum(inputs.values())


def tiny_settings(model, train, path, *extra):
    """`load_config` of a quick CPU index run of `model` on `train` into `path` (k = 4, 24 tokens), plus `extra` overrides."""
    from gradian_lightning.config import load_config

    return load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"data.train={train}",
            f"index.path={path}",
            "grads.max_seq_length=24",
            "grads.projection_dim=4",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=false",
            *extra,
        ],
    )
