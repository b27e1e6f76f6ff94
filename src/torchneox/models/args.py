"""ModelArgs: the few numbers and switches the decoder needs, taken from a NeoXConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchneox.base.errors import ConfigError
from torchneox.config.checks.model import layer_attention_types
from torchneox.config.derive import derive
from torchneox.config.features.lora import lora_spec
from torchneox.config.features.sharing import layer_owners
from torchneox.config.features.soft_prompt import soft_prompt
from torchneox.config.features.sparsity import (
    ATTENTION_LAYER_TYPES,
    SPARSE_TYPES,
    Sparsity,
    sparsity,
)
from torchneox.config.load import LoadedConfig
from torchneox.config.schema import NeoXConfig
from torchneox.config.sizes import (
    head_dim,
    kv_heads,
    mamba_inner,
    mlp_widths,
    rotary_dims,
    rwkv_widths,
)


@dataclass(frozen=True)
class MupScales:
    """use_mup's multipliers (models/mup.py applies them) and the base shapes they come from:
    each parameter's base dimensions by name (None: not a width)."""

    base_shapes: tuple[tuple[str, tuple[int | None, ...]], ...]
    width_mult: float
    """The model's width over the base's: the logits' hidden states are divided by it."""
    init_scale: float = 1.0
    attn_temp: float = 1.0
    output_temp: float = 1.0
    embedding_mult: float = 1.0
    file: str | None = None
    """The base shapes file they were read from (what a refusal names)."""

    def base_of(self, name: str) -> tuple[int | None, ...] | None:
        return dict(self.base_shapes).get(name)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    """Rows of the embedding and the output head (the padded vocabulary)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_width: int
    gated: bool
    activation: str
    norm: str
    norm_eps: float
    norm_bias: bool
    attn_bias: bool
    mlp_bias: bool
    pos_emb: str
    rotary_dims: int
    rotary_base: float
    max_positions: int
    pos_offset: int
    tied_embeddings: bool
    parallel_residual: bool
    shared_norm: bool
    hidden_dropout: float
    attention_dropout: float
    sliding_window: int | None
    init_method: str
    output_init_method: str
    init_std: float
    attn_out_bias: bool = True
    """The attention output projection's bias (Qwen2: none, while q, k, v have one)."""
    stable_embedding: bool = False
    """Learned positions through StableEmbedding (a LayerNorm after the lookup):
    use_bnb_optimizer, as GPT-NeoX builds them."""
    rope_scaling: tuple[tuple[str, float], ...] = ()
    """(("type", ...), (field, value), ...): rotary frequency scaling, empty for none."""
    rpe_buckets: int = 32
    rpe_max_distance: int = 128
    """pos_emb rpe: T5's relative position buckets (rpe_num_buckets, rpe_max_distance)."""
    moe_num_experts: int = 1
    moe_top_k: int = 1
    moe_interval: int = 1
    moe_router_type: str = "topk"
    moe_jitter_eps: float | None = None
    moe_renormalize: bool = False
    """Mixtral's gates: each token's top-k probabilities divided by their sum."""
    moe_score_func: str = "softmax"
    """The top-k router's scores: softmax or sigmoid (DeepSeek-V3)."""
    moe_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: the router bias's step (0: no bias)."""
    moe_shared_width: int = 0
    """Shared experts: the width of the always-on MLP beside the routed ones (0: none)."""
    moe_shared_gate: bool = False
    """Qwen2-MoE: the shared expert's output scaled by sigmoid(Linear(h, 1))."""
    moe_expert_width: int = 0
    """Each routed expert's width (0: mlp_width)."""
    moe_first_dense: int = 0
    """The first this many layers keep a dense MLP (DeepSeek-V3's first_k_dense_replace)."""
    moe_groups: int = 1
    moe_topk_groups: int = 1
    """Group-limited routing: experts in moe_groups groups, chosen from the best moe_topk_groups."""
    moe_routed_scale: float = 1.0
    """The routed experts' gates multiplied by this (DeepSeek-V3's routed_scaling_factor)."""
    mla_kv_rank: int = 0
    """Multi-head latent attention (models/mixers/mla.py): the key-value latent's width (0: no MLA)."""
    mla_q_rank: int = 0
    """MLA: the query latent's width (0: queries straight from the hidden state)."""
    mla_nope_dim: int = 0
    mla_rope_dim: int = 0
    mla_v_dim: int = 0
    """MLA: each head's query/key dimensions without and with rotary positions, and its values'."""
    qk_norm: str | None = None
    """Query/key normalisation: None, or its qk_norm_scope (neox, head, width)."""
    norm_position: str = "input"
    """input: pre-norm; output: each sublayer's output normalised (OLMo 2)."""
    value_head: bool = False
    """A reward model (train_impl rm): the head gives one value per position, not logits."""
    cpu_matmul: str = "auto"
    """The kernel of fp32 CPU linears (models/linear.py); build_model selects it."""
    lora_rank: int = 0
    """LoRA adapters' rank (0: none), on the lora_targets of every block (config/features/lora.py)."""
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    """torchneox's names of the adapted layers (attention.wq, mlp.down, ...)."""
    lora_base_dtype: str = "fp32"
    """How the frozen base's linear weights are stored (bf16: in bfloat16, config/features/lora.py)."""
    mtp_depth: int = 0
    """Multi-token prediction modules after the last layer (mtp_num_layers; 0: none)."""

    layer_types: tuple[str, ...] = ()
    """Each layer's attention_config type (global, flash, a sparse type, mamba, rwkv, gmlp,
    amlp); empty: every layer global."""
    seq_length: int = 0
    """The training sequence length (gMLP's spatial gating is a seq x seq matrix)."""
    gmlp_attn_dim: int = 64
    """The width of an amlp layer's one-head tiny attention."""
    rwkv_dim_att: int = 0
    """RWKV's time-mix width (dim_att; heads of dim_att / num_attention_heads)."""
    rwkv_ffn_dim: int = 0
    """RWKV's channel-mix width."""
    sparsity_config: tuple[tuple[str, Any], ...] = ()
    """sparsity_config's fields (lists as tuples): the block-sparse layers' layouts."""
    mamba_inner: int = 0
    """Mamba: d_inner (intermediate_size, else expansion_factor (2) x hidden_size)."""
    mamba_dt_rank: int = 0
    """Mamba: dt_proj's rank, ceil(hidden_size / 16)."""
    mamba_conv_bias: bool = True
    mamba_linear_bias: bool = False
    """Mamba: biases of in_proj, x_proj and out_proj (mamba_use_bias_in_linears)."""
    mamba_fp32_params: bool = True
    """Mamba: A_log and D stay fp32 when ZeRO gathers weights in bf16."""
    mamba_fusion: tuple[str, ...] = ()
    """Mamba: the CUDA kernels the fusion keys ask for (scan, conv, inner)."""
    rp_embedding_mult: float = 1.0
    """Learned or sinusoidal position embeddings multiplied by this (mup_rp_embedding_mult)."""
    mup: MupScales | None = None
    """use_mup's multipliers (None: the standard parametrisation)."""

    @property
    def attention_scale(self) -> float | None:
        """The attention scores' multiplier: muP's 1/(d x mup_attn_temp); None: SDPA's
        1/sqrt(d)."""
        if self.mup is None:
            return None
        return 1.0 / (self.head_dim * self.mup.attn_temp)

    layer_owners: tuple[int, ...] = ()
    """Layer weight sharing: per layer, the layer whose parameters it holds (itself for an
    owner); empty: nothing shared (config/features/sharing.py)."""
    soft_prompt_tokens: int = 0
    """soft_prompt_tuning: the trained vectors before the text (0: none)."""
    soft_prompt_range: float = 0.5
    """soft_prompt_tuning's init_range: the prompt drawn uniform in [-range, range]."""

    @property
    def mla(self) -> bool:
        """Whether attention layers are multi-head latent attention."""
        return self.mla_kv_rank > 0

    @property
    def expert_width(self) -> int:
        """A routed expert's width."""
        return self.moe_expert_width or self.mlp_width

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "global"

    def is_attention_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` is attention (global, flash or block-sparse): what holds
        keys and values in a KV cache."""
        return self.layer_type(layer) in ATTENTION_LAYER_TYPES

    def sparsity(self, layer: int) -> Sparsity | None:
        """Layer ``layer``'s block-sparse layout settings (None: not a block-sparse layer)."""
        kind = self.layer_type(layer)
        if kind not in SPARSE_TYPES:
            return None
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in self.sparsity_config}
        return sparsity(kind, fields)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (an attention layer's, as
        GPT-NeoX places them: every moe_expert_interval-th layer)."""
        return (
            self.moe_num_experts > 1
            and layer % self.moe_interval == 0
            and layer >= self.moe_first_dense
            and self.is_attention_layer(layer)
        )

    @classmethod
    def from_config(cls, cfg: NeoXConfig, vocab_size: int) -> ModelArgs:
        m = cfg.model
        _require_sizes(cfg)
        widths = mlp_widths(cfg.model)
        norm = {"te_layernorm": "layernorm", "te_rmsnorm": "rmsnorm"}.get(m.norm, m.norm)
        epsilons = {"rmsnorm": m.rms_norm_epsilon, "scalenorm": m.scalenorm_epsilon}
        eps = epsilons.get(norm, m.layernorm_epsilon)
        fields = dict(
            vocab_size=vocab_size,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_attention_heads,
            num_kv_heads=kv_heads(cfg.model),
            head_dim=head_dim(cfg.model),
            mlp_width=widths.down,
            gated=widths.gated,
            activation=activation(cfg),
            norm=norm,
            norm_eps=eps,
            norm_bias=m.use_bias_in_norms,
            attn_bias=m.use_bias_in_attn_linear,
            attn_out_bias=(
                m.use_bias_in_attn_linear
                if m.attention_output_bias is None
                else m.attention_output_bias
            ),
            mlp_bias=m.use_bias_in_mlp,
            **_positions(cfg),
            stable_embedding=cfg.optimizer.use_bnb_optimizer,
            tied_embeddings=not m.no_weight_tying,
            parallel_residual=m.gpt_j_residual,
            shared_norm=m.gpt_j_tied,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            sliding_window=m.sliding_window_width,
            init_method=m.init_method,
            output_init_method=m.output_layer_init_method,
            init_std=m.init_method_std,
            moe_num_experts=cfg.moe.moe_num_experts,
            moe_top_k=cfg.moe.moe_top_k,
            moe_interval=cfg.moe.moe_expert_interval,
            moe_router_type=cfg.moe.moe_router_type,
            moe_jitter_eps=cfg.moe.moe_jitter_eps,
            moe_renormalize=cfg.moe.moe_renormalize_top_k,
            moe_score_func=cfg.moe.moe_score_func,
            moe_bias_update_rate=cfg.moe.moe_router_bias_update_rate,
            moe_shared_width=cfg.moe.moe_shared_expert_intermediate_size,
            moe_shared_gate=cfg.moe.moe_shared_expert_gate,
            **_moe_extras(cfg),
            qk_norm=m.qk_norm_scope if m.use_qk_layernorm else None,
            norm_position=m.norm_position,
            value_head=cfg.training.train_impl == "rm",
            mtp_depth=m.mtp_num_layers,
            cpu_matmul=cfg.precision.cpu_matmul,
            **_lora(cfg),
            **(_layer_families(cfg) | _mup_fields(cfg)),
        )
        return cls(**(fields | _mla(cfg)))


def _moe_extras(cfg: NeoXConfig) -> dict:
    """torchneox's expert sizing and DeepSeek-V3's routing (ModelArgs' fields by name)."""
    e = cfg.moe
    return {
        "moe_expert_width": e.moe_intermediate_size,
        "moe_first_dense": e.moe_first_dense_layers,
        "moe_groups": e.moe_expert_groups,
        "moe_topk_groups": e.moe_topk_groups,
        "moe_routed_scale": e.moe_routed_scaling_factor,
    }


def _mla(cfg: NeoXConfig) -> dict:
    """Multi-head latent attention's sizes; under it every head is its own key head, of
    qk_nope + qk_rope dimensions, the last qk_rope of them rotary (ModelArgs' fields by name)."""
    m = cfg.model
    if not m.mla_kv_lora_rank:
        return {}
    nope, rope = m.mla_qk_nope_head_dim, m.mla_qk_rope_head_dim
    return {
        "mla_kv_rank": m.mla_kv_lora_rank,
        "mla_q_rank": m.mla_q_lora_rank,
        "mla_nope_dim": nope,
        "mla_rope_dim": rope,
        "mla_v_dim": m.mla_v_head_dim,
        "head_dim": nope + rope,
        "num_kv_heads": m.num_attention_heads,
        "rotary_dims": rope,
    }


def _lora(cfg: NeoXConfig) -> dict:
    """The adapters (ModelArgs' lora fields by name); none without the lora key."""
    spec = lora_spec(cfg)
    if spec is None:
        return {}
    return {
        "lora_rank": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "lora_targets": spec.targets,
        "lora_base_dtype": spec.base_dtype,
    }


def _positions(cfg: NeoXConfig) -> dict:
    """The position scheme and what it reads (ModelArgs' fields by name)."""
    m = cfg.model
    return {
        "pos_emb": m.pos_emb,
        "rotary_dims": rotary_dims(cfg.model),
        "rotary_base": float(m.rotary_emb_base),
        "rope_scaling": _rope_scaling(m.rope_scaling),
        "max_positions": m.max_position_embeddings or m.seq_length,
        "pos_offset": m.opt_pos_emb_offset,
        "rpe_buckets": m.rpe_num_buckets,
        "rpe_max_distance": m.rpe_max_distance,
    }


def _mup_fields(cfg: NeoXConfig) -> dict[str, Any]:
    """mup_rp_embedding_mult (applied with or without muP, as GPT-NeoX does) and use_mup's
    multipliers, the base shapes read from base_shapes_file (None: no muP)."""
    t = cfg.training
    out: dict[str, Any] = {"rp_embedding_mult": t.mup_rp_embedding_mult, "mup": None}
    if not t.use_mup:
        return out
    from torchneox.config.features.mup import read_base_shapes, width_mult

    if not t.base_shapes_file:
        raise ConfigError("use_mup needs base_shapes_file", key="base_shapes_file")
    shapes = read_base_shapes(t.base_shapes_file)
    out["mup"] = MupScales(
        tuple((k, tuple(v)) for k, v in sorted(shapes.items())),
        width_mult(cfg.model.hidden_size, shapes),
        t.mup_init_scale,
        t.mup_attn_temp,
        t.mup_output_temp,
        t.mup_embedding_mult,
        t.base_shapes_file,
    )
    return out


def _require_sizes(cfg: NeoXConfig) -> None:
    missing = [
        k
        for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
        if cfg.get(k) is None
    ]
    if missing:
        raise ConfigError(f"the model needs {', '.join(missing)}", key=missing[0])


def _soft_prompt(cfg: NeoXConfig) -> dict:
    spec = soft_prompt(cfg)
    if spec is None:
        return {}
    return {"soft_prompt_tokens": spec.n_tokens, "soft_prompt_range": spec.init_range}


def _layer_families(cfg: NeoXConfig) -> dict:
    """The layer types and what their families read (ModelArgs' fields by name)."""
    m = cfg.model
    types = tuple(layer_attention_types(cfg))
    out = {"layer_types": types, "seq_length": cfg.model.seq_length}
    out |= {"layer_owners": layer_owners(cfg), **_soft_prompt(cfg)}  # sharing; soft prompt
    if "rwkv" in types:
        widths = rwkv_widths(cfg.model)
        out |= {"rwkv_dim_att": widths.dim_att, "rwkv_ffn_dim": widths.ffn_dim}
    out["gmlp_attn_dim"] = cfg.model.gmlp_attn_dim
    sparse = cfg.model.sparsity_config or {}
    out["sparsity_config"] = tuple(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(sparse.items())
    )
    fusion = {
        "scan": m.mamba_selective_scan_fusion,
        "conv": m.mamba_causal_conv_fusion,
        "inner": m.mamba_inner_func_fusion,
    }
    return out | {
        "mamba_inner": mamba_inner(m) if m.hidden_size else 0,
        "mamba_dt_rank": math.ceil(m.hidden_size / 16) if m.hidden_size else 0,
        "mamba_conv_bias": m.mamba_use_bias_in_conv,
        "mamba_linear_bias": m.mamba_use_bias_in_linears,
        "mamba_fp32_params": m.mamba_selective_fp32_params,
        "mamba_fusion": tuple(k for k, on in fusion.items() if on),
    }


def _rope_scaling(spec: dict | None) -> tuple[tuple[str, float], ...]:
    if not spec:
        return ()
    kind = spec.get("type", spec.get("rope_type"))
    return (
        ("type", kind),
        *sorted((k, float(v)) for k, v in spec.items() if k not in ("type", "rope_type")),
    )


def activation(cfg: NeoXConfig) -> str:
    """The activation GPT-NeoX computes: its plain gelu is the tanh approximation under
    bias_gelu_fusion (every Pythia config sets it) and erf with a rounded sqrt(2) under
    onnx_safe; other activations ignore both switches."""
    m = cfg.model
    if m.activation != "gelu":
        return m.activation
    return "gelu_onnx" if m.onnx_safe else "gelu_tanh" if m.bias_gelu_fusion else "gelu"


def model_args(loaded: LoadedConfig) -> ModelArgs:
    """ModelArgs of a loaded config, with the padded vocabulary explain derives."""
    return ModelArgs.from_config(loaded.config, derive(loaded)["padded_vocab_size"])
