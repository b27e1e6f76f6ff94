"""``torchneox convert``: Hugging Face folders <-> torchneox checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from torchneox.base.errors import ConfigError
from torchneox.config.derive import derive
from torchneox.config.load import LoadedConfig, load_mapping
from torchneox.config.paths import new_output_dir, refuse_non_empty
from torchneox.config.report import render_yaml
from torchneox.models import hf
from torchneox.models.args import ModelArgs, model_args
from torchneox.models.hf_weights import GPT_NEOX, WeightImporter, hf_tensors
from torchneox.models.transformer import Transformer, merged_state_dict
from torchneox.train import checkpoint_format, weights

TOKENIZER_COMPANIONS = (
    "tokenizer_config.json",  # its chat template and special tokens
    "special_tokens_map.json",
    "chat_template.jinja",  # where newer transformers save the chat template
    "generation_config.json",  # eos ids, sampling defaults
)
"""What travels beside the tokenizer files, both ways, when the source has it."""


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


class _Progress:
    """Bytes done of a total, with rate and ETA: one line rewritten on a terminal, in a log a
    line every two seconds and at the end (nothing for work done within two seconds)."""

    def __init__(self, verb: str, total: int, show: bool):
        self.verb, self.total, self.show = verb, max(total, 1), show
        self.start = self.shown = time.perf_counter()
        self.done = 0

    def advance(self, nbytes: int, what: str) -> None:
        self.done += nbytes
        now = time.perf_counter()
        last = self.done >= self.total
        # quiet for what takes under two seconds; then a line every two, and the last
        if not self.show or (now - self.shown < 2 and not (last and self.shown > self.start)):
            return
        self.shown = now
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / max(rate, 1e-9)
        text = (
            f"{self.verb} {what}: {self.done / 2**30:.2f} of {self.total / 2**30:.2f} GiB, "
            f"{rate / 2**20:.0f} MiB/s, ETA {eta:.0f} s"
        )
        if sys.stderr.isatty():
            print("\r" + text, end="\n" if last else "", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)


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
    meter = _Progress("read", sum(f.stat().st_size for f in files if f.is_file()), progress)
    importer = WeightImporter(hf.causal_family(hf.architecture_of(hf_cfg)), args)
    for path in files:
        with _naming(path):
            for name, tensor in hf.iter_tensors(path):
                importer.add(name, tensor)
        meter.advance(path.stat().st_size, path.name)
    with _naming(hf_dir):
        sd = importer.result()
    weights.refuse_non_finite(sd, hf_dir, importer.source, "download or export the folder again")
    untied = importer.untied  # (compares the stored head with the embedding: once)
    if untied:  # transformers loads the stored head: so does the converted model
        keys = keys | {"no_weight_tying": True} | tokenizer_keys
        loaded = load_mapping(keys, str(hf_dir / "config.json"))
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


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Conversion errors that name no file name ``path``."""
    try:
        yield
    except hf.HFError as e:
        if e.source is not None:
            raise
        raise hf.HFError(e.message, source=str(path)) from None
    except RuntimeError as e:  # a reshape of a tensor whose size config.json does not give
        raise ConfigError(
            f"the weights do not match config.json ({str(e).splitlines()[0]}); do they "
            "belong to this config.json?",
            source=str(path),
        ) from None


def from_hf(
    hf_dir: str | Path, out_dir: str | Path, force: bool = False, progress: bool = False
) -> Path:
    """A local Hugging Face folder -> a torchneox checkpoint (global_step0), with the
    tokenizer, its config and chat template, and the generation config beside it."""
    src, out = Path(hf_dir), Path(out_dir)
    hf.read_config(src)  # not a model folder: say so before anything is written
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


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_SHARD_BYTES = 5 * 10**9
"""Hugging Face's usual shard size (5 GB): larger exports are cut into shards with an index."""


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
    _, model = weights.load_model(step_dir, stored_dtype=True)  # one copy, as stored
    with new_output_dir(out, force, "convert to-hf", inputs=inputs) as tmp:
        sd = merged_state_dict(model)  # LoRA adapters merged into their weights
        tensors = hf_tensors(hf.causal_family(arch), sd, args)
        total = sum(p.numel() for p in sd.values()) * DTYPES[dtype].itemsize
        meter = _Progress("wrote", total, progress)
        write_shards(tensors, tmp, DTYPES[dtype], max_shard_bytes, meter, str(step_dir))
        eod, pad = _copy_tokenizer(loaded, tmp)
        config = hf.hf_config(arch, args, eod, pad) | {"torch_dtype": HF_DTYPE_NAMES[DTYPES[dtype]]}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if not (tmp / "generation_config.json").is_file() and eod is not None:
            generation = {"bos_token_id": eod, "eos_token_id": eod}
            if pad is not None:
                generation["pad_token_id"] = pad
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def write_shards(
    tensors: Iterator[tuple[str, torch.Tensor]],
    folder: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    meter: _Progress,
    source: str = "",
) -> None:
    """Safetensors files of at most ``max_shard_bytes`` each (a larger tensor gets one of its
    own), written as each fills: in memory, never more than one shard beside the model. One
    shard is model.safetensors; more are model-0000i-of-0000n.safetensors with
    model.safetensors.index.json, as transformers writes them. A tensor fp16 cannot hold is
    refused (``source``: the checkpoint, for the message)."""
    names: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            _save_shard(shard, folder / f"part-{len(names)}.tmp")
            names.append(list(shard))
            meter.advance(size, f"shard {len(names)}")
        shard, size = {}, 0

    for name, tensor in tensors:
        t = tensor.detach().to(dtype).contiguous()
        if dtype == torch.float16:
            _check_fits_fp16(name, tensor, t, source)
        if shard and size + t.nbytes > max_shard_bytes:
            flush()
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    if len(names) == 1:
        (folder / "part-0.tmp").rename(folder / "model.safetensors")
        return
    weight_map = {}
    for i, shard_names in enumerate(names):
        final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        (folder / f"part-{i}.tmp").rename(folder / final)
        weight_map |= dict.fromkeys(shard_names, final)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


FP16_MAX = torch.finfo(torch.float16).max


def _check_fits_fp16(name: str, tensor: torch.Tensor, cast: torch.Tensor, source: str) -> None:
    """fp16 ends at 65504: a weight beyond it would be stored as inf, so it is refused."""
    if torch.isfinite(cast).all() or not torch.isfinite(tensor).all():
        return
    biggest = tensor.detach().abs().max().item()
    raise ConfigError(
        f"--dtype fp16: tensor {name} holds values up to {biggest:.6g} in magnitude, beyond "
        f"fp16's largest ({FP16_MAX:.0f}), which would become inf; export with --dtype bf16 "
        "or --dtype fp32",
        source=source or None,
    )


def _save_shard(shard: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file; its I/O failures (a full disk, a file-size limit) raised as the
    OSError they are, which the output folder turns into one line with nothing left behind."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(shard, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def _copy_tokenizer(loaded: LoadedConfig, out: Path) -> tuple[int | None, int | None]:
    """The tokenizer files into the export, with what lies beside them (TOKENIZER_COMPANIONS:
    the chat template and generation config travel with the model); the end-of-text and
    padding ids."""
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

    built = build_tokenizer(loaded.config.tokenizer)
    folder = Path(tok.vocab_file).parent
    for name in TOKENIZER_COMPANIONS:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    if not (out / "tokenizer_config.json").is_file() and tok.tokenizer_type == "HFTokenizer":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT}
        if built.pad_id is not None:
            config["pad_token"] = PADDING
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return built.eod_id, built.pad_id
