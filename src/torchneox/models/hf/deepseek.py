"""DeepseekV3ForCausalLM both ways: config keys and tensor names (models/hf/weights.py streams
the tensors through ``LAYER``, ``LAYER_TENSORS`` and ``rope_rows``).

DeepSeek-V3 is the Llama family's block with multi-head latent attention (models/mixers/mla.py)
and, after ``first_k_dense_replace`` dense layers, DeepSeek's MoE: ``n_routed_experts`` SwiGLU
experts of ``moe_intermediate_size`` chosen by sigmoid scores plus ``e_score_correction_bias``
(torchneox's router bias) among the best ``topk_group`` of ``n_group`` groups, their gates
renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``, and
``n_shared_experts`` shared experts as one always-on MLP of n_shared_experts x
moe_intermediate_size. A folder converts with ``moe_router_bias_update_rate`` 0.001
(DeepSeek-V3's rate): the router bias is a buffer that exists with that key only.

Rotary dimensions: DeepSeek's weights rotate interleaved pairs (``rope_interleave``, the
default); torchneox rotates halves, so the query and rotary-key rows of each head are put in
halves order on import (even dimensions, then odd) and back on export: the same scores.

Multi-token prediction modules (``num_nextn_predict_layers`` D, torchneox's
``mtp_num_layers``) are saved as ``model.layers.{num_hidden_layers + k}`` (k < D): a block's
names, then ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (``MTP_LAYER``), and
copies of the model's embedding and head (``embed_tokens``, ``shared_head.head``: ``MTP_COPIES``),
which torchneox's modules share rather than hold; those are checked equal to the model's on
import and written again on export. transformers drops the modules on load (its
``model.layers.61`` pattern); torchneox keeps them as ``mtp.{k}.*``. A folder whose config
names D modules but holds none of their tensors (what transformers' ``save_pretrained``
writes) converts without them, with a note.
"""

from __future__ import annotations

from typing import Any

import torch

from torchneox.base.errors import HFError
from torchneox.models.args import ModelArgs

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
BIAS_UPDATE_RATE = 0.001
"""DeepSeek-V3's auxiliary-loss-free bias step, given to a converted model (see the text)."""

DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "num_nextn_predict_layers": 1,
}
"""transformers' DeepseekV3Config defaults of the keys torchneox reads."""

LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "mlp_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.q_a_proj": "attention.wq_a",
    "self_attn.q_a_layernorm": "attention.q_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
    "self_attn.kv_a_layernorm": "attention.kv_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "mlp.gate",  # the first_k_dense_replace dense layers
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
    "mlp.gate": "mlp.router",
    "mlp.shared_experts.gate_proj": "mlp.shared_expert.gate",
    "mlp.shared_experts.up_proj": "mlp.shared_expert.up",
    "mlp.shared_experts.down_proj": "mlp.shared_expert.down",
}
"""Per layer, Hugging Face module (after model.layers.{i}.) -> torchneox's (after layers.{i}.)."""
LAYER_TENSORS = {"mlp.gate.e_score_correction_bias": "mlp.router_bias"}
"""Per layer, whole tensors (no .weight/.bias) by name."""
MTP_LAYER = {name: name for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm")}
"""An MTP module's own modules beside its block's (``LAYER``'s), named alike both sides."""
MTP_COPIES = {"embed_tokens.weight": "embed.weight", "shared_head.head.weight": "output.weight"}
"""An MTP layer's copies of the model's tensors (HF, after model.layers.{i}.) -> torchneox's."""


def layer_prefix(layer: int, args: ModelArgs) -> str | None:
    """torchneox's prefix of Hugging Face's ``model.layers.{layer}``: a main layer's, an MTP
    module's past num_hidden_layers, or None past the last module."""
    if layer < args.num_layers:
        return f"layers.{layer}."
    if layer < args.num_layers + args.mtp_depth:
        return f"mtp.{layer - args.num_layers}."
    return None


def hf_layer(name: str, args: ModelArgs) -> str:
    """Hugging Face's ``model.layers.{i}.`` of torchneox's ``layers.{i}.*`` or ``mtp.{k}.*``."""
    kind, index, _ = name.split(".", 2)
    return f"model.layers.{int(index) + args.num_layers * (kind == 'mtp')}."


def mtp_copies(args: ModelArgs, k: int) -> list[tuple[str, str]]:
    """MTP module k's copies: each Hugging Face name and torchneox's tensor (the head is the
    embedding where the two are tied)."""
    head = "embed.weight" if args.tied_embeddings else "output.weight"
    prefix = f"model.layers.{args.num_layers + k}."
    return [
        (prefix + "embed_tokens.weight", "embed.weight"),
        (prefix + "shared_head.head.weight", head),
    ]


def copies_before(name: str, sd, args: ModelArgs, started: set[str]):
    """Before the first tensor of an MTP module ``name`` (``started``: those met), its copies
    of the embedding and head, each its own tensor (a file holds no two views of one)."""
    kind, index, _ = name.split(".", 2)
    if kind != "mtp" or index in started:
        return []
    started.add(index)
    return [(theirs, sd[ours].clone()) for theirs, ours in mtp_copies(args, int(index))]


# ---------------------------------------------------------------------------- reading


def neox_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The GPT-NeoX and torchneox keys of a DeepSeek-V3 config, beside the Llama family's
    (which they replace where both are set)."""
    if not hf["rope_interleave"]:
        raise HFError("false (rotary dimensions in halves) is not mapped", key="rope_interleave")
    experts, shared = hf["n_routed_experts"], hf["n_shared_experts"]
    if not shared:
        raise HFError("0 (no shared experts) is not mapped", key="n_shared_experts")
    width = hf["moe_intermediate_size"]
    return {
        "mla_kv_lora_rank": hf["kv_lora_rank"],
        "mla_q_lora_rank": hf["q_lora_rank"] or 0,
        "mla_qk_nope_head_dim": hf["qk_nope_head_dim"],
        "mla_qk_rope_head_dim": hf["qk_rope_head_dim"],
        "mla_v_head_dim": hf["v_head_dim"],
        "moe_num_experts": experts,
        "moe_top_k": hf["num_experts_per_tok"],
        "moe_router_type": "topk",
        "moe_expert_interval": 1,
        "moe_first_dense_layers": hf["first_k_dense_replace"],
        "moe_intermediate_size": width,
        "moe_score_func": "sigmoid",
        "moe_renormalize_top_k": bool(hf["norm_topk_prob"]),
        "moe_router_bias_update_rate": BIAS_UPDATE_RATE,
        "moe_expert_groups": hf["n_group"] or 1,
        "moe_topk_groups": hf["topk_group"] or 1,
        "moe_routed_scaling_factor": float(hf["routed_scaling_factor"]),
        "moe_shared_expert_intermediate_size": shared * width,
        "mtp_num_layers": hf["num_nextn_predict_layers"] or 0,
    }


def rope_rows(module: str, args: ModelArgs, tensor: torch.Tensor, to_hf: bool) -> torch.Tensor:
    """A query or rotary-key projection's rows (weight or bias) with each rotary block put from
    DeepSeek's interleaved pairs into halves order (``to_hf``: back); other tensors as they are."""
    rope = args.mla_rope_dim
    order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    if to_hf:
        order = torch.argsort(order)
    if module in ("attention.wq", "attention.wq_b"):
        head = args.mla_nope_dim + rope
        rows = tensor.reshape(args.num_heads, head, *tensor.shape[1:])
        rotary = rows[:, args.mla_nope_dim :].index_select(1, order)
        return torch.cat((rows[:, : args.mla_nope_dim], rotary), dim=1).reshape(tensor.shape)
    if module == "attention.wkv_a":
        rank = args.mla_kv_rank
        return torch.cat((tensor[:rank], tensor[rank:].index_select(0, order)))
    return tensor


# ---------------------------------------------------------------------------- writing


def problems(args: ModelArgs) -> list[str]:
    """What DeepseekV3ForCausalLM cannot express of an MLA model (empty: it computes the same)."""
    out = []
    if args.moe_num_experts == 1:
        out.append("MLA without mixture-of-experts layers (DeepSeek-V3 has them)")
    else:
        out += _moe_problems(args)
    if args.parallel_residual or args.norm_position != "input":
        out.append("gpt_j_residual or norm_position output (DeepSeek-V3 is pre-norm, sequential)")
    if args.sliding_window:
        out.append("sliding_window_width (DeepSeek-V3 has no sliding window)")
    if args.attn_bias != args.attn_out_bias:
        out.append("q/k/v biases without an output bias (DeepSeek-V3's attention_bias is all)")
    if args.mlp_bias:
        out.append("MLP biases (DeepSeek-V3 has none)")
    return out


def _moe_problems(args: ModelArgs) -> list[str]:
    out = []
    if args.moe_interval != 1:
        out.append(
            "moe_expert_interval > 1 (DeepSeek-V3's MoE layers are every layer after the dense ones)"
        )
    if args.moe_router_type != "topk" or args.moe_score_func != "sigmoid":
        out.append("a router other than top-k of sigmoid scores (DeepSeek-V3's)")
    width, shared = args.expert_width, args.moe_shared_width
    if not shared or shared % width:
        out.append(
            "a shared expert width that is not a multiple of the experts' (n_shared_experts)"
        )
    if args.moe_shared_gate:
        out.append("moe_shared_expert_gate (DeepSeek-V3's shared experts have no gate)")
    if args.moe_num_experts // args.moe_groups < 2:
        out.append("groups of one expert (DeepSeek-V3 scores a group by its two best)")
    return out


def hf_config(args: ModelArgs, out: dict[str, Any]) -> dict[str, Any]:
    """The Llama family's config.json fields ``out`` made DeepSeek-V3's."""
    out = {k: v for k, v in out.items() if k not in ("mlp_bias", "head_dim")}
    width = args.expert_width
    return out | {
        "num_key_value_heads": args.num_heads,
        "kv_lora_rank": args.mla_kv_rank,
        "q_lora_rank": args.mla_q_rank or None,
        "qk_nope_head_dim": args.mla_nope_dim,
        "qk_rope_head_dim": args.mla_rope_dim,
        "v_head_dim": args.mla_v_dim,
        "rope_interleave": True,
        "n_routed_experts": args.moe_num_experts,
        "num_experts_per_tok": args.moe_top_k,
        "moe_intermediate_size": width,
        "n_shared_experts": args.moe_shared_width // width,
        "first_k_dense_replace": args.moe_first_dense,
        "n_group": args.moe_groups,
        "topk_group": args.moe_topk_groups,
        "norm_topk_prob": args.moe_renormalize,
        "routed_scaling_factor": args.moe_routed_scale,
        "num_nextn_predict_layers": args.mtp_depth,
        "output_router_logits": False,
    }
