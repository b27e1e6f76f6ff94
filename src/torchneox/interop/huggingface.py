"""``torchneox convert``: Hugging Face folders <-> torchneox checkpoints."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from torchneox.base.errors import ConfigError
from torchneox.config.derive import derive
from torchneox.config.load import LoadedConfig, load_mapping
from torchneox.config.paths import new_output_dir
from torchneox.config.report import render_yaml
from torchneox.models import hf
from torchneox.models.args import ModelArgs, model_args
from torchneox.models.transformer import Transformer
from torchneox.train import checkpoint


def _tokenizer_keys(hf_dir: Path, write_dir: Path, out_dir: Path) -> dict[str, str]:
    """Copy the HF folder's tokenizer files into write_dir (which becomes out_dir); the config
    keys that name them where they will be."""
    final = out_dir.resolve()
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer.json", write_dir / "tokenizer.json")
        if (hf_dir / "tokenizer_config.json").is_file():  # its chat template, special tokens
            shutil.copyfile(hf_dir / "tokenizer_config.json", write_dir / "tokenizer_config.json")
        return {"tokenizer_type": "HFTokenizer", "vocab_file": str(final / "tokenizer.json")}
    if (hf_dir / "vocab.json").is_file() and (hf_dir / "merges.txt").is_file():
        keys = {"tokenizer_type": "GPT2BPETokenizer"}
        for name, key in (("vocab.json", "vocab_file"), ("merges.txt", "merge_file")):
            shutil.copyfile(hf_dir / name, write_dir / name)
            keys[key] = str(final / name)
        return keys
    return {}


def _check_shapes(args: ModelArgs, sd: dict[str, torch.Tensor], source: str) -> None:
    with torch.device("meta"):
        expected = Transformer(args).state_dict()
    missing = sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise ConfigError(f"weights do not match the config ({what})", source=source)
    for name, tensor in expected.items():
        if tuple(sd[name].shape) != tuple(tensor.shape):
            raise ConfigError(
                f"tensor {name} has shape {tuple(sd[name].shape)}, the config needs {tuple(tensor.shape)}",
                source=source,
            )


def _read_hf(
    hf_dir: Path, tokenizer_keys: dict[str, str]
) -> tuple[LoadedConfig, dict[str, torch.Tensor]]:
    hf_cfg = hf.read_config(hf_dir)
    try:
        keys = hf.neox_config_from_hf(hf_cfg)
    except hf.HFError as e:
        if e.source is not None:
            raise
        raise hf.HFError(e.message, source=str(hf_dir / "config.json"), key=e.key) from None
    loaded = load_mapping(keys | tokenizer_keys, str(hf_dir / "config.json"))
    args = model_args(loaded)
    tensors = hf.read_state_dict(hf_dir)
    try:
        sd = hf.state_dict_from_hf(hf.architecture_of(hf_cfg), tensors, args)
    except KeyError as e:
        raise ConfigError(
            f"the weights have no tensor {e.args[0]}, which config.json's model needs; do the "
            "weights belong to this config.json?",
            source=str(hf_dir),
        ) from None
    except RuntimeError as e:  # a reshape of a tensor whose size config.json does not give
        raise ConfigError(
            f"the weights do not match config.json ({str(e).splitlines()[0]}); do they belong "
            "to this config.json?",
            source=str(hf_dir),
        ) from None
    _check_shapes(args, sd, str(hf_dir))
    return loaded, sd


def from_hf(hf_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """A local GPTNeoX/Llama/Mistral folder -> a torchneox checkpoint (global_step0)."""
    src, out = Path(hf_dir), Path(out_dir)
    hf.read_config(src)  # not a model folder: say so before anything is written
    with new_output_dir(out, force, "convert from-hf") as tmp:
        loaded, sd = _read_hf(src, _tokenizer_keys(src, tmp, out))
        yaml_text = render_yaml(loaded, derive(loaded))
        arch = hf.architecture_of(hf.read_config(src))
        step = checkpoint.save_checkpoint(
            tmp, 0, {"model": sd}, yaml_text, {"converted_from": arch}
        )
    return out / step.name


def load_hf_model(hf_dir: str | Path, device: str = "cpu") -> tuple[LoadedConfig, Transformer]:
    """A local HF folder as a torchneox model, without writing a checkpoint."""
    src = Path(hf_dir)
    keys: dict[str, str] = {}
    if (src / "tokenizer.json").is_file():
        keys = {"tokenizer_type": "HFTokenizer", "vocab_file": str(src / "tokenizer.json")}
    elif (src / "vocab.json").is_file() and (src / "merges.txt").is_file():
        keys = {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": str(src / "vocab.json"),
            "merge_file": str(src / "merges.txt"),
        }
    loaded, sd = _read_hf(src, keys)
    with torch.device("meta"):
        model = Transformer(model_args(loaded))
    model.to_empty(device=device)
    model.init_buffers(device)
    model.load_state_dict(sd)
    return loaded, model


def to_hf(ckpt: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """A torchneox checkpoint -> a Hugging Face folder (safetensors, config.json, tokenizer)."""
    from safetensors.torch import save_file

    step_dir = checkpoint.resolve(ckpt)
    loaded = checkpoint.checkpoint_config(step_dir)
    args = model_args(loaded)
    arch = hf.export_architecture(args)
    _, model = checkpoint.load_model(step_dir)
    out = Path(out_dir)
    with new_output_dir(out, force, "convert to-hf") as tmp:
        tensors = hf.state_dict_to_hf(arch, model.state_dict(), args)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        eod, pad = _copy_tokenizer(loaded, tmp)
        config = json.dumps(hf.hf_config(arch, args, eod, pad), indent=2) + "\n"
        (tmp / "config.json").write_text(config)
    return out


def _copy_tokenizer(loaded: LoadedConfig, out: Path) -> tuple[int | None, int | None]:
    """The tokenizer files into the export, with the tokenizer_config.json beside them (its
    chat template travels with the model); the end-of-text and padding ids."""
    tok = loaded.config.tokenizer
    if tok.vocab_file is None or not Path(tok.vocab_file).is_file():
        if tok.vocab_file is not None:
            print(
                f"warning: the checkpoint's tokenizer file {tok.vocab_file} is not there: the "
                "export has no tokenizer and no bos/eos ids (copy it into the export yourself)",
                file=sys.stderr,
            )
        return None, None
    if tok.tokenizer_type == "HFTokenizer":
        shutil.copyfile(tok.vocab_file, out / "tokenizer.json")
    elif tok.tokenizer_type in ("GPT2BPETokenizer", "HFGPT2Tokenizer") and tok.merge_file:
        shutil.copyfile(tok.vocab_file, out / "vocab.json")
        shutil.copyfile(tok.merge_file, out / "merges.txt")
    else:
        return None, None
    from torchneox.data.tokenizers import END_OF_TEXT, PADDING, build_tokenizer

    built = build_tokenizer(loaded.config)
    beside = Path(tok.vocab_file).with_name("tokenizer_config.json")
    if beside.is_file():
        shutil.copyfile(beside, out / "tokenizer_config.json")
    elif tok.tokenizer_type == "HFTokenizer":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT}
        if built.pad_id is not None:
            config["pad_token"] = PADDING
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return built.eod_id, built.pad_id
