"""`model.checkpoints` entries: saved models of one architecture, each one checkpoint of one index.

An entry is either
  - a Hugging Face model directory (or hub name), loaded by `from_pretrained` (hub.py), or
  - a Lightning `.ckpt` file (`Trainer.save_checkpoint`, `ModelCheckpoint`): the architecture and
    tokenizer come from `model.name_or_path`, the weights from the file's `state_dict`, whose
    LightningModule attribute prefix (`model.`, `model.model.`, any name) is found by matching
    the keys against the model's own.

Steps (the key of each checkpoint in the index) and learning rates, each as near as the file
allows to what the callbacks record: the mean rate of the segment of training since the entry
before it, up to its step (index/checkpoints.py `SegmentRate`):
  - a `.ckpt` is keyed by its `global_step`. Its learning rate (its first optimizer's first
    parameter group's, `optimizer_states[0]["param_groups"][0]["lr"]`) was saved after the
    scheduler stepped: it is the rate of the step after it. Behind a `.ckpt` that holds one, the
    segment's first step's rate is that file's: the segment's mean is interpolated linearly
    between the two (`segment_rate`; exact for one step, a constant rate and a linear schedule).
    Otherwise it is the rate of the step after it, the nearest known;
  - a Hugging Face Trainer checkpoint directory (`output_dir/checkpoint-<step>`, which holds
    `trainer_state.json`) is keyed by that file's `global_step`, with the mean of the learning rates
    the Trainer logged (`log_history`, each the rate of its step) after the entry before it and up
    to that step; where it logged none there, the last it logged before (none when it logged none);
  - any other Hugging Face directory (or hub name) has neither: it is keyed one step after the
    entry before it (0 when first), its position in a list of such directories, and has no
    learning rate.
Every entry must be keyed later than the one before it, so two checkpoints never share a step.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from gradian_lightning.errors import ConfigError
from gradian_lightning.hub import load_model_and_tokenizer

_FIX = "list in model.checkpoints a .ckpt saved from a LightningModule that holds the model.name_or_path model, or save that model with save_pretrained and list its directory"


@dataclass(frozen=True)
class SavedModel:
    """One entry of `model.checkpoints`: as listed, its step in the index, its learning rate (or None)."""

    entry: str
    step: int
    lr: Optional[float]

    @property
    def is_lightning(self) -> bool:
        return is_lightning_checkpoint(self.entry)


def is_lightning_checkpoint(entry: str) -> bool:
    """A `model.checkpoints` entry that names a Lightning checkpoint file (ends with `.ckpt`)."""
    return str(entry).endswith(".ckpt")


def saved_models(entries: Sequence[str]) -> List[SavedModel]:
    """The steps and learning rates of `model.checkpoints` entries, oldest first (module docstring).

    Reads each `.ckpt`'s step and learning rate only (memory-mapped: its tensors are not read).
    One `ConfigError` line for a missing or unreadable file, or a list not ordered by step.
    """
    out: List[SavedModel] = []
    saved_next: Optional[float] = None  # the rate a .ckpt just before holds: its next step's
    for entry in entries:
        entry = str(entry)
        keyed = None  # (global step, learning rate) where the entry records them
        after = out[-1].step if out else None
        if is_lightning_checkpoint(entry):
            ckpt = read_lightning_checkpoint(entry)
            step, own = ckpt["global_step"], _first_lr(ckpt)
            steps = step - after if after is not None and step > after else 1
            keyed, saved_next = (step, segment_rate(saved_next, own, steps)), own
        else:
            keyed, saved_next = read_trainer_state(entry, after), None
        if keyed is None:
            step, lr = (out[-1].step + 1 if out else 0), None
        else:
            step, lr = keyed
            if out and step <= out[-1].step:
                raise ConfigError(
                    f"setting 'model.checkpoints' lists {entry!r} (global step {step}) after {out[-1].entry!r} (step {out[-1].step}); list the checkpoints oldest first, each .ckpt or Trainer checkpoint-<step> directory at a later global step than the entry before it (any other Hugging Face directory counts one step after the entry before it, 0 when first)"
                )
        out.append(SavedModel(entry, step, lr))
    return out


# What the Hugging Face Trainer writes into each checkpoint-<step> directory beside the model.
TRAINER_STATE = "trainer_state.json"


def segment_rate(first: Optional[float], after: Optional[float], steps: int) -> Optional[float]:
    """The mean learning rate of a segment of `steps` optimizer steps P+1 .. S that ends at a `.ckpt`,
    from the two rates `.ckpt` files hold: `after`, this file's, the rate of step S+1 (saved after
    the scheduler stepped), and `first`, the `.ckpt` at P's, the rate of step P+1. Linear between
    steps P+1 and S+1, averaged over P+1 .. S: `first` for one step, exact for a constant rate or a
    linear schedule, between the two otherwise. Without `first`, `after`: the nearest known."""
    if first is None or after is None:
        return after
    return first + (after - first) * (steps - 1) / (2 * steps)


def read_trainer_state(entry: str, after: Optional[int] = None) -> Optional[Tuple[int, Optional[float]]]:
    """(global step, learning rate) of a Hugging Face Trainer checkpoint directory, from its
    `trainer_state.json`. The learning rate is the mean of those the Trainer logged (`log_history`,
    every `logging_steps`, each the rate of its step) after step `after` (the checkpoint before; None:
    from the start) up to this step: the segment's mean rate, as `HFGradientIndexer` records it.
    Where it logged none in that segment, the last it logged before it; None when it logged none.
    None for an entry without that file (another directory, a hub name). One `ConfigError` line for
    a file that is not a Trainer state."""
    path = os.path.join(os.path.expanduser(str(entry)), TRAINER_STATE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(entry)!r}, whose {TRAINER_STATE} cannot be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); restore the file the Trainer wrote, or delete it to key the directory by its position in the list"
        ) from None
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(entry)!r}, whose {TRAINER_STATE} holds no global_step; restore the file the Trainer wrote, or delete it to key the directory by its position in the list"
        )
    logged = [
        h
        for h in state.get("log_history") or []
        if isinstance(h, dict)
        and isinstance(h.get("learning_rate"), (int, float))
        and isinstance(h.get("step", 0), int)
        and h.get("step", 0) <= step
    ]
    segment = [float(h["learning_rate"]) for h in logged if after is None or h.get("step", 0) > after]
    if segment:
        return step, sum(segment) / len(segment)
    return step, (float(logged[-1]["learning_rate"]) if logged else None)


def load_saved_model(model_cfg: DictConfig, entry: str) -> Tuple[Any, Any]:
    """Model (eval mode) and tokenizer of one `model.checkpoints` entry.

    A Hugging Face directory or name: `from_pretrained` of it, with the other `model.*` settings.
    A `.ckpt`: `from_pretrained(model.name_or_path)`, then the file's weights loaded in place
    (tied weights, e.g. lm_head = embed_tokens, stay one tensor).
    """
    if not is_lightning_checkpoint(entry):
        return load_model_and_tokenizer(OmegaConf.merge(model_cfg, {"name_or_path": str(entry)}))
    state = read_lightning_checkpoint(entry)["state_dict"]  # read before the model loads: a bad file fails fast
    model, tokenizer = load_model_and_tokenizer(model_cfg)
    load_lightning_weights(model, state, entry)
    return model, tokenizer


def read_lightning_checkpoint(path: str) -> Dict[str, Any]:
    """The dict a Lightning `.ckpt` holds, tensors on the CPU and memory-mapped (read when used).

    `weights_only=True`: tensors, numbers, strings and containers only; a checkpoint that pickled
    other Python objects (say, in its hyper-parameters) is refused with one line.
    """
    local = os.path.expanduser(str(path))  # "~/..." in a YAML file means the home directory
    if os.path.isdir(local):  # DeepSpeed and sharded FSDP save_checkpoint write a directory named *.ckpt
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, which is a directory (a sharded DeepSpeed or FSDP checkpoint); consolidate it into one .ckpt file (Lightning's convert_zero_checkpoint_to_fp32_state_dict or consolidate_checkpoint) and list that file"
        )
    if not os.path.isfile(local):
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, which is not a file; give the path of a Lightning .ckpt (Trainer.save_checkpoint or ModelCheckpoint) or of a Hugging Face model directory"
        )
    try:
        ckpt = torch.load(local, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # pickle.UnpicklingError, RuntimeError (not a zip file), ...
        text = str(err)
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            raise ConfigError(
                f"setting 'model.checkpoints' lists {str(path)!r}, which pickles a Python object ({found.group(1)}) that gradian does not unpickle; save the LightningModule's hyper-parameters as plain values, or save the model with save_pretrained and list its directory"
            ) from None
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, which torch.load cannot read as a Lightning checkpoint ({first}); give a .ckpt saved by Trainer.save_checkpoint or ModelCheckpoint"
        ) from None
    if (
        not isinstance(ckpt, dict)
        or not isinstance(ckpt.get("state_dict"), dict)
        or not isinstance(ckpt.get("global_step"), int)
    ):
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, which holds no state_dict or no global_step; give a .ckpt saved by Trainer.save_checkpoint or ModelCheckpoint"
        )
    return ckpt


def _first_lr(ckpt: Dict[str, Any]) -> Optional[float]:
    # The first optimizer's first parameter group, the one GradientIndexer records, as saved: after
    # the scheduler's step, so the next step's rate. None saved (ModelCheckpoint(save_weights_only=True)),
    # no learning rate.
    try:
        lr = ckpt["optimizer_states"][0]["param_groups"][0]["lr"]
    except (KeyError, IndexError, TypeError):
        return None
    return float(lr)  # a tensor learning rate (capturable optimizers) becomes a number


def load_lightning_weights(model: torch.nn.Module, state: Dict[str, torch.Tensor], path: str) -> None:
    """Copy a LightningModule's `state_dict` into `model` (in place), its attribute prefix stripped.

    The prefix is the one that makes the keys under it exactly `model.state_dict()`'s (a key of
    tied weights may be absent when its twin is there). Anything else is one `ConfigError` line:
    no such prefix, two of them (two copies of the model in one LightningModule), a PEFT
    (LoRA) model, tied weights saved with different values, or a shape that differs.
    """
    ours = model.state_dict()
    if any(_is_peft(k) for k in state) and not any(_is_peft(k) for k in ours):
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, which holds a PEFT (LoRA) model; gradian reads only full weights from a .ckpt: merge the adapter (merge_and_unload()), save the model with save_pretrained and list its directory"
        )
    expected, tied = set(ours), _tied_keys(ours)
    fits: List[str] = []
    best: Optional[Tuple[int, str, List[str], List[str]]] = None
    for prefix in sorted(_candidate_prefixes(state, list(ours), tied)):
        keys = {k[len(prefix) :] for k in state if k.startswith(prefix)}
        missing = sorted(k for k in expected - keys if not (tied.get(k, set()) & keys))
        unexpected = sorted(keys - expected)
        if not missing and not unexpected:
            fits.append(prefix)
        elif best is None or len(missing) + len(unexpected) < best[0]:
            best = (len(missing) + len(unexpected), prefix, missing, unexpected)
    if len(fits) > 1:
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, which holds the model's weights under several attributes ({', '.join(repr(p) for p in fits)}); save the one to index with save_pretrained and list its directory"
        )
    if not fits:
        why = (
            "none of its state_dict keys ends with one of the model's"
            if best is None
            else (
                f"under the prefix {best[1]!r}, {len(best[2])} of the model's keys are missing{_example(best[2])} and {len(best[3])} are unexpected{_example(best[3])}"
            )
        )
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, whose weights are not those of model.name_or_path ({why}); {_FIX}"
        )
    prefix = fits[0]
    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    for group in {frozenset(g | {k}) for k, g in tied.items()}:
        saved = [weights[k] for k in sorted(group) if k in weights]
        if any(not torch.equal(saved[0], other) for other in saved[1:]):
            raise ConfigError(
                f"setting 'model.checkpoints' lists {str(path)!r}, whose tied weights {sorted(group)} differ, but the model.name_or_path model ties them; {_FIX}"
            )
    try:
        model.load_state_dict(weights, strict=False)  # in place: tied parameters stay one tensor
    except RuntimeError as err:  # "size mismatch for ...": another configuration of the architecture
        detail = next(
            (line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err).splitlines()[0]
        )
        raise ConfigError(
            f"setting 'model.checkpoints' lists {str(path)!r}, whose weights are not those of model.name_or_path ({detail.rstrip('.')}); {_FIX}"
        ) from None


def _is_peft(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key or ".base_layer." in key


def _example(keys: List[str]) -> str:
    return f" (e.g. {keys[0]!r})" if keys else ""


def _candidate_prefixes(state: Dict[str, Any], expected: List[str], tied: Dict[str, Set[str]]) -> Set[str]:
    """Every prefix p (empty or ending in '.') such that p + (an anchor key of the model) is a key of `state`.

    The prefix that fits holds every key of the model, so two anchors (the first and last untied
    keys) find it in O(len(state)); two, so that a model of another depth still gets a diagnosis.
    """
    untied = [k for k in expected if k not in tied] or sorted(expected)
    anchors = {untied[0], untied[-1]}
    found = set()
    for key in state:
        for ours in anchors:
            if key.endswith(ours) and (len(key) == len(ours) or key[-len(ours) - 1] == "."):
                found.add(key[: len(key) - len(ours)])
    return found


def _tied_keys(ours: Dict[str, torch.Tensor]) -> Dict[str, Set[str]]:
    """Key -> the other keys of the same tensor (lm_head.weight <-> model.embed_tokens.weight when tied)."""
    by_tensor: Dict[Tuple[Any, ...], Set[str]] = {}
    for key, tensor in ours.items():
        if tensor.numel() == 0:  # empty tensors may share a null pointer without being tied
            continue
        by_tensor.setdefault(
            (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)), set()
        ).add(key)
    return {k: group - {k} for group in by_tensor.values() if len(group) > 1 for k in group}
