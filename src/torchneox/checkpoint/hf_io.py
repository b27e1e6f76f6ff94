"""Hugging Face folders inside training: ``load`` naming one (its weights streamed, tensor by
tensor, into each rank's shards: no rank holds the whole model) and ``save_hf`` (the trained
weights gathered one tensor at a time and written on rank 0 as ``convert to-hf`` writes
them). The config side, the model keys config.json gives, is ``models/hf/folder.py``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchneox.base.errors import ConfigError, HFError
from torchneox.checkpoint.fine_tuning import Resumed
from torchneox.checkpoint.hf_files import (
    DEFAULT_SHARD_BYTES,
    Progress,
    write_companions,
    write_shards,
)
from torchneox.checkpoint.tensors import FRESH_HEADS, FreshNames, missing_heads, refuse_non_finite
from torchneox.config.load import LoadedConfig
from torchneox.config.paths import atomic_output, new_output_dir, refuse_non_empty
from torchneox.models.args import ModelArgs, model_args
from torchneox.models.hf import architectures as hf
from torchneox.models.hf.folder import is_hf_folder
from torchneox.models.hf.weights import WeightImporter, hf_tensors
from torchneox.models.lora import merge_any
from torchneox.models.params import is_adapter, plain_name
from torchneox.models.transformer import Transformer
from torchneox.parallel.shards import local_part

VERB = "save_hf"


def fresh_heads(step_dir: Path) -> FreshNames:
    """The heads a model loading ``step_dir`` (a checkpoint or a Hugging Face folder) draws:
    a reward model's value head where the folder is no *ForSequenceClassification, and any
    LoRA adapters."""
    if not is_hf_folder(step_dir):
        return missing_heads(step_dir)
    named = (hf.read_config(step_dir).get("architectures") or [""])[0]
    scored = str(named).endswith("ForSequenceClassification")
    # a folder holds no LoRA adapters: a run with lora draws them all
    heads = [h for h in FRESH_HEADS if not (scored and h == "value_head.weight")]
    return FreshNames(heads, set(), "model")


def _expected(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole model with its shape (on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}


@torch.no_grad()
def load_hf_weights(
    folder: Path, model: torch.nn.Module, args: ModelArgs, line: Callable[[str], None]
) -> Resumed:
    """The folder's weights into ``model`` (whole, or this rank's shards and stages), each
    Hugging Face tensor mapped as ``convert from-hf`` maps it, checked, copied in and dropped;
    a finetune start: step 0, the optimizer fresh."""
    hf_cfg = hf.read_config(folder)
    arch = hf.architecture_of(hf_cfg)
    if hf_cfg.get("tie_word_embeddings") and not args.tied_embeddings:
        line(
            f"warning: {folder / 'config.json'} says tie_word_embeddings, but the folder's "
            "stored head differs from the embedding: loaded as its own head (untied), as "
            "transformers loads it"
        )
    causal_head = args.value_head and not arch.endswith("ForSequenceClassification")
    # a reward model from a language model's folder: its head read past, value_head drawn
    # (as a converted checkpoint's head is, which the reward model does not load)
    importer = WeightImporter(
        hf.causal_family(arch), replace(args, value_head=False) if causal_head else args
    )
    importer.drop_mtp = not args.mtp_depth  # DeepSeek-V3's MTP modules, for a model without
    params = {plain_name(n): p for n, p in model.named_parameters()}
    expected = _expected(args)
    placed: set[str] = set()

    def place(ready: Mapping[str, torch.Tensor]) -> None:
        for ours, whole in ready.items():
            if causal_head and ours == "output.weight":
                continue
            _place(ours, whole, params, expected, folder, importer.source)
            placed.add(ours)

    for path in hf.weight_files(folder):
        with hf.naming_errors(path):
            for name, tensor in hf.iter_tensors(path):
                importer.add(name, tensor)
                place(importer.take_ready())
    with hf.naming_errors(folder):
        place(importer.result())
    fresh = fresh_heads(folder)  # (LoRA adapters among them: a folder holds none)
    missing = sorted(k for k in expected if k not in placed and k not in fresh)
    if missing:
        raise ConfigError(
            f"weights do not match the config (missing {missing[0]})", source=str(folder)
        )
    if importer.skipped:
        line(
            f"note: skipped {len(importer.skipped)} buffers that torchneox recomputes, as "
            f"transformers does ({importer.skipped[0]}, ...)"
        )
    if importer.dropped_mtp:
        line(
            f"note: read past the folder's {len(importer.dropped_mtp)} MTP tensors "
            f"({importer.dropped_mtp[0]}, ...): mtp_num_layers is 0"
        )
    line(
        f"starting at step 0 from the weights of the Hugging Face folder {folder} ({arch}), "
        "with a fresh optimizer"
    )
    return Resumed(folder, 0, training_state=False)


def _place(
    ours: str,
    whole: torch.Tensor,
    params: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    folder: Path,
    names: dict[str, str],
) -> None:
    """One whole tensor checked against the model and this rank's part of it copied in (a
    tensor another pipeline stage holds is checked and dropped)."""
    if ours not in expected:
        raise ConfigError(
            f"weights do not match the config (unexpected {ours})", source=str(folder)
        )
    if tuple(whole.shape) != expected[ours]:
        raise ConfigError(
            f"tensor {names.get(ours, ours)} has shape {tuple(whole.shape)}, the config needs "
            f"{expected[ours]}",
            source=str(folder),
        )
    refuse_non_finite({ours: whole}, folder, names, "download or export the folder again")
    param = params.get(ours)
    if param is None:
        return
    local, where = local_part(param)
    local.copy_(whole if where is None else whole[where])


# ------------------------------------------------------------------------------ save_hf


def check_save_hf(loaded: LoadedConfig, force: bool, pp: int) -> None:
    """Before anything is built: a save_hf folder that holds something (without --force),
    that is or holds an input or the checkpoints, a model Hugging Face cannot hold, or a
    pipeline layout, refused in one line."""
    cfg = loaded.config
    out = cfg.checkpoint.save_hf
    if not out:
        return
    tok = cfg.tokenizer
    inputs = [p for p in (cfg.checkpoint.load, tok.vocab_file, tok.merge_file) if p]
    refuse_non_empty(Path(out), force or own_export(loaded), VERB, inputs=[*inputs, *loaded.files])
    save = cfg.checkpoint.save
    if save:
        mine, theirs = Path(out).resolve(), Path(save).resolve()
        if mine == theirs or mine in theirs.parents:
            raise ConfigError(
                f"would replace the checkpoints in save ({save}): name a folder beside them",
                source=loaded.source("save_hf"),
                key="save_hf",
            )
    if pp > 1:
        raise ConfigError(
            "is not written under pipeline parallelism yet (no rank holds every stage): "
            "convert to-hf the last checkpoint instead",
            source=loaded.source("save_hf"),
            key="save_hf",
        )
    args = model_args(loaded)
    try:
        hf.export_architecture(args)
    except HFError as e:
        raise HFError(e.message, source=loaded.source("save_hf"), key="save_hf") from None
    if args.soft_prompt_tokens:  # as convert to-hf refuses it
        raise ConfigError(
            "cannot hold a soft prompt (soft_prompt_tuning): Hugging Face formats have no place "
            "for one; leave save_hf out and generate with the checkpoints",
            source=loaded.source("save_hf"),
            key="save_hf",
        )


class _Gathered(Mapping):
    """The model's tensors under their plain names, each gathered whole (onto the host) when
    read, a LoRA adapter merged into the weight it adapts (W + scale x B @ A, as
    ``convert to-hf`` merges); every rank reads them in the same order: a DTensor's gather is
    a collective."""

    def __init__(self, model: torch.nn.Module, args: ModelArgs):
        self.params = {plain_name(n): p for n, p in model.named_parameters()}
        self.names = [n for n in _expected(args) if not is_adapter(n)]
        self.scale = args.lora_alpha / args.lora_rank if args.lora_rank else 0.0

    def _whole(self, name: str) -> torch.Tensor:
        param = self.params[name].detach()
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        return whole.cpu()  # the shard being filled waits in host memory, not the GPU's

    def __getitem__(self, name: str) -> torch.Tensor:
        # a linear's adapter sits under it, an MoE expert weight's beside it (models/lora.py)
        layer = name.removesuffix(".weight") if name.endswith(".weight") else f"{name}_lora"
        if f"{layer}.lora_A.weight" not in self.params:
            return self._whole(name)
        w, a, b = (
            self._whole(n) for n in (name, f"{layer}.lora_A.weight", f"{layer}.lora_B.weight")
        )
        return merge_any(w, a, b, self.scale)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@torch.no_grad()
def save_hf(
    loaded: LoadedConfig,
    model: torch.nn.Module,
    args: ModelArgs,
    force: bool,
    is_rank0: bool,
) -> Path:
    """The trained model as a Hugging Face folder at ``save_hf`` (fp32, as ``convert to-hf``
    writes by default), written whole by rank 0 under a temporary name and renamed; the other
    ranks take part in each tensor's gather."""
    cfg = loaded.config
    out = Path(cfg.checkpoint.save_hf)
    arch = hf.export_architecture(args)
    tensors = hf_tensors(hf.causal_family(arch), _Gathered(model, args), args)
    if not is_rank0:
        for _ in tensors:  # the gathers, in rank 0's order
            pass
        return out
    tok = cfg.tokenizer
    inputs = [p for p in (cfg.checkpoint.load, tok.vocab_file, tok.merge_file) if p]
    own = own_export(loaded)
    with new_output_dir(out, force or own, VERB, inputs=[*inputs, *loaded.files]) as tmp:
        meter = Progress("wrote", 1, False)
        write_shards(tensors, tmp, torch.float32, DEFAULT_SHARD_BYTES, meter, str(out))
        write_companions(loaded, tmp, arch, args, torch.float32)
    if cfg.checkpoint.save:  # a rerun of this run (trained longer) may replace it
        record = Path(cfg.checkpoint.save) / OWN_EXPORT
        with atomic_output(record, "record of save_hf", inputs=[]) as tmp_record:
            tmp_record.write_text(json.dumps({"save_hf": str(out.resolve())}) + "\n")
    return out


OWN_EXPORT = "save_hf.json"
"""In ``save``: the folder this run's ``save_hf`` wrote, which a rerun replaces without
``--force`` (any other folder holding something needs it)."""


def own_export(loaded: LoadedConfig) -> bool:
    """Whether ``save_hf`` names the folder this run (its ``save``) wrote before."""
    cfg = loaded.config.checkpoint
    if not (cfg.save and cfg.save_hf and Path(cfg.save_hf).is_dir()):
        return False
    try:
        written = json.loads((Path(cfg.save) / OWN_EXPORT).read_text())["save_hf"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return written == str(Path(cfg.save_hf).resolve())


def save_line(out: Path, args: ModelArgs) -> str:
    return f"wrote the Hugging Face folder {out} ({hf.export_architecture(args)}, fp32)"


def is_hf_start(step_dir: Any) -> bool:
    return step_dir is not None and is_hf_folder(step_dir)
