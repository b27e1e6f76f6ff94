"""``load`` naming a Hugging Face model folder: the folder recognised, and the model keys its
config.json gives (the derivation ``convert from-hf`` makes, ``models/hf/architectures.py``) merged into
the run's config, a key the user's files set agreeing or refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError, HFError
from torchneox.config.load import LoadedConfig, convert
from torchneox.config.validate import validate

# models/hf/architectures.py (and torch) are imported where used: is_hf_folder is read before any torch
# import (train --nproc's launcher, fine_tuning)

USER_CHOICES = ("seq_length", "make_vocab_size_divisible_by")
"""Keys the folder gives that the user's files may set otherwise: the length trained at (up to
the model's max_position_embeddings), and a padding rule that the folder's padded_vocab_size
makes moot."""
TOKENIZER_KEYS = ("tokenizer_type", "vocab_file", "merge_file")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def is_hf_folder(path: str | Path | None) -> bool:
    """A folder with a config.json or Hugging Face weight files, and no torchneox checkpoint
    (no ``latest``, ``meta.json`` or ``global_stepN``)."""
    if not path:
        return False
    folder = Path(path)
    if not folder.is_dir() or (folder / "latest").is_file() or (folder / "meta.json").is_file():
        return False
    if any(p.name.removeprefix("global_step").isdigit() for p in folder.glob("global_step*")):
        return False
    weights = any((folder / n).is_file() for n in WEIGHT_FILES)
    return weights or (folder / "config.json").is_file() or any(folder.glob("pytorch_model*.bin"))


def tokenizer_keys(folder: Path) -> dict[str, str]:
    """The tokenizer keys naming the folder's own tokenizer files (as ``convert from-hf``
    names its copies of them)."""
    if (folder / "tokenizer.json").is_file():
        return {"tokenizer_type": "HFTokenizer", "vocab_file": str(folder / "tokenizer.json")}
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": str(folder / "vocab.json"),
            "merge_file": str(folder / "merges.txt"),
        }
    return {}


def model_keys(folder: Path) -> dict[str, Any]:
    """The GPT-NeoX keys of the folder's model, as ``convert from-hf`` derives them (a head
    stored beside tied embeddings that differs from them unties the model, as there)."""
    from torchneox.models.hf import architectures as hf

    hf_cfg = hf.read_config(folder)
    try:
        keys = hf.neox_config_from_hf(hf_cfg)
    except HFError as e:
        if e.source is not None:
            raise
        raise HFError(e.message, source=str(folder / "config.json"), key=e.key) from None
    if not keys.get("no_weight_tying", True) and _stored_head_differs(folder, hf_cfg):
        keys["no_weight_tying"] = True
    return keys


def _stored_head_differs(folder: Path, hf_cfg: dict[str, Any]) -> bool:
    """Whether a tied folder stores an output head unlike its embedding (two tensors read)."""
    import torch

    from torchneox.models.hf import architectures as hf

    arch = hf.causal_family(hf.architecture_of(hf_cfg))
    embed_name = "gpt_neox.embed_in.weight" if arch == "GPTNeoXForCausalLM" else None
    embed_name = embed_name or "model.embed_tokens.weight"
    found: dict[str, Any] = {}
    for path in hf.weight_files(folder):
        for name, tensor in _named_tensors(
            path, (embed_name, "lm_head.weight", "embed_out.weight")
        ):
            found["embed" if name == embed_name else "head"] = tensor
    head, embed = found.get("head"), found.get("embed")
    if head is None or embed is None:
        return False
    return head.shape != embed.shape or not torch.equal(head, embed)


def _named_tensors(path: Path, names: tuple[str, ...]):
    """The tensors of ``names`` that ``path`` holds, read alone where the format allows."""
    from torchneox.models.hf import architectures as hf

    if path.suffix != ".safetensors" or not path.is_file():
        yield from ((n, t) for n, t in hf.iter_tensors(path) if n in names)
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name in set(f.keys()) & set(names):
            yield name, f.get_tensor(name)


def with_hf_folder(loaded: LoadedConfig) -> LoadedConfig:
    """``loaded`` with the model keys of the Hugging Face folder its ``load`` names (its
    tokenizer too where the files name none); unchanged when ``load`` is no such folder."""
    load = loaded.config.checkpoint.load
    if not is_hf_folder(load):
        return loaded
    folder = Path(load)
    source = str(folder / "config.json")
    try:
        return _with_model_keys(loaded, folder, source)
    except ConfigError as e:
        if e.source != source or e.key not in HF_KEY_OF:
            raise
        raise ConfigError(
            f"{HF_KEY_OF[e.key]} (torchneox's {e.key}): {e.message}", source=source
        ) from None


HF_KEY_OF = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "seq_length": "max_position_embeddings",
    "max_position_embeddings": "max_position_embeddings",
    "padded_vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
    "rotary_emb_base": "rope_theta",
    "rotary_pct": "partial_rotary_factor",
    "rms_norm_epsilon": "rms_norm_eps",
    "layernorm_epsilon": "layer_norm_eps",
    "attention_dropout": "attention_dropout",
    "hidden_dropout": "hidden_dropout",
    "sliding_window_width": "sliding_window",
    "moe_num_experts": "num_local_experts",
    "moe_top_k": "num_experts_per_tok",
}
"""config.json's name of each model key read from it, for an error naming what the file says."""


def _with_model_keys(loaded: LoadedConfig, folder: Path, source: str) -> LoadedConfig:
    config, origin = copy.deepcopy(loaded.config), dict(loaded.origin)
    for name, value in model_keys(folder).items():
        theirs = convert(name, value, source)
        if loaded.given(name) and origin[name] != source and name not in USER_CHOICES:
            mine = loaded.config.get(name)
            if mine != theirs:
                raise ConfigError(
                    f"is {_shown(mine)} here but {_shown(theirs)} in {source}, the Hugging Face "
                    "folder load names: leave it out (the folder's value is the model's) or "
                    "load another folder",
                    source=loaded.source(name),
                    key=name,
                )
        if not loaded.given(name):
            config.set(name, theirs)
            origin[name] = source
    if not any(loaded.given(k) for k in TOKENIZER_KEYS):
        for name, value in tokenizer_keys(folder).items():
            config.set(name, value)
            origin[name] = source
    validate(config, origin)
    return LoadedConfig(config, origin, list(loaded.files))


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list | str) else str(value)


def explain_note(loaded: LoadedConfig) -> str | None:
    """What ``config explain`` says of a model read from a Hugging Face folder."""
    load = loaded.config.checkpoint.load
    if not is_hf_folder(load):
        return None
    from torchneox.models.hf import architectures as hf

    source = str(Path(load) / "config.json")
    keys = [k for k, where in loaded.origin.items() if where == source]
    shown = ", ".join(f"{k} {_shown(loaded.config.get(k))}" for k in keys)
    arch = hf.architecture_of(hf.read_config(Path(load)))
    return (
        f"model: the Hugging Face folder {load} ({arch}), whose weights a fresh run starts from "
        f"(step 0, a fresh optimizer); from its config.json: {shown}"
    )
