"""Config groups that shape the network: the decoder and its mixture-of-experts layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torchneox.config.fields import derived, extension, key, no_effect

FUSED = (
    "a fused-kernel switch; torchneox needs no custom kernels (SDPA and torch.compile do this work)"
)
TE_LAYER = (
    "selects TransformerEngine's fused module for the same layer; torchneox computes that "
    "layer with torch's own kernels (the same numbers in fp32/bf16)"
)
INIT_METHODS = (
    "normal",
    "scaled_normal",
    "orthogonal",
    "scaled_orthogonal",
    "xavier_uniform",
    "xavier_normal",
    "wang_init",
    "small_init",
    "single_residual_scaled_normal",
)
InitMethod = Literal[
    "normal",
    "scaled_normal",
    "orthogonal",
    "scaled_orthogonal",
    "xavier_uniform",
    "xavier_normal",
    "wang_init",
    "small_init",
    "single_residual_scaled_normal",
]
GATED_ACTIVATIONS = ("geglu", "reglu", "swiglu", "bilinear", "glu")


@dataclass
class ModelConfig:
    """The decoder: sizes, norms, positions, activations, residual layout, initialisation."""

    num_layers: int | None = key(None, "Number of transformer blocks.", ge=1)
    hidden_size: int | None = key(None, "Width of the residual stream.", ge=1)
    num_attention_heads: int | None = key(
        None, "Number of query heads; must divide hidden_size.", ge=1
    )
    num_kv_heads: int | None = key(
        None,
        "Number of key/value heads (grouped-query attention); unset means one per query head.",
        ge=1,
    )
    head_dim: int | None = extension(
        None,
        "Width of each attention head; unset: hidden_size / num_attention_heads (Qwen3 sets "
        "it apart: its heads together are wider than the residual stream).",
        ge=1,
    )
    seq_length: int | None = key(None, "Tokens per training sample.", ge=1)
    mla_kv_lora_rank: int = extension(
        0,
        "Multi-head latent attention (DeepSeek-V2/V3's MLA): every head's keys and values are "
        "rebuilt from one compressed latent of this width (kv_lora_rank), normalised by its own "
        "RMSNorm, which is all a KV cache keeps besides one rotary key; 0 (the default): "
        "standard attention. Needs pos_emb rotary; replaces head_dim, num_kv_heads and "
        "rotary_pct with the mla_* head sizes.",
        ge=0,
    )
    mla_q_lora_rank: int = extension(
        0,
        "MLA: queries through a low-rank latent of this width and its RMSNorm (q_lora_rank); "
        "0 (the default): one projection from the hidden state.",
        ge=0,
    )
    mla_qk_nope_head_dim: int = extension(
        128, "MLA: each head's query and key dimensions without positions (qk_nope_head_dim).", ge=1
    )
    mla_qk_rope_head_dim: int = extension(
        64,
        "MLA: each head's rotary query dimensions, matched against one rotary key that all heads "
        "share (qk_rope_head_dim); even.",
        ge=2,
    )
    mla_v_head_dim: int = extension(128, "MLA: each head's value width (v_head_dim).", ge=1)
    max_position_embeddings: int | None = key(
        None, "Longest sequence the position scheme supports; defaults to seq_length.", ge=1
    )
    intermediate_size: int | None = key(
        None, "Width of the MLP before gating rules are applied; unset means 4 x hidden_size.", ge=1
    )
    expansion_factor: float | None = key(
        None, "MLP width as a multiple of hidden_size, used when intermediate_size is unset.", gt=0
    )
    mlp_multiple_of: int = key(1, "Round the MLP width up to a multiple of this.", ge=1)
    sliding_window_width: int | None = key(
        None, "Each token attends only to this many previous tokens (itself included).", ge=1
    )
    inter_document_attention_masking: bool = extension(
        False,
        "In a packed sample, each token attends only to earlier tokens of its own document "
        "(documents end at the end-of-text token, which belongs to the one it ends) and "
        "positions restart at each document, and a mamba layer restarts its convolution and "
        "scan at each; false: one causal window over the sample, as GPT-NeoX trains (the key is named as GPT-NeoX's pull request #1416 names it).",
    )
    norm: Literal[
        "layernorm",
        "rmsnorm",
        "scalenorm",
        "non_parametric_layernorm",
        "te_rmsnorm",
        "te_layernorm",
    ] = key(
        "layernorm",
        "Normalisation layer; te_rmsnorm and te_layernorm (Transformer Engine) run as rmsnorm and layernorm.",
    )
    layernorm_epsilon: float = key(1.0e-5, "Epsilon of layernorm.", ge=0)
    rms_norm_epsilon: float = key(1.0e-8, "Epsilon of rmsnorm.", ge=0)
    scalenorm_epsilon: float = key(1.0e-8, "Epsilon of scalenorm.", ge=0)
    use_qk_layernorm: bool = key(
        False,
        "Normalise queries and keys before attention (after the projections, before rotary), "
        "with the norm `norm` names; qk_norm_scope says over what.",
    )
    qk_norm_scope: Literal["neox", "head", "width"] = extension(
        "neox",
        "With use_qk_layernorm: neox, GPT-NeoX's one norm shared by queries and keys, with a "
        "weight per head and dimension (rmsnorm per head, layernorm over all heads); head, a "
        "query norm and a key norm over each head's dimensions, shared by the heads (Qwen3); "
        "width, a query norm and a key norm over all heads together (OLMo 2).",
    )
    norm_position: Literal["input", "output"] = extension(
        "input",
        "input: each block normalises what attention and the MLP read (GPT-NeoX, Llama); "
        "output: it normalises what they write, before it joins the residual (OLMo 2's "
        "post-norm), the final norm unchanged.",
    )
    use_bias_in_norms: bool = key(True, "Give layernorm a learned bias.")
    use_bias_in_attn_linear: bool = key(
        True, "Give the QKV and attention output projections biases."
    )
    attention_output_bias: bool | None = extension(
        None,
        "Give the attention output projection a bias; unset follows use_bias_in_attn_linear "
        "(Qwen2 has biases on q, k and v only: use_bias_in_attn_linear true, this false).",
    )
    use_bias_in_mlp: bool = key(True, "Give the MLP projections biases.")
    pos_emb: Literal["learned", "rotary", "sinusoidal", "rpe", "alibi", "none"] = key(
        "learned",
        "Position scheme: learned, rotary, sinusoidal, rpe (T5's relative position buckets), "
        "alibi or none.",
    )
    rotary_pct: float = key(
        1.0, "Fraction of each head's dimensions that rotary embeddings rotate."
    )
    rotary_emb_base: int = key(10000, "Base of the rotary frequencies.", ge=1)
    rope_scaling: dict[str, Any] | None = extension(
        None,
        "Rotary frequency scaling, as Hugging Face's rope_scaling: {type: linear, factor}; "
        "{type: llama3, factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings} (Llama 3.1-3.3); {type: dynamic, factor, "
        "original_max_position_embeddings} (NTK: the base grows with sequences longer than "
        "the original context); {type: yarn, factor, original_max_position_embeddings, and "
        "optionally attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, "
        "truncate} (Qwen, DeepSeek); unset: none.",
    )
    rotary_save_freqs_buffer: bool = no_effect(
        False,
        "Store rotary inverse frequencies in checkpoints.",
        "rotary frequencies are recomputed from rotary_emb_base, never stored",
    )
    rpe_num_buckets: int = key(
        32,
        "Buckets of T5-style relative positions (pos_emb rpe): half exact distances, half "
        "logarithmic up to rpe_max_distance.",
        ge=2,
    )
    rpe_max_distance: int = key(
        128, "Distance from which T5-style relative positions share the last bucket.", ge=1
    )
    opt_pos_emb_offset: int = key(
        0, "Offset added to positions of learned embeddings (2 for OPT checkpoints).", ge=0
    )
    no_weight_tying: bool = key(
        False, "Give the output head its own weights instead of reusing the input embedding."
    )
    make_vocab_size_divisible_by: int = key(
        128, "Pad the vocabulary to a multiple of this (times model_parallel_size).", ge=1
    )
    activation: Literal[
        "gelu",
        "geglu",
        "relu",
        "softsign",
        "swish",
        "mish",
        "silu",
        "reglu",
        "swiglu",
        "bilinear",
        "glu",
    ] = key("gelu", "MLP activation; geglu, reglu, swiglu, bilinear and glu are gated.")
    init_method: InitMethod = key(
        "normal", "Initialisation of every weight but the output projections."
    )
    output_layer_init_method: InitMethod = key(
        "scaled_normal", "Initialisation of the attention output and second MLP projections."
    )
    init_method_std: float = key(0.02, "Standard deviation of the normal initialisations.", gt=0)
    gpt_j_residual: bool = key(
        False, "Parallel residual: attention and MLP both read the block input and are summed."
    )
    gpt_j_tied: bool = key(
        False, "With gpt_j_residual, feed attention and MLP from one shared norm."
    )
    hidden_dropout: float = key(0.0, "Dropout on the outputs of attention and MLP.", ge=0, lt=1)
    attention_dropout: float = key(0.0, "Dropout on attention probabilities.", ge=0, lt=1)
    attention_config: list[Any] | None = key(
        None,
        "Attention type per layer, as [[types, count], ...]; global and flash run as SDPA "
        "attention, the block-sparse types as SDPA or FlexAttention with their layout.",
    )
    sparsity_config: dict[str, Any] | None = key(
        None,
        "Block-sparse layouts of the attention_config types local, sparse_fixed, "
        "sparse_variable, bigbird and bslongformer (block, num_local_blocks, ...; "
        "docs/model.md).",
    )
    output_layer_parallelism: Literal["column"] = key(
        "column", "How the output head is split across tensor ranks (by vocabulary)."
    )
    num_unique_layers: int | None = key(
        None,
        "Share weights between layers, keeping this many distinct blocks (num_layers must be a "
        "multiple of it; docs/training.md).",
        ge=1,
    )
    param_sharing_style: Literal["grouped", "spaced"] = key(
        "grouped",
        "Order of shared layers: grouped (4 layers, 2 unique: 1 2 1 2) or spaced (1 1 2 2).",
    )
    soft_prompt_tuning: dict[str, Any] | None = key(
        None,
        "Train only a soft prompt of n_tokens vectors before the text, freezing the model "
        "(enabled, n_tokens, init_string, init_range; docs/training.md).",
    )
    gmlp_attn_dim: int = key(
        64,
        "Width of the one-head tiny attention of attention_config 'amlp' layers (gmlp layers "
        "have none).",
        ge=1,
    )
    apply_query_key_layer_scaling: bool = no_effect(
        False,
        "Megatron's fp16 trick: divide scores by the layer number, multiply back in the softmax.",
        "it changes nothing mathematically, and SDPA already keeps the softmax in fp32",
    )
    attention_softmax_in_fp32: bool = no_effect(
        False,
        "Compute the attention softmax in fp32.",
        "SDPA computes the softmax in fp32 in every precision",
    )
    fp16_lm_cross_entropy: bool = no_effect(
        False,
        "Compute the language-model loss in fp16.",
        "the loss is always computed in fp32, which is what keeps fp16 runs stable",
    )
    use_cpu_initialization: bool = no_effect(
        False,
        "Initialise weights on the CPU.",
        "weights are built on the meta device and initialised in place, the same on every device",
    )
    onnx_safe: bool = key(
        False,
        "GPT-NeoX's ONNX-safe gelu: x/2 (1 + erf(x / 1.41421)), with its rounded sqrt(2); only "
        "changes the gelu activation.",
    )
    scaled_upper_triang_masked_softmax_fusion: bool = no_effect(
        False, "Fused causal mask + softmax kernel.", FUSED
    )
    scaled_masked_softmax_fusion: bool = no_effect(False, "Fused mask + softmax kernel.", FUSED)
    bias_gelu_fusion: bool = key(
        False,
        "GPT-NeoX's fused bias + gelu kernel, which computes the tanh approximation of gelu "
        "(constant 0.79788456); with activation gelu, true means the tanh gelu, as in GPT-NeoX.",
    )
    bias_dropout_fusion: bool = no_effect(False, "Fused bias + dropout + add kernel.", FUSED)
    rope_fusion: bool = no_effect(False, "Fused rotary embedding kernel.", FUSED)
    layernorm_fusion: bool = no_effect(False, "Fused layernorm kernel.", FUSED)
    rmsnorm_fusion: bool = no_effect(False, "Fused rmsnorm kernel.", FUSED)
    use_flashattn_swiglu: bool = no_effect(False, "flash-attn's swiglu kernel.", FUSED)
    fused_kernels_build_path: str | None = no_effect(
        None, "Where GPT-NeoX builds its fused kernels.", FUSED
    )
    mamba_selective_scan_fusion: bool = key(
        False,
        "Mamba: run the selective scan on mamba-ssm's CUDA kernel where it is installed "
        "(otherwise, and on CPUs, torchneox's parallel scan in PyTorch).",
    )
    mamba_causal_conv_fusion: bool = key(
        False,
        "Mamba: run the causal convolution on causal-conv1d's CUDA kernel where it is "
        "installed (otherwise PyTorch's conv1d).",
    )
    mamba_inner_func_fusion: bool = key(
        False,
        "Mamba: run the whole mixer after in_proj as mamba-ssm's mamba_inner_fn where it is "
        "installed (supersedes the other two; not with mamba_use_bias_in_linears).",
    )
    mamba_selective_fp32_params: bool = key(
        True,
        "Mamba: A_log and D stay fp32 when ZeRO gathers weights in bf16 (the mixer's "
        "weights are gathered in fp32); the scan always computes in fp32.",
    )
    mamba_use_bias_in_conv: bool = key(True, "Mamba: a bias in the depthwise conv1d.")
    mamba_use_bias_in_linears: bool = key(
        False, "Mamba: biases in in_proj, x_proj and out_proj (dt_proj always has one)."
    )
    te_columnparallel: bool = no_effect(
        False, "TransformerEngine's column-parallel linear.", TE_LAYER
    )
    te_rowparallel: bool = no_effect(False, "TransformerEngine's row-parallel linear.", TE_LAYER)
    te_layernorm_mlp: bool = no_effect(
        False, "TransformerEngine's fused layernorm + MLP.", TE_LAYER
    )
    te_mha: bool = no_effect(False, "TransformerEngine's multi-head attention.", TE_LAYER)
    te_fp8_mha: bool = key(
        False,
        "fp8 for the attention's linears (GPT-NeoX's TransformerEngine switch); torchneox runs "
        "it on torchao's float8, tensorwise unless fp8_recipe says otherwise.",
    )
    te_fp8_format: Literal["e4m3", "hybrid"] = key(
        "hybrid",
        "With te_fp8_mha: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 output gradients).",
    )
    te_fp8_wgrad: bool = key(
        True, "With te_fp8_mha: weight gradients in fp8 too (false: in high precision)."
    )
    te_fp8_amax_history_len: int = key(
        1,
        "With te_fp8_mha: length of the amax history; torchao scales from the current one (1).",
        ge=1,
    )
    te_fp8_amax_compute_algo: str = key(
        "most_recent",
        "With te_fp8_mha: how the scale's amax is taken from its history; only most_recent "
        "(torchao's current scaling).",
    )
    te_fp8_margin: int = key(0, "With te_fp8_mha: margin of the fp8 scale; only 0 (torchao).", ge=0)
    dim_att: int | None = key(
        None,
        "RWKV's time-mix width (receptance, key, value, gate, decay); unset: hidden_size. "
        "A multiple of 32 and of num_attention_heads.",
        ge=32,
    )
    head_size: int | None = derived(
        None, "RWKV's head size: dim_att / num_attention_heads (GPT-NeoX overwrites a given value)."
    )
    ffn_dim: int | None = derived(
        None,
        "RWKV's channel-mix width: intermediate_size, else expansion_factor (3.5) x hidden_size, "
        "rounded down to a multiple of 32 (GPT-NeoX overwrites a given value).",
    )
    mtp_num_layers: int = extension(
        0,
        "Multi-token prediction (DeepSeek-V3's MTP): this many modules after the last layer, "
        "module k predicting the token k + 1 positions past the next one from the previous "
        "depth's hidden state and the embedding of the token k ahead, through one block of the "
        "last layer's kind and the shared head; training only (generation leaves them out); "
        "0 (the default): none.",
        ge=0,
    )
    mtp_loss_scaling_factor: float = extension(
        0.1,
        "With mtp_num_layers: the weight lambda of the MTP losses; the loss trained on is the "
        "next-token loss + lambda / mtp_num_layers x the sum of each depth's loss (Megatron's "
        "name and default).",
        ge=0,
    )


@dataclass
class MoEConfig:
    """Mixture-of-experts layers replacing the MLP every moe_expert_interval blocks."""

    moe_num_experts: int = key(1, "Experts per MoE layer; 1 means no MoE layers.", ge=1)
    moe_expert_interval: int = key(1, "Every this many blocks, the MLP is an MoE layer.", ge=1)
    moe_top_k: int = key(1, "Experts each token is sent to.", ge=1)
    moe_router_type: Literal["sinkhorn", "topk"] = key(
        "sinkhorn", "Routing: sinkhorn (balanced, for training) or topk."
    )
    moe_lbl_in_fp32: bool = no_effect(
        False,
        "Compute the load-balancing loss in fp32.",
        "GPT-NeoX reads it nowhere; torchneox computes router probabilities and the "
        "load-balancing loss in fp32 always",
    )
    moe_jitter_eps: float | None = key(
        None, "Multiplicative noise on router inputs while training; unset means none.", ge=0
    )
    expert_parallel_size: int = extension(
        1,
        "Ranks the experts of each MoE layer are split over (a divisor of the data-parallel "
        "size); tokens reach their experts by all-to-all.",
        ge=1,
    )
    moe_renormalize_top_k: bool = extension(
        False,
        "Divide each token's top-k router probabilities by their sum before weighting the "
        "experts (Mixtral; Qwen-MoE's norm_topk_prob); GPT-NeoX does not (false).",
    )
    moe_aux_loss_coeff: float = extension(
        0.0,
        "Weight of Switch Transformer's load-balancing loss added to the training loss; 0 (the "
        "default) adds none, as GPT-NeoX adds none; it is logged as moe_aux_loss either way.",
        ge=0,
    )
    moe_score_func: Literal["softmax", "sigmoid"] = extension(
        "softmax",
        "The top-k router's scores: softmax over the experts (GPT-NeoX, Mixtral, Qwen-MoE) or "
        "each expert's sigmoid (DeepSeek-V3; with moe_renormalize_top_k the chosen k are "
        "divided by their sum).",
    )
    moe_router_bias_update_rate: float = extension(
        0.0,
        "DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the top-k "
        "router's scores to choose the experts (not to weight them), moved by this much after "
        "each step, up for an expert that took fewer than the mean tokens, down for one that "
        "took more (DeepSeek-V3: 0.001); 0 (the default): no bias.",
        ge=0,
    )
    moe_shared_expert_intermediate_size: int = extension(
        0,
        "Shared experts: the width of an always-on MLP every token passes beside its routed "
        "experts (Qwen2-MoE's shared_expert_intermediate_size; DeepSeek's n_shared_experts x "
        "moe_intermediate_size); 0 (the default): none.",
        ge=0,
    )
    moe_intermediate_size: int = extension(
        0,
        "Each routed expert's width, apart from the dense MLPs' (DeepSeek and Qwen-MoE's "
        "moe_intermediate_size; taken as it is, without the gated 2/3 rule); 0 (the default): "
        "the MLP's width, as GPT-NeoX sizes its experts.",
        ge=0,
    )
    moe_first_dense_layers: int = extension(
        0,
        "The first this many blocks keep a dense MLP; MoE layers start after them (DeepSeek-V3's "
        "first_k_dense_replace); 0 (the default): GPT-NeoX's placement by moe_expert_interval.",
        ge=0,
    )
    moe_expert_groups: int = extension(
        1,
        "Group-limited routing (DeepSeek-V3's n_group): the experts fall into this many equal "
        "groups, each scored by the sum of its two best experts' scores (router bias included), "
        "and a token picks its top-k experts only in the best moe_topk_groups groups; 1 (the "
        "default): no groups.",
        ge=1,
    )
    moe_topk_groups: int = extension(
        1, "Group-limited routing: the groups a token's experts may come from (topk_group).", ge=1
    )
    moe_routed_scaling_factor: float = extension(
        1.0,
        "The routed experts' gates are multiplied by this after any renormalisation (DeepSeek-V3's "
        "routed_scaling_factor, 2.5); the shared expert is not scaled.",
        gt=0,
    )
    moe_shared_expert_gate: bool = extension(
        False,
        "Scale the shared expert's output by sigmoid(Linear(hidden_size, 1)) of the token "
        "(Qwen2-MoE's shared_expert_gate).",
    )
