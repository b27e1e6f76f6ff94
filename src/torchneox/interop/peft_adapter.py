"""``convert to-hf --adapter``: a checkpoint's LoRA adapters as a PEFT adapter folder
(adapter_config.json and adapter_model.safetensors, PEFT's tensor names) that
``peft.PeftModel.from_pretrained`` loads onto the Hugging Face base it was trained from.
Plain ``convert to-hf`` merges the adapters into the weights instead (``merged_state_dict``).
``convert from-hf --adapter``: a Hugging Face base and a PEFT adapter folder of it -> a
torchneox checkpoint with the lora key and the adapters (training goes on from them)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import ConfigError, HFError
from torchneox.checkpoint import files as checkpoint_format
from torchneox.checkpoint import weights
from torchneox.checkpoint.hf_files import DTYPES, check_fits_fp16, save_shard
from torchneox.checkpoint.tensors import refuse_non_finite
from torchneox.config.derive import derive
from torchneox.config.features.lora import HF_NAMES
from torchneox.config.paths import new_output_dir, read_json_object, refuse_non_empty
from torchneox.config.report import render_yaml
from torchneox.config.validate import validate
from torchneox.interop import huggingface
from torchneox.models.args import ModelArgs, model_args
from torchneox.models.hf import architectures as hf
from torchneox.models.hf import mamba as hf_mamba
from torchneox.models.hf.weights import GPT_NEOX
from torchneox.models.transformer import Transformer, is_adapter

OURS_TO_HF = {ours: theirs for theirs, ours in HF_NAMES.items()}
SELF_ATTN_OR_MLP = {"attention": "self_attn", "mlp": "mlp"}


def peft_name(name: str) -> str:
    """PEFT's name of adapter tensor ``name`` on a Llama-family model
    (layers.0.attention.wq.lora_A.weight -> base_model.model.model.layers.0.self_attn.q_proj
    .lora_A.weight)."""
    _, layer, block, proj, ab, leaf = name.split(".")
    theirs = OURS_TO_HF[f"{block}.{proj}"]
    return f"base_model.model.model.layers.{layer}.{SELF_ATTN_OR_MLP[block]}.{theirs}.{ab}.{leaf}"


def adapter_config(args: ModelArgs) -> dict:
    """PEFT's LoraConfig of the adapters, as adapter_config.json holds it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout,
        "target_modules": [OURS_TO_HF[t] for t in args.lora_targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }


def to_peft(
    ckpt: str | Path, out_dir: str | Path, force: bool = False, dtype: str = "fp32"
) -> Path:
    """A checkpoint trained with ``lora`` -> a PEFT adapter folder (the adapters in ``dtype``)."""
    step_dir = checkpoint_format.resolve(ckpt)
    loaded = checkpoint_format.checkpoint_config(step_dir)
    out = Path(out_dir)
    refuse_non_empty(out, force, "convert to-hf --adapter", inputs=[ckpt, step_dir])
    args = model_args(loaded)
    if not args.lora_rank:
        raise ConfigError(
            "holds no LoRA adapters (its config has no lora key); convert to-hf without "
            "--adapter writes the whole model",
            source=str(step_dir),
        )
    if args.value_head:
        raise HFError(
            "is a reward model: --adapter of one is unbuilt (its value head trains too, which "
            "PEFT would keep in modules_to_save); convert to-hf without --adapter merges the "
            "adapters",
            source=str(step_dir),
        )
    arch = hf.causal_family(hf.export_architecture(args))
    if arch in (GPT_NEOX, hf_mamba.MAMBA):
        raise HFError(
            f"--adapter writes PEFT adapters of Llama-family models; {arch}'s are unbuilt "
            "(convert to-hf without --adapter merges them into the weights)",
            source=str(step_dir),
        )
    _, model = weights.load_model(step_dir)
    tensors = {}
    for n, t in model.state_dict().items():
        if is_adapter(n):
            cast = t.detach().to(DTYPES[dtype]).contiguous()
            if cast.dtype == torch.float16:  # refused as plain to-hf refuses it, not inf
                check_fits_fp16(peft_name(n), t, cast, str(step_dir))
            tensors[peft_name(n)] = cast
    with new_output_dir(out, force, "convert to-hf --adapter", inputs=[ckpt, step_dir]) as tmp:
        save_shard(tensors, tmp / "adapter_model.safetensors")
        config = json.dumps(adapter_config(args), indent=2) + "\n"
        (tmp / "adapter_config.json").write_text(config)
    return out


PEFT_LAYER = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(lora_[AB])\.weight$"
)
REFUSED_OPTIONS = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none"}


def lora_keys(adapter_dir: Path) -> dict:
    """adapter_config.json as the lora key, each PEFT option torchneox does not build refused
    in one line."""
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise HFError(
            "has no adapter_config.json: not a PEFT adapter folder", source=str(adapter_dir)
        )
    c = read_json_object(path, ": is it cut short? save the adapter again", HFError)
    if c.get("peft_type") != "LORA":
        raise HFError(
            f"peft_type {c.get('peft_type')!r}: only LORA adapters import", source=str(path)
        )
    for name, plain in REFUSED_OPTIONS.items():
        if c.get(name, plain) not in (plain, None):
            raise HFError(f"{name} {c[name]!r} is not built (only {plain!r})", source=str(path))
    if c.get("modules_to_save") or c.get("rank_pattern") or c.get("alpha_pattern"):
        raise HFError(
            "modules_to_save, rank_pattern and alpha_pattern are not built", source=str(path)
        )
    targets = c.get("target_modules")
    if not isinstance(targets, list) or any(t not in HF_NAMES for t in targets):
        raise HFError(
            f"target_modules {targets!r}: give a list of {', '.join(HF_NAMES)}", source=str(path)
        )
    for name, what in (("r", "the adapters' rank"), ("lora_alpha", "their scale's alpha")):
        if name not in c:
            raise HFError(
                f"has no {name} ({what}), which PEFT writes: is the file cut or edited? save "
                "the adapter again",
                source=str(path),
            )
    return {
        "rank": c["r"],
        "alpha": c["lora_alpha"],
        "dropout": c.get("lora_dropout", 0.0),
        "target_modules": targets,
    }


def adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors under torchneox's names; a cut file, or a tensor holding NaN
    or inf, refused in one line naming it."""
    path = adapter_dir / "adapter_model.safetensors"
    if not path.is_file():
        raise HFError("has no adapter_model.safetensors", source=str(adapter_dir))
    out, theirs = {}, {}
    for name, tensor in hf.iter_tensors(path):
        m = PEFT_LAYER.match(name)
        if m is None or m[3] not in HF_NAMES:
            raise HFError(f"tensor {name} is not a Llama-family LoRA adapter's", source=str(path))
        ours = f"layers.{m[1]}.{HF_NAMES[m[3]]}.{m[4]}.weight"
        out[ours], theirs[ours] = tensor.float(), name
        refuse_non_finite({ours: tensor}, path, theirs, "save the adapter again")
    return out


def from_hf_with_adapter(
    hf_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, force: bool = False
) -> Path:
    """A Hugging Face base folder and a PEFT adapter folder of it -> a torchneox checkpoint
    (global_step0) whose config has the lora key and whose weights hold the adapters."""
    src, adapter, out = Path(hf_dir), Path(adapter_dir), Path(out_dir)
    hf.read_config(src)
    keys = lora_keys(adapter)
    inputs = [hf_dir, adapter_dir]
    with new_output_dir(out, force, "convert from-hf --adapter", inputs=inputs) as tmp:
        loaded, sd = huggingface._read_hf(src, huggingface._tokenizer_keys(src, tmp, out))
        loaded.config.set("lora", keys)
        loaded.origin["lora"] = str(adapter / "adapter_config.json")
        validate(loaded.config, loaded.origin)
        sd |= adapter_tensors(adapter)
        huggingface._check_shapes(model_args(loaded), sd, str(adapter))
        arch = hf.architecture_of(hf.read_config(src))
        step = checkpoint_format.save_checkpoint(
            tmp, 0, {"model": sd}, render_yaml(loaded, derive(loaded)), {"converted_from": arch}
        )
    return out / step.name


def adapted_model(loaded: Any, base: Transformer, adapter_dir: str | Path) -> Transformer:
    """``base`` (a model of ``loaded``'s config) with a PEFT adapter folder's LoRA adapters on
    top, for serving: the base's weights are shared, not copied (the adapters alone are new)."""
    import copy

    adapter = Path(adapter_dir)
    if base.args.lora_rank:
        raise ConfigError(
            "holds LoRA adapters of its own; serve a model without them (convert to-hf merges "
            "them into the weights) to add --adapter folders",
            source=str(adapter),
        )
    mine = copy.deepcopy(loaded)
    mine.config.set("lora", lora_keys(adapter))
    mine.origin["lora"] = str(adapter / "adapter_config.json")
    validate(mine.config, mine.origin)
    args = model_args(mine)
    device = base.embed.weight.device
    dtype = base.embed.weight.dtype
    state = base.state_dict()
    state |= {k: v.to(device, dtype) for k, v in adapter_tensors(adapter).items()}
    huggingface._check_shapes(args, state, str(adapter))
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_buffers(device)
    model.load_state_dict(state, assign=True)
    return model.eval()
