"""Hugging Face's mixture-of-experts families beside Mixtral: Qwen2-MoE, Qwen3-MoE and OLMoE,
both ways (config keys; models/hf/weights.py maps their tensors).

All three route as torchneox's top-k router does (softmax over the experts, the k largest,
divided by their sum where ``norm_topk_prob``) with SwiGLU experts of
``moe_intermediate_size`` (OLMoE: ``intermediate_size``). Beyond that:

    Qwen2MoeForCausalLM  q/k/v biases (qkv_bias), a shared expert of
                         shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate)
    Qwen3MoeForCausalLM  each head's queries and keys normalised (Qwen3's)
    OlmoeForCausalLM     all heads' queries (keys) normalised, pre-norm blocks (not OLMo 2's)

Qwen's ``decoder_sparse_step`` and ``mlp_only_layers`` put dense MLPs of another width
(``intermediate_size``) between the MoE layers; torchneox's MLPs and experts share one width,
so only folders whose every layer is an MoE layer convert (the released Qwen-MoE models are).
"""

from __future__ import annotations

from typing import Any

from torchneox.base.errors import HFError
from torchneox.models.args import ModelArgs

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
OLMOE = "OlmoeForCausalLM"
FAMILIES = (QWEN2_MOE, QWEN3_MOE, OLMOE)
MODEL_TYPES = {QWEN2_MOE: "qwen2_moe", QWEN3_MOE: "qwen3_moe", OLMOE: "olmoe"}

_QWEN_MOE = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
}
DEFAULTS: dict[str, dict[str, Any]] = {
    QWEN2_MOE: _QWEN_MOE
    | {
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "qkv_bias": True,
    },
    QWEN3_MOE: _QWEN_MOE
    | {
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "attention_bias": False,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
    },
    OLMOE: {
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": None,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "num_experts_per_tok": 8,
        "num_experts": 64,
        "norm_topk_prob": False,
    },
}
"""transformers' config defaults of the keys torchneox reads (as models/hf/defaults.py)."""


# ---------------------------------------------------------------------------- reading


def neox_keys(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The GPT-NeoX keys of a Qwen2-MoE, Qwen3-MoE or OLMoE config (beside the Llama
    family's, which they replace where both are set)."""
    _every_layer_moe(hf, arch)
    width = hf["intermediate_size"] if arch == OLMOE else hf["moe_intermediate_size"]
    keys: dict[str, Any] = {
        # transformers 5's Qwen3MoeConfig stores num_experts as num_local_experts
        "moe_num_experts": hf.get("num_local_experts") or hf["num_experts"],
        "moe_top_k": hf["num_experts_per_tok"],
        "moe_router_type": "topk",
        "moe_expert_interval": 1,
        "moe_renormalize_top_k": bool(hf["norm_topk_prob"]),
        # GPT-NeoX's gated sizing: 2/3 of intermediate_size, halved, rounded to mlp_multiple_of
        "intermediate_size": 3 * width,
        "mlp_multiple_of": width,
    }
    if arch == QWEN2_MOE:  # biases on q, k and v (qkv_bias), none on the output
        shared = hf["shared_expert_intermediate_size"]
        if not shared:
            raise HFError(
                "0 (no shared expert) is not mapped",
                key="shared_expert_intermediate_size",
            )
        keys |= {
            "use_bias_in_attn_linear": bool(hf["qkv_bias"]),
            "attention_output_bias": False,
            "moe_shared_expert_intermediate_size": shared,
            "moe_shared_expert_gate": True,
        }
    if arch == QWEN3_MOE:
        keys |= {"use_qk_layernorm": True, "qk_norm_scope": "head"}
    if arch == OLMOE:
        if hf.get("clip_qkv") is not None:
            raise HFError(
                f"{hf['clip_qkv']} (OLMoE's clamped queries, keys and values) is not mapped",
                key="clip_qkv",
            )
        keys |= {"use_qk_layernorm": True, "qk_norm_scope": "width"}
    return keys


def _every_layer_moe(hf: dict[str, Any], arch: str) -> None:
    if arch == OLMOE:
        return
    step, dense = hf["decoder_sparse_step"], hf.get("mlp_only_layers") or []
    if step != 1 or dense:
        key = "decoder_sparse_step" if step != 1 else "mlp_only_layers"
        raise HFError(
            f"{step if step != 1 else dense}: dense MLP layers between the MoE layers are not "
            "mapped (torchneox gives its MLPs and experts one width)",
            key=key,
        )


# ---------------------------------------------------------------------------- writing


def architecture(args: ModelArgs) -> str:
    """The MoE family a Llama-like torchneox MoE model is written as."""
    if args.moe_shared_width:
        return QWEN2_MOE
    if args.qk_norm == "head":
        return QWEN3_MOE
    if args.qk_norm == "width":
        return OLMOE
    return MIXTRAL


def problems(args: ModelArgs) -> list[str]:
    """What that family cannot express of ``args`` (empty: it computes the same)."""
    arch = architecture(args)
    name = arch.removesuffix("ForCausalLM")
    out = []
    if args.moe_interval != 1:
        out.append(f"moe_expert_interval > 1 ({name}'s every MLP is an MoE layer)")
    if args.moe_router_type != "topk":
        out.append(f"moe_router_type {args.moe_router_type!r} ({name} routes top-k)")
    if args.moe_score_func != "softmax":
        out.append(f"moe_score_func {args.moe_score_func!r} ({name}'s router takes a softmax)")
    if args.moe_bias_update_rate > 0:
        out.append(f"moe_router_bias_update_rate (the router bias; {name} has none)")
    if args.mlp_bias:
        out.append(f"MLP biases with mixture-of-experts layers ({name} has none)")
    if args.moe_shared_width and not args.moe_shared_gate:
        out.append("a shared expert without moe_shared_expert_gate (Qwen2-MoE gates it)")
    if arch == MIXTRAL:
        out += _mixtral_problems(args)
    elif arch == QWEN2_MOE:
        if args.qk_norm:
            out.append("query/key norms with a shared expert (Qwen2-MoE has none)")
        if args.attn_out_bias:
            out.append("an attention output bias (Qwen2-MoE's o_proj has none)")
    elif args.attn_bias != args.attn_out_bias:
        out.append(f"q/k/v biases without an output bias ({name}'s attention_bias is all four)")
    if arch == OLMOE and args.head_dim * args.num_heads != args.hidden_size:
        out.append("head_dim (OLMoE's query norm is hidden_size wide)")
    if arch != MIXTRAL and args.sliding_window:
        out.append(f"sliding_window_width ({name} has no sliding window here)")
    if args.norm_position != "input":
        out.append("norm_position output with mixture-of-experts layers (OLMo 2 has no experts)")
    return out


def _mixtral_problems(args: ModelArgs) -> list[str]:
    """Mixtral: top-k experts in every layer, gates renormalised, no biases or qk norms."""
    out = []
    if not args.moe_renormalize:
        out.append(
            "GPT-NeoX's top-k gates, which Mixtral renormalises to sum to 1 (train with "
            "moe_renormalize_top_k: true to export as Mixtral)"
        )
    if args.attn_bias:
        out.append("biases with mixture-of-experts layers (Mixtral has none)")
    return out


def hf_config(arch: str, args: ModelArgs, out: dict[str, Any]) -> dict[str, Any]:
    """The Llama family's config.json fields ``out`` made Qwen2-MoE's, Qwen3-MoE's or
    OLMoE's."""
    out = dict(out)
    del out["mlp_bias"]
    moe = {
        "num_experts": args.moe_num_experts,
        "num_experts_per_tok": args.moe_top_k,
        "norm_topk_prob": args.moe_renormalize,
        "output_router_logits": False,
    }
    if arch == OLMOE:
        return out | moe | {"clip_qkv": None}
    qwen = {
        "moe_intermediate_size": args.mlp_width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if arch == QWEN2_MOE:
        del out["attention_bias"]
        qwen |= {
            "qkv_bias": args.attn_bias,
            "shared_expert_intermediate_size": args.moe_shared_width,
        }
    return out | moe | qwen
