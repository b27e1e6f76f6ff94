"""What a Hugging Face folder holds besides its torchneox tensors, written as ``convert to-hf``
and a training run's ``save_hf`` both write it: safetensors shards (with their index), the
tokenizer with what travels beside it, config.json and generation_config.json; and the
progress line of long conversions."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import ConfigError
from torchneox.config.load import LoadedConfig
from torchneox.config.paths import read_json_object
from torchneox.models.hf import architectures as hf

TOKENIZER_COMPANIONS = (
    "tokenizer_config.json",  # its chat template and special tokens
    "special_tokens_map.json",
    "chat_template.jinja",  # where newer transformers save the chat template
    "generation_config.json",  # eos ids, sampling defaults
)
"""What travels beside the tokenizer files, both ways, when the source has it."""


def check_companions(folder: Path) -> None:
    """The JSON files among TOKENIZER_COMPANIONS in ``folder`` read as JSON objects: a
    damaged one is named now, not carried along to be ignored later (generate reads the
    generation config, preprocessing the tokenizer config)."""
    for name in TOKENIZER_COMPANIONS:
        path = folder / name
        if name.endswith(".json") and path.is_file():
            read_json_object(path, "; download it again or remove it")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_SHARD_BYTES = 5 * 10**9
"""Hugging Face's usual shard size (5 GB): larger exports are cut into shards with an index."""


class Progress:
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


def write_shards(
    tensors: Iterator[tuple[str, torch.Tensor]],
    folder: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    meter: Progress,
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
            save_shard(shard, folder / f"part-{len(names)}.tmp")
            names.append(list(shard))
            meter.advance(size, f"shard {len(names)}")
        shard, size = {}, 0

    for name, tensor in tensors:
        t = tensor.detach().to(dtype).contiguous()
        if dtype == torch.float16:
            check_fits_fp16(name, tensor, t, source)
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


def check_fits_fp16(name: str, tensor: torch.Tensor, cast: torch.Tensor, source: str) -> None:
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


def save_shard(shard: dict[str, torch.Tensor], path: Path) -> None:
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


def copy_tokenizer(loaded: LoadedConfig, out: Path) -> tuple[int | None, int | None]:
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
    check_companions(folder)
    for name in TOKENIZER_COMPANIONS:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    if not (out / "tokenizer_config.json").is_file() and tok.tokenizer_type == "HFTokenizer":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT}
        if built.pad_id is not None:
            config["pad_token"] = PADDING
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return built.eod_id, built.pad_id


def write_companions(
    loaded: LoadedConfig, folder: Path, arch: str, args: Any, dtype: torch.dtype
) -> None:
    """config.json, the tokenizer files and generation_config.json into ``folder`` (whose
    weights are written in ``dtype``)."""
    eod, pad = copy_tokenizer(loaded, folder)
    config = hf.hf_config(arch, args, eod, pad) | {"torch_dtype": HF_DTYPE_NAMES[dtype]}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not (folder / "generation_config.json").is_file() and eod is not None:
        generation = {"bos_token_id": eod, "eos_token_id": eod}
        if pad is not None:
            generation["pad_token_id"] = pad
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
