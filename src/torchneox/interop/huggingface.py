"""``torchneox convert``: Hugging Face folders <-> torchneox checkpoints."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from torchneox.base.errors import ConfigError
from torchneox.checkpoint import files as checkpoint_format
from torchneox.checkpoint import weights
from torchneox.checkpoint.hf_files import (
    DEFAULT_SHARD_BYTES,
    DTYPES,
    TOKENIZER_COMPANIONS,
    Progress,
    check_companions,
    write_companions,
    write_shards,
)
from torchneox.checkpoint.tensors import refuse_non_finite
from torchneox.config.derive import derive
from torchneox.config.load import LoadedConfig, load_mapping
from torchneox.config.paths import new_output_dir, refuse_non_empty
from torchneox.config.report import render_yaml
from torchneox.models.args import ModelArgs, model_args
from torchneox.models.hf import architectures as hf
from torchneox.models.hf.weights import GPT_NEOX, WeightImporter, hf_tensors
from torchneox.models.lora import merged_state_dict
from torchneox.models.sharing import per_layer_state
from torchneox.models.transformer import Transformer


def _tokenizer_keys(hf_dir: Path, write_dir: Path, out_dir: Path) -> dict[str, str]:
    """Copy the HF folder's tokenizer files (and what goes with them) into write_dir (which
    becomes out_dir); the config keys that name them where they will be."""
    final = out_dir.resolve()
    for name in TOKENIZER_COMPANIONS:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, write_dir / name)
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer.json", write_dir / "tokenizer.json")
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
    hf_dir: Path, tokenizer_keys: dict[str, str], progress: bool = False
) -> tuple[LoadedConfig, dict[str, torch.Tensor]]:
    """The folder's config as GPT-NeoX keys, and its weights under torchneox's names, read
    tensor by tensor (one copy of the model in memory, not two)."""
    hf_cfg = hf.read_config(hf_dir)
    try:
        keys = hf.neox_config_from_hf(hf_cfg)
    except hf.HFError as e:
        if e.source is not None:
            raise
        raise hf.HFError(e.message, source=str(hf_dir / "config.json"), key=e.key) from None
    loaded = load_mapping(keys | tokenizer_keys, str(hf_dir / "config.json"))
    args = model_args(loaded)
    files = hf.weight_files(hf_dir)
    meter = Progress("read", sum(f.stat().st_size for f in files if f.is_file()), progress)
    importer = WeightImporter(hf.causal_family(hf.architecture_of(hf_cfg)), args)
    for path in files:
        with hf.naming_errors(path):
            for name, tensor in hf.iter_tensors(path):
                importer.add(name, tensor)
        meter.advance(path.stat().st_size, path.name)
    with hf.naming_errors(hf_dir):
        sd = importer.result()
    refuse_non_finite(sd, hf_dir, importer.source, "download or export the folder again")
    untied = importer.untied  # (compares the stored head with the embedding: once)
    if untied:  # transformers loads the stored head: so does the converted model
        keys = keys | {"no_weight_tying": True}
    no_mtp = args.mtp_depth and not any(name.startswith("mtp.") for name in sd)
    if no_mtp:  # transformers' save_pretrained drops DeepSeek-V3's MTP modules
        keys = keys | {"mtp_num_layers": 0}
        print(
            f"note: {hf_dir / 'config.json'} names {args.mtp_depth} MTP modules "
            "(num_nextn_predict_layers) but the folder holds none of their tensors: converted "
            "without them (mtp_num_layers: 0)",
            file=sys.stderr,
        )
    if untied or no_mtp:
        loaded = load_mapping(keys | tokenizer_keys, str(hf_dir / "config.json"))
        args = model_args(loaded)
    _say_what_was_read(importer, untied, hf_dir, args, sd)
    _check_shapes(args, sd, str(hf_dir))
    return loaded, sd


def _say_what_was_read(
    importer: WeightImporter,
    untied: bool,
    hf_dir: Path,
    args: ModelArgs,
    sd: dict[str, torch.Tensor],
) -> None:
    """A head transformers would draw at random refused; an untied head and the buffers
    skipped said on stderr: nothing in the folder dropped without a word."""
    config = hf_dir / "config.json"
    if not (args.tied_embeddings or args.value_head or "output.weight" in sd):
        head = "embed_out.weight" if importer.arch == GPT_NEOX else "lm_head.weight"
        raise hf.HFError(
            f"the weights have no output head ({head}) and tie_word_embeddings is false "
            "(transformers' default when config.json has none): transformers would draw the "
            "head at random; set tie_word_embeddings: true if the head is the embedding",
            source=str(config),
            key="tie_word_embeddings",
        )
    if untied:
        print(
            f"warning: {config} says tie_word_embeddings, but the folder's "
            f"{importer.stored_head_name} differs from the embedding: loaded as its own head "
            "(untied), as transformers loads it",
            file=sys.stderr,
        )
    if importer.skipped:
        print(
            f"note: skipped {len(importer.skipped)} buffers that torchneox recomputes, as "
            f"transformers does ({importer.skipped[0]}, ...)",
            file=sys.stderr,
        )


def from_hf(
    hf_dir: str | Path, out_dir: str | Path, force: bool = False, progress: bool = False
) -> Path:
    """A local Hugging Face folder -> a torchneox checkpoint (global_step0), with the
    tokenizer, its config and chat template, and the generation config beside it."""
    src, out = Path(hf_dir), Path(out_dir)
    hf.read_config(src)  # not a model folder: say so before anything is written
    check_companions(src)  # nor carry a damaged tokenizer or generation config along
    with new_output_dir(out, force, "convert from-hf", inputs=[hf_dir]) as tmp:
        loaded, sd = _read_hf(src, _tokenizer_keys(src, tmp, out), progress)
        yaml_text = render_yaml(loaded, derive(loaded))
        arch = hf.architecture_of(hf.read_config(src))
        step = checkpoint_format.save_checkpoint(
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


def to_hf(
    ckpt: str | Path,
    out_dir: str | Path,
    force: bool = False,
    dtype: str = "fp32",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = False,
) -> Path:
    """A torchneox checkpoint -> a Hugging Face folder: safetensors in ``dtype`` (one file,
    or shards of at most ``max_shard_bytes`` and an index), config.json, generation_config.json
    and the tokenizer with its config and chat template."""
    step_dir = checkpoint_format.resolve(ckpt)
    loaded = checkpoint_format.checkpoint_config(step_dir)
    tok = loaded.config.tokenizer
    inputs = [ckpt, step_dir, tok.vocab_file, tok.merge_file]  # the tokenizer's files are read too
    out = Path(out_dir)
    refuse_non_empty(out, force, "convert to-hf", inputs=inputs)  # before reading the weights
    args = model_args(loaded)
    arch = hf.export_architecture(args)
    if args.soft_prompt_tokens:
        raise ConfigError(
            "the checkpoint holds a soft prompt (soft_prompt_tuning), which Hugging Face "
            "formats have no place for; generate with the checkpoint itself (torchneox "
            "generate --checkpoint), or export the model it tuned",
            source=str(step_dir),
            key="soft_prompt_tuning",
        )
    _, model = weights.load_model(step_dir, stored_dtype=True)  # one copy, as stored
    with new_output_dir(out, force, "convert to-hf", inputs=inputs) as tmp:
        # LoRA adapters merged into their weights; under layer weight sharing each layer
        # written whole (Hugging Face formats share nothing)
        state = per_layer_state(model, merged_state_dict(model))
        tensors = hf_tensors(hf.causal_family(arch), state, args)
        total = sum(p.numel() for p in state.values()) * DTYPES[dtype].itemsize
        meter = Progress("wrote", total, progress)
        write_shards(tensors, tmp, DTYPES[dtype], max_shard_bytes, meter, str(step_dir))
        write_companions(loaded, tmp, arch, args, DTYPES[dtype])
    return out
