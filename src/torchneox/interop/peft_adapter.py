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
from torchneox.models.hf import deepseek
from torchneox.models.hf import mamba as hf_mamba
from torchneox.models.hf import weights as hf_weights
from torchneox.models.hf.weights import GPT_NEOX
from torchneox.models.params import is_adapter
from torchneox.models.sharing import per_layer_state
from torchneox.models.transformer import Transformer

OURS_TO_HF = {ours: theirs for theirs, ours in HF_NAMES.items()}
QKV = ("attention.wq", "attention.wk", "attention.wv")
"""The projections GPTNeoX fuses into one query_key_value."""
PREFIXES = {GPT_NEOX: "gpt_neox.", hf_mamba.MAMBA: "backbone."}


def hf_layer_names(arch: str) -> dict[str, str]:
    """torchneox's name of each adaptable module in a block -> the Hugging Face one."""
    names = {ours: theirs for theirs, ours in hf_weights.layer_names(arch).items()}
    if arch == hf_weights.MIXTRAL:
        names["mlp.router"] = "block_sparse_moe.gate"
    if arch == GPT_NEOX:
        names |= dict.fromkeys(QKV, "attention.query_key_value")
    return names


def peft_name(arch: str, layer: str, module: str, leaf: str) -> str:
    """PEFT's name of an adapter tensor of ``module`` (attention.wq) in block ``layer``:
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight on a Llama."""
    prefix = PREFIXES.get(arch, "model.")
    return f"base_model.model.{prefix}layers.{layer}.{hf_layer_names(arch)[module]}.{leaf}"


def fused_qkv_adapter(
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]], args: ModelArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapters of a block's wq, wk, wv (those ``parts`` holds: name -> (A, B)) as one
    adapter of GPTNeoX's fused query_key_value: the A's stacked into rank k x r, each B placed
    in its projection's rows of the per-head [q, k, v] layout and its own r columns (zeros
    elsewhere), so the fused product is each projection's own. Its scale is kept by an alpha
    k times the run's (adapter_config's alpha_pattern)."""
    held = [w for w in QKV if w in parts]
    rank = parts[held[0]][0].shape[0]
    a = torch.cat([parts[w][0] for w in held])
    blocks, rows = [], args.num_heads * args.head_dim
    for w in QKV:
        b = parts[held[0]][1].new_zeros(rows, rank * len(held))
        if w in parts:
            j = held.index(w)
            b[:, j * rank : (j + 1) * rank] = parts[w][1]
        blocks.append(b)
    return a, hf_weights.fuse_qkv(*blocks, args.num_heads, args.head_dim)


def peft_tensors(arch: str, state: dict[str, torch.Tensor], args: ModelArgs) -> dict:
    """The adapter folder's tensors under PEFT's names (a reward model's value head as the
    modules_to_save copy of the score layer; under DeepSeek-V3 the B of a query or rotary-key
    projection with its rotary rows in DeepSeek's interleaved order, as the weight is
    exported)."""
    out, fused = {}, {}
    for name, t in state.items():
        if name == "value_head.weight" and args.value_head:
            out["base_model.model.score.weight"] = t
        if not is_adapter(name):
            continue
        _, layer, rest = name.split(".", 2)
        module, ab, leaf = rest.rsplit(".", 2)
        if arch == GPT_NEOX and module in QKV:
            pair = fused.setdefault(layer, {}).setdefault(module, [None, None])
            pair[ab == "lora_B"] = t
            continue
        if arch == deepseek.DEEPSEEK_V3 and ab == "lora_B":  # B's rows as the weight's
            t = deepseek.rope_rows(module, args, t, to_hf=True)
        out[peft_name(arch, layer, module, f"{ab}.{leaf}")] = t
    for layer, parts in fused.items():
        a, b = fused_qkv_adapter(parts, args)
        qkv = "attention.wq"
        out[peft_name(arch, layer, qkv, "lora_A.weight")] = a
        out[peft_name(arch, layer, qkv, "lora_B.weight")] = b
    return out


def adapter_config(args: ModelArgs, arch: str = "LlamaForCausalLM") -> dict:
    """PEFT's LoraConfig of the adapters, as adapter_config.json holds it (a GPTNeoX's fused
    query_key_value with the rank and alpha of its stacked adapters; a reward model's score
    layer saved whole, as PEFT's sequence classification saves it)."""
    names = hf_layer_names(arch)
    targets = list(dict.fromkeys(names[t].rsplit(".", 1)[-1] for t in args.lora_targets))
    k = sum(t in QKV for t in args.lora_targets) if arch == GPT_NEOX else 0
    pattern = {"query_key_value": k} if k > 1 else {}
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if args.value_head else "CAUSAL_LM",
        "r": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout,
        "target_modules": targets,
        "rank_pattern": {n: m * args.lora_rank for n, m in pattern.items()},
        "alpha_pattern": {n: m * args.lora_alpha for n, m in pattern.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": ["score"] if args.value_head else None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }


MAMBA_UNADAPTABLE = {
    "mamba.dt_proj": "transformers' MambaMixer multiplies by dt_proj.weight itself",
    "mamba.out_proj": "PEFT refuses LoRA on a Mamba's out_proj (transformers' CUDA kernel "
    "multiplies by its weight itself)",
}
"""The Mamba projections whose PEFT adapter transformers would not compute, and why."""


def _refuse_unwritable(args: ModelArgs, arch: str, step_dir: Path) -> None:
    """What a PEFT adapter folder cannot hold, in one line saying why."""
    if not args.lora_rank:
        raise ConfigError(
            "holds no LoRA adapters (its config has no lora key); convert to-hf without "
            "--adapter writes the whole model",
            source=str(step_dir),
        )
    for target, why in MAMBA_UNADAPTABLE.items():
        if arch == hf_mamba.MAMBA and target in args.lora_targets:
            raise HFError(
                f"--adapter cannot write an adapter of {target}: {why}, past any adapter; "
                "convert to-hf without --adapter merges it into the weights",
                source=str(step_dir),
            )
    experts = {"mlp.up", "mlp.gate", "mlp.down"} & set(args.lora_targets)
    if args.moe_num_experts > 1 and experts:
        raise HFError(
            f"--adapter cannot write the adapters of the MoE experts ({', '.join(sorted(experts))}"
            f"): {arch} holds its experts as stacked 3-D parameters, not the linear layers a "
            "PEFT LoRA adapter names; convert to-hf without --adapter merges them into the "
            "weights",
            source=str(step_dir),
        )


def to_peft(
    ckpt: str | Path, out_dir: str | Path, force: bool = False, dtype: str = "fp32"
) -> Path:
    """A checkpoint trained with ``lora`` -> a PEFT adapter folder (the adapters in ``dtype``)."""
    step_dir = checkpoint_format.resolve(ckpt)
    loaded = checkpoint_format.checkpoint_config(step_dir)
    out = Path(out_dir)
    refuse_non_empty(out, force, "convert to-hf --adapter", inputs=[ckpt, step_dir])
    args = model_args(loaded)
    arch = hf.causal_family(hf.export_architecture(args)) if args.lora_rank else ""
    _refuse_unwritable(args, arch, step_dir)
    _, model = weights.load_model(step_dir)
    state = per_layer_state(model)  # under layer sharing, each layer's adapters its own
    tensors = {}
    for name, t in peft_tensors(arch, state, args).items():
        cast = t.detach().to(DTYPES[dtype]).contiguous()
        if cast.dtype == torch.float16:  # refused as plain to-hf refuses it, not inf
            check_fits_fp16(name, t, cast, str(step_dir))
        tensors[name] = cast
    with new_output_dir(out, force, "convert to-hf --adapter", inputs=[ckpt, step_dir]) as tmp:
        save_shard(tensors, tmp / "adapter_model.safetensors")
        config = json.dumps(adapter_config(args, arch), indent=2) + "\n"
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
