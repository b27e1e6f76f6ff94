"""A model's weights read from a checkpoint (``files.py``'s) into the tensors
the model already has, whole or this rank's shards, so that no rank reads more than it holds:
the one way every verb turns a checkpoint into a model (``load_model``), and what a resumed
run loads (``load_model_weights``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchneox.base.errors import ConfigError
from torchneox.checkpoint.files import (
    META_FILE,
    checkpoint_config,
    load_state,
    read_meta,
    resolve,
)
from torchneox.checkpoint.tensors import FRESH_HEADS, missing_heads, refuse_non_finite
from torchneox.config.features.lora import is_base_linear
from torchneox.config.load import LoadedConfig
from torchneox.models.args import model_args
from torchneox.models.hf.folder import is_hf_folder
from torchneox.models.transformer import Transformer, is_adapter, plain_name, trains_with_lora

LORA_BASE = "lora_base"
"""meta.json's entry of a checkpoint that holds only LoRA adapters: the checkpoint (a step
directory), or the Hugging Face model folder, that holds the frozen base weights they adapt."""


def lora_base(step_dir: Path) -> Path | None:
    """The checkpoint holding the frozen base of an adapters-only checkpoint (None: it holds
    every weight); one line when it is gone."""
    meta = read_meta(step_dir) if (step_dir / META_FILE).is_file() else {}
    base = meta.get(LORA_BASE)
    if base is None:
        return None
    if not (Path(base) / META_FILE).is_file() and not is_hf_folder(base):
        raise ConfigError(
            f"holds only LoRA adapters, and the checkpoint of their base weights, {base}, is "
            "gone; put it back there",
            source=str(step_dir),
        )
    return Path(base)


def base_of_adapters(step_dir: Path, save_dir: Path | None) -> str | None:
    """What a LoRA run that loaded ``step_dir`` names as its base in the adapters-only
    checkpoints it saves: the base ``step_dir`` names, else ``step_dir`` itself unless it lies
    in the run's own save folder (which rotation may empty: then it saves every weight)."""
    base = lora_base(step_dir)
    if base is not None:
        return str(base)
    whole = step_dir.resolve()
    if save_dir is not None and whole.is_relative_to(Path(save_dir).resolve()):
        return None
    return str(whole)


def load_model_weights(step_dir: Path, model: torch.nn.Module, prefix: str = "model") -> list[str]:
    """Load the checkpoint's ``prefix`` weights into ``model`` (an adapters-only checkpoint's:
    the base's from the checkpoint it names, then its adapters); returns the fresh heads and
    LoRA adapters the checkpoint did not have (they keep their initialisation)."""
    base = lora_base(step_dir) if prefix == "model" else None
    if base is None:
        return _load_weights(step_dir, model, prefix, None)
    if is_hf_folder(base):  # a run that started from a Hugging Face folder
        from torchneox.checkpoint.hf_io import load_hf_weights

        load_hf_weights(base, model, model.args, lambda _: None)
    else:
        _load_weights(base, model, prefix, lambda k: not trains_with_lora(k))
    return _load_weights(step_dir, model, prefix, trains_with_lora)


def _load_weights(
    step_dir: Path, model: torch.nn.Module, prefix: str, which: Callable[[str], bool] | None
) -> list[str]:
    """The ``which`` weights (None: all) of ``model`` read from ``step_dir``."""
    sd = {k: v for k, v in model.state_dict().items() if which is None or which(k)}
    expected = {k: tuple(v.shape) for k, v in sd.items()}
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    fresh = []
    for key, shape in expected.items():
        entry = metadata.state_dict_metadata.get(f"{prefix}.{key}")
        if entry is None and (key in FRESH_HEADS or is_adapter(key)):
            fresh.append(key)
            continue
        if entry is None:
            raise ConfigError(f"the checkpoint has no tensor {key}", source=str(step_dir))
        if tuple(entry.size) != shape:
            raise ConfigError(
                f"tensor {key} has shape {tuple(entry.size)} in the checkpoint but {shape} in the "
                "model the config describes",
                source=str(step_dir),
            )
    wanted = {k: v for k, v in sd.items() if k not in fresh}
    load_state(step_dir, {prefix: wanted})
    model.load_state_dict(wanted, strict=not fresh and which is None)
    refuse_non_finite(wanted, step_dir)
    return fresh


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``source``'s parameters into ``target``, a model of the same shape split the same way
    (either may be wrapped for activation checkpointing or compiled)."""
    theirs = {plain_name(n): p for n, p in target.named_parameters()}
    for name, param in source.named_parameters():
        theirs[plain_name(name)].copy_(param)


def load_model(
    ckpt: str | Path,
    overrides: list[str] | None = None,
    device: str = "cpu",
    step: int | None = None,
    stored_dtype: bool = False,
) -> tuple[LoadedConfig, Transformer]:
    """The model a checkpoint holds (its step, or the latest), on ``device``, with its config
    (``overrides`` applied): the one way every verb turns a checkpoint into a model. Its
    parameters are fp32, or with ``stored_dtype`` the dtype the checkpoint keeps them in (a
    bf16 model converted from the hub is then one bf16 copy in memory, not an fp32 one)."""
    step_dir = resolve(ckpt, step)
    loaded = checkpoint_config(step_dir, overrides)
    dtype = _stored_dtype(step_dir) if stored_dtype else torch.float32
    # nothing drawn but the heads the checkpoint lacks: every other weight is read from it
    with torch.device("meta"):
        model = Transformer(model_args(loaded)).to(dtype)
    model.to_empty(device=device)
    model.init_weights(device, only=missing_heads(step_dir))
    load_model_weights(step_dir, model)
    round_stored_base(model)
    return loaded, model


@torch.no_grad()
def round_stored_base(model: Transformer) -> None:
    """A LoRA run's base stored in bf16 (lora.base_dtype) trained with its weights rounded to
    bf16: a model read back in fp32 holds those rounded values, so it computes what was
    trained (its base read from an fp32 checkpoint or folder would otherwise be the
    unrounded one)."""
    if model.args.lora_base_dtype != "bf16":
        return
    for name, param in model.named_parameters():
        if is_base_linear(name) and param.dtype != torch.bfloat16:
            param.copy_(param.bfloat16())


def _stored_dtype(step_dir: Path) -> torch.dtype:
    """The one floating dtype of the checkpoint's model tensors (fp32 when they mix)."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    dtypes = {
        getattr(entry, "properties", None) and entry.properties.dtype
        for name, entry in metadata.state_dict_metadata.items()
        if name.startswith("model.")
    }
    return dtypes.pop() if len(dtypes) == 1 and None not in dtypes else torch.float32
