"""transformers' MambaForCausalLM <-> GPT-NeoX's mamba keys and torchneox's names.

A MambaForCausalLM is GPT-NeoX's all-mamba model with rmsnorm and no positions: its layers'
``norm`` and ``mixer.*`` are torchneox's ``mamba_norm`` and ``mamba.*`` (the same parameter
names inside the mixer), ``backbone.embeddings`` / ``backbone.norm_f`` / ``lm_head`` the
embedding, final norm and head. What one side computes and the other cannot is refused in one
line naming it (transformers' in_proj/out_proj biases come without GPT-NeoX's x_proj bias;
GPT-NeoX's learned positions, LayerNorm or attention layers have no place in MambaForCausalLM).
"""

from __future__ import annotations

import math
from typing import Any

from torchneox.base.errors import HFError
from torchneox.models.args import ModelArgs
from torchneox.models.mixers.mamba import D_CONV, D_STATE

MAMBA = "MambaForCausalLM"
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50280,
    "hidden_size": 768,
    "state_size": 16,
    "num_hidden_layers": 32,
    "layer_norm_epsilon": 1e-5,
    "expand": 2,
    "conv_kernel": 4,
    "use_bias": False,
    "use_conv_bias": True,
    "hidden_act": "silu",
    "time_step_rank": "auto",
    "tie_word_embeddings": True,
}
"""transformers' MambaConfig defaults of the keys read here (tests/interop/test_mamba_hf.py
holds them to MambaConfig)."""
CONTEXT = 2048
"""seq_length of a converted model (a Mamba has no position limit; GPT-NeoX's mamba configs
train at 2048)."""

LAYER = {
    "norm": "mamba_norm",
    "mixer": "mamba",
    **{f"mixer.{p}": f"mamba.{p}" for p in ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")},
}
"""Per layer, transformers (after backbone.layers.{i}.) -> torchneox (after layers.{i}.)."""
TOP = {"backbone.embeddings": "embed", "backbone.norm_f": "final_norm", "lm_head": "output"}


def neox_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT-NeoX keys of a MambaForCausalLM config.json (transformers' defaults filled in)."""
    hf = DEFAULTS | hf
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    fixed = {"state_size": D_STATE, "conv_kernel": D_CONV, "hidden_act": "silu"}
    for key, value in fixed.items():
        if hf[key] != value:
            raise HFError(f"{hf[key]!r}: GPT-NeoX's mamba has {value} (fixed)", key=key)
    if hf["time_step_rank"] not in ("auto", math.ceil(h / 16)):
        raise HFError(
            f"{hf['time_step_rank']}: GPT-NeoX's mamba has ceil(hidden_size / 16)",
            key="time_step_rank",
        )
    if hf["use_bias"]:
        raise HFError(
            "true: transformers' biases of in_proj and out_proj come without one on x_proj, "
            "and GPT-NeoX's mamba_use_bias_in_linears puts one on all three",
            key="use_bias",
        )
    return {
        "num_layers": layers,
        "hidden_size": h,
        "num_attention_heads": 1,  # no attention layer: ignored, as in GPT-NeoX's configs
        "seq_length": CONTEXT,
        "max_position_embeddings": CONTEXT,
        "pos_emb": "none",
        "norm": "rmsnorm",
        "rms_norm_epsilon": hf["layer_norm_epsilon"],
        "attention_config": [[["mamba"], layers]],
        "expansion_factor": hf["expand"],
        "mamba_use_bias_in_conv": hf["use_conv_bias"],
        "mamba_use_bias_in_linears": False,
        "activation": "silu",
        "no_weight_tying": not hf["tie_word_embeddings"],
        "padded_vocab_size": hf["vocab_size"],
        "make_vocab_size_divisible_by": 1,
    }


def has_mamba(args: ModelArgs) -> bool:
    return "mamba" in args.layer_types


def problems(args: ModelArgs) -> list[str]:
    """What a model with mamba layers has that MambaForCausalLM cannot express."""
    out = []
    if set(args.layer_types) != {"mamba"}:
        out.append("attention_config mixes mamba with other layers (MambaForCausalLM has none)")
    if args.pos_emb != "none":
        out.append(f"pos_emb {args.pos_emb!r} (MambaForCausalLM has no positions; set none)")
    if args.norm != "rmsnorm":
        out.append(f"norm {args.norm!r} (MambaForCausalLM's norms are rmsnorm)")
    if args.mamba_linear_bias:
        out.append("mamba_use_bias_in_linears (transformers has no x_proj bias)")
    expand = args.mamba_inner / args.hidden_size
    if int(expand * args.hidden_size) != args.mamba_inner:
        out.append(f"d_inner {args.mamba_inner} (transformers' is int(expand x hidden_size))")
    if args.value_head:
        out.append("a reward model's value head (transformers has no Mamba classifier)")
    return out


def hf_config(args: ModelArgs, eod_id: int | None = None) -> dict[str, Any]:
    expand = args.mamba_inner / args.hidden_size
    out = {
        "architectures": [MAMBA],
        "model_type": "mamba",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "state_size": D_STATE,
        "conv_kernel": D_CONV,
        "expand": int(expand) if expand.is_integer() else expand,
        "time_step_rank": args.mamba_dt_rank,
        "layer_norm_epsilon": args.norm_eps,
        "use_bias": False,
        "use_conv_bias": args.mamba_conv_bias,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "tie_word_embeddings": args.tied_embeddings,
        "initializer_range": args.init_std,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if eod_id is not None:
        out.update(bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id)
    return out
