"""Hugging Face loading: `from_pretrained` of model, tokenizer and config, the pad token, file hashes.

Every path that loads a model goes through here, so a name that cannot be loaded is one
`ConfigError` line that names `model.name_or_path`, whichever command met it. torch and
transformers are imported by the functions that use them: `check_model_source` runs before either.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from omegaconf import DictConfig

from gradian_lightning.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

# What a message suggests where a model is wanted: a small instruct model on the Hugging Face hub.
EXAMPLE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _from_pretrained(load: Any, name: str, **kwargs: Any) -> Any:
    """`load(name, **kwargs)` (a transformers `from_pretrained`), its failure as one `ConfigError` line."""
    try:
        return load(name, **kwargs)
    except Exception as err:  # OSError, ValueError, ...: transformers' messages are long; keep the gist
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "trust_remote_code" in str(err):
            raise ConfigError(
                f"model {name!r} ships its own code; if you trust it, pass model.trust_remote_code=true"
            ) from None
        raise ConfigError(
            f"setting 'model.name_or_path'={name!r} could not be loaded ({first}); give a local model directory or a Hugging Face name that is cached or reachable"
        ) from None


# Any one of these is a tokenizer that from_pretrained can load from a local folder.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer_config.json",
)


def check_tokenizer_files(name: str) -> None:
    """`ConfigError` when a local model folder holds no tokenizer: transformers would fail with a
    message that names no file, or fall back to a tokenizer that supervises nothing."""
    folder = Path(name)
    if (
        folder.is_dir()
        and (folder / "config.json").is_file()
        and not any((folder / f).is_file() for f in TOKENIZER_FILES)
    ):
        raise ConfigError(
            f"setting 'model.name_or_path'={name!r} is a model folder without tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); save the tokenizer beside the model (tokenizer.save_pretrained(folder))"
        )


def check_model_source(name: str, key: str = "model.name_or_path") -> None:
    """`ConfigError` when `name` (setting `key`) can be no model, checked on the disk alone (no torch,
    no transformers, no network): a file (a model is a folder), or a path that no folder is at and
    that no Hugging Face name looks like (transformers would say "Repo id must be in the form ...").
    A name that could be on the hub (`gpt2`, `org/name`) is left to `from_pretrained`."""
    path = Path(os.path.expanduser(name))
    if path.is_file():
        raise ConfigError(
            f"setting '{key}'={name!r} is a file, not a model folder; a data file goes in data.train (or query.data), and {key} names the folder a model was saved to (save_pretrained) or a Hugging Face name such as {EXAMPLE_MODEL}"
        )
    # A hub name is `name` or `org/name`: anything absolute, relative to . or ~, or deeper is a path.
    path_like = name.startswith((".", "~", "/", os.sep)) or sum(name.count(sep) for sep in {"/", os.sep}) > 1
    if path_like and not path.exists():
        raise ConfigError(
            f"setting '{key}'={name!r}: no such folder ({path.absolute()}); give the folder a model was saved to (save_pretrained) or a Hugging Face name such as {EXAMPLE_MODEL}"
        )


def _pretrained_args(model_cfg: DictConfig) -> Tuple[str, Dict[str, Any]]:
    check_model_source(model_cfg.name_or_path)
    name = os.path.expanduser(model_cfg.name_or_path)  # "~/..." in a YAML file means the home directory
    return name, {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code}


def load_model_and_tokenizer(model_cfg: DictConfig) -> Tuple[Any, Any]:
    """`from_pretrained` model (causal LM, eval mode) and fast tokenizer from a `model.*` config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, kwargs = _pretrained_args(model_cfg)
    check_tokenizer_files(name)
    dtype = model_cfg.dtype if model_cfg.dtype == "auto" else getattr(torch, model_cfg.dtype)
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name, use_fast=True, **kwargs)
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained, name, dtype=dtype, **kwargs)
    return model.eval(), tokenizer


def load_tokenizer_and_config(model_cfg: DictConfig) -> Tuple[Any, Any]:
    """The fast tokenizer and the `PretrainedConfig` of a `model.*` config, without loading weights."""
    from transformers import AutoConfig, AutoTokenizer

    name, kwargs = _pretrained_args(model_cfg)
    check_tokenizer_files(name)
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name, use_fast=True, **kwargs)
    return tokenizer, _from_pretrained(AutoConfig.from_pretrained, name, **kwargs)


def pad_token_id(tokenizer: Any) -> int:
    """The id `collate` pads with: the tokenizer's pad token, else its EOS token, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def meta_model(config: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM of `config` with every tensor on the meta device: shapes, no memory, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def normalized_name(name: Optional[str]) -> Optional[str]:
    """A model name or data path as stored and compared: a local path made absolute and resolved
    (`./data/x` and `data/x`, or another working folder, are then one path); a hub name unchanged."""
    if not name:
        return name
    path = Path(os.path.expanduser(str(name)))
    return str(path.resolve()) if path.exists() else str(name)


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_causal_lm(pl_module: nn.Module, attribute: Optional[str] = None) -> nn.Module:
    """The Hugging Face model in a LightningModule (any nn.Module): `attribute` (dotted) or the
    top-most PreTrainedModel. A `peft.PeftModel` at `attribute` is returned as it is: whoever runs
    it takes its base model (gradients/peft.py `unwrap_peft`)."""
    from transformers import PreTrainedModel

    if not attribute:
        found = next((m for _, m in pl_module.named_modules() if isinstance(m, PreTrainedModel)), None)
        if found is None:
            raise ConfigError(
                f"GradientIndexer found no transformers PreTrainedModel inside {type(pl_module).__name__}; pass model_attribute='name_of_the_model_attribute'"
            )
        return found
    model = pl_module
    for part in attribute.split("."):
        model = getattr(model, part, None)
        if model is None:
            raise ConfigError(
                f"GradientIndexer(model_attribute={attribute!r}): {type(pl_module).__name__} has no attribute {part!r}"
            )
    return model


def describe_model(model: nn.Module, name_or_path: Optional[str] = None) -> Dict[str, Any]:
    """What an index records of the model its rows were made with, and what a query's model is
    compared against: class, resolved name (`name_or_path` when the model's config has none),
    vocabulary size, parameter dtype, and the output head's [out, in] where it is an nn.Linear
    (what query.method=auto counts of the exact pass's head, query/exact_scoring.py)."""
    config = getattr(model, "config", None)
    head = output_head(model)
    return {
        "class": type(model).__name__,
        "name_or_path": normalized_name(getattr(config, "_name_or_path", None) or name_or_path),
        "vocab_size": getattr(config, "vocab_size", None),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "head_features": [head[1].out_features, head[1].in_features] if head is not None else None,
    }


def output_head(model: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """(name, module) of the model's output head (`get_output_embeddings()`) where it is an
    nn.Linear, else None."""
    from torch import nn  # here: a model exists, so torch is imported already

    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        return None
    return next(((name, m) for name, m in model.named_modules() if m is head), None)
