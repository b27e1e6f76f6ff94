"""``convert to-hf --adapter``: a checkpoint's LoRA adapters as a PEFT adapter folder
(adapter_config.json and adapter_model.safetensors, PEFT's tensor names) that
``peft.PeftModel.from_pretrained`` loads onto the Hugging Face base it was trained from.
Plain ``convert to-hf`` merges the adapters into the weights instead (``merged_state_dict``)."""

from __future__ import annotations

import json
from pathlib import Path

from torchneox.base.errors import ConfigError, HFError
from torchneox.config.lora import HF_NAMES
from torchneox.config.paths import new_output_dir, refuse_non_empty
from torchneox.interop.huggingface import DTYPES, _save_shard
from torchneox.models import hf, hf_mamba
from torchneox.models.args import ModelArgs, model_args
from torchneox.models.hf_weights import GPT_NEOX
from torchneox.models.transformer import is_adapter
from torchneox.train import checkpoint_format, weights

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
    arch = hf.causal_family(hf.export_architecture(args))
    if arch in (GPT_NEOX, hf_mamba.MAMBA):
        raise HFError(
            f"--adapter writes PEFT adapters of Llama-family models; {arch}'s are not built "
            "yet (convert to-hf without --adapter merges them into the weights)",
            source=str(step_dir),
        )
    _, model = weights.load_model(step_dir)
    tensors = {
        peft_name(n): t.detach().to(DTYPES[dtype]).contiguous()
        for n, t in model.state_dict().items()
        if is_adapter(n)
    }
    with new_output_dir(out, force, "convert to-hf --adapter", inputs=[ckpt, step_dir]) as tmp:
        _save_shard(tensors, tmp / "adapter_model.safetensors")
        config = json.dumps(adapter_config(args), indent=2) + "\n"
        (tmp / "adapter_config.json").write_text(config)
    return out
