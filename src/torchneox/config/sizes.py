"""Model sizes that follow from the config alone: MLP widths, vocabulary padding, parameter
counts and training FLOPs per token. Used by ``config explain``, MFU and the estimator; the
model (torchneox.models) builds exactly these shapes, and a test holds the two together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from torchneox.config.checks.model import layer_attention_types
from torchneox.config.features.sharing import layer_owners
from torchneox.config.features.soft_prompt import soft_prompt
from torchneox.config.features.sparsity import (
    SPARSE_TYPES,
    Sparsity,
    build_layout,
    causal_density,
    sparsity,
)
from torchneox.config.keys.model import GATED_ACTIVATIONS
from torchneox.config.schema import ModelConfig, MoEConfig, NeoXConfig


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_vocab(vocab_size: int, divisible_by: int, model_parallel_size: int) -> int:
    """GPT-NeoX's padding: up to a multiple of make_vocab_size_divisible_by x tensor ranks."""
    return round_up(vocab_size, divisible_by * model_parallel_size)


@dataclass(frozen=True)
class MLPWidths:
    """``up`` is the first projection's output (both halves when gated), ``down`` the second's input."""

    up: int
    down: int
    gated: bool


def mamba_inner(m: ModelConfig) -> int:
    """Mamba's d_inner as GPT-NeoX sizes it: intermediate_size, else expansion_factor (2)
    times hidden_size."""
    assert m.hidden_size
    return m.intermediate_size or int((m.expansion_factor or 2) * m.hidden_size)


def mlp_widths(m: ModelConfig) -> MLPWidths:
    """GPT-NeoX's sizing rules: 4h by default; gated activations keep the parameter count by
    taking 2/3 of the width for each half; both rounded up to mlp_multiple_of."""
    assert m.hidden_size is not None
    if m.intermediate_size:
        width = m.intermediate_size
    elif m.expansion_factor:
        width = int(m.expansion_factor * m.hidden_size)
    else:
        width = 4 * m.hidden_size
    gated = m.activation in GATED_ACTIVATIONS
    down = width
    if gated:
        width = int(width * 2 / 3)
        down = width // 2
    multiple = m.mlp_multiple_of
    return MLPWidths(up=round_up(width, 2 * multiple), down=round_up(down, multiple), gated=gated)


def head_dim(m: ModelConfig) -> int:
    assert m.hidden_size and m.num_attention_heads
    return m.head_dim or m.hidden_size // m.num_attention_heads


def kv_heads(m: ModelConfig) -> int:
    assert m.num_attention_heads
    return m.num_kv_heads or m.num_attention_heads


def rotary_dims(m: ModelConfig) -> int:
    return int(head_dim(m) * m.rotary_pct) if m.pos_emb == "rotary" else 0


def norm_params(m: ModelConfig) -> int:
    assert m.hidden_size is not None
    if m.norm in ("layernorm", "te_layernorm"):
        return m.hidden_size * (2 if m.use_bias_in_norms else 1)
    if m.norm in ("rmsnorm", "te_rmsnorm"):
        return m.hidden_size
    if m.norm == "scalenorm":
        return 1
    return 0


def qk_norm_params(m: ModelConfig) -> int:
    """One layer's query/key norm parameters (use_qk_layernorm, by qk_norm_scope)."""
    if not m.use_qk_layernorm:
        return 0
    d, heads, kv = head_dim(m), m.num_attention_heads or 0, kv_heads(m)
    widths = {"neox": (heads * d,), "head": (d, d), "width": (heads * d, kv * d)}
    per_weight = 2 if m.norm in ("layernorm", "te_layernorm") and m.use_bias_in_norms else 1
    return per_weight * sum(widths[m.qk_norm_scope])


def is_moe_layer(e: MoEConfig, layer: int) -> bool:
    return (
        e.moe_num_experts > 1
        and layer % e.moe_expert_interval == 0
        and layer >= e.moe_first_dense_layers
    )


@dataclass(frozen=True)
class AttentionCounts:
    """One attention mixer: its parameters (with norms inside it), the weights a token
    multiplies by, and the forward FLOPs per token of its scores and weighted values."""

    params: int
    matmul: int
    mixing: int


def attention_counts(m: ModelConfig, context: int) -> AttentionCounts:
    """Standard attention (q, k, v, out and the query/key norms), or MLA's."""
    assert m.hidden_size and m.num_attention_heads
    if m.mla_kv_lora_rank:
        return mla_counts(m, context)
    h, d = m.hidden_size, head_dim(m)
    kv_width, q_width = kv_heads(m) * d, m.num_attention_heads * d
    attn_bias = m.use_bias_in_attn_linear
    qkv = h * (q_width + 2 * kv_width) + (q_width + 2 * kv_width if attn_bias else 0)
    out_bias = attn_bias if m.attention_output_bias is None else m.attention_output_bias
    params = qkv + q_width * h + (h if out_bias else 0) + qk_norm_params(m)
    # scores (q.k) and the weighted sum of values: 2 matmuls, 2 FLOPs per multiply-add
    scores = 2 * 2 * context * m.num_attention_heads * d
    return AttentionCounts(params, h * (q_width + 2 * kv_width) + q_width * h, scores)


def mla_counts(m: ModelConfig, context: int) -> AttentionCounts:
    """Multi-head latent attention (models/mixers/mla.py): the query path (one projection, or
    down, norm, up), the key-value latent with the shared rotary key, its norm, the up
    projection to each head's keys and values, the output; every key and value is rebuilt
    from the latents in training, so the scores are those of heads x (nope + rope) keys."""
    assert m.hidden_size and m.num_attention_heads
    h, heads, bias = m.hidden_size, m.num_attention_heads, m.use_bias_in_attn_linear
    nope, rope, v = m.mla_qk_nope_head_dim, m.mla_qk_rope_head_dim, m.mla_v_head_dim
    rank, q_rank = m.mla_kv_lora_rank, m.mla_q_lora_rank
    q_width = heads * (nope + rope)
    q_matmul = h * q_rank + q_rank * q_width if q_rank else h * q_width
    matmul = q_matmul + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h
    out_bias = bias if m.attention_output_bias is None else m.attention_output_bias
    biases = (q_rank + rank + rope if bias else 0) + (h if out_bias else 0)
    params = matmul + biases + q_rank + rank  # + the latents' norms
    mixing = 2 * context * heads * (nope + rope + v)
    return AttentionCounts(params, matmul, mixing)


def kv_cache_per_token(m: ModelConfig) -> int:
    """Numbers one attention layer's KV cache keeps per token (over every tensor rank): keys
    and values of every key/value head, or MLA's latent and rotary key."""
    if m.mla_kv_lora_rank:
        return m.mla_kv_lora_rank + m.mla_qk_rope_head_dim
    return 2 * kv_heads(m) * head_dim(m)


@dataclass(frozen=True)
class LayerCounts:
    """One layer's parameters, those a token passes through, and its forward FLOPs per token
    (matmuls: 2 per weight a token meets; mixing: what the sequence adds, as attention's
    scores over ``context`` positions)."""

    params: int
    active: int
    forward_flops: int
    moe: bool = False


def attention_layer(config: NeoXConfig, layer: int) -> LayerCounts:
    """A transformer layer: norms, attention (dense or block-sparse) and its MLP or MoE."""
    m, e = config.model, config.moe
    assert m.hidden_size and m.num_attention_heads and m.seq_length
    h = m.hidden_size
    context = min(m.seq_length, m.sliding_window_width or m.seq_length)
    attention = attention_counts(m, context)
    widths = mlp_widths(m)
    mlp_matmul = h * widths.up + widths.down * h
    mlp = mlp_matmul + ((widths.up + h) if m.use_bias_in_mlp else 0)
    params = norm_params(m) * (1 if m.gpt_j_tied else 2) + attention.params
    forward = 2 * attention.matmul + attention.mixing
    if not is_moe_layer(e, layer):
        return LayerCounts(params + mlp, params + mlp, forward + 2 * mlp_matmul)
    expert_matmul, expert = mlp_matmul, mlp
    if e.moe_intermediate_size:  # experts of their own width
        width, ups = e.moe_intermediate_size, 2 if widths.gated else 1
        expert_matmul = h * width * ups + width * h
        expert = expert_matmul + ((ups * width + h) if m.use_bias_in_mlp else 0)
    router = h * e.moe_num_experts
    shared, shared_matmul = shared_expert(config)
    return LayerCounts(
        params + router + e.moe_num_experts * expert + shared,
        params + router + e.moe_top_k * expert + shared,
        forward + 2 * (router + e.moe_top_k * expert_matmul + shared_matmul),
        moe=True,
    )


def shared_expert(config: NeoXConfig) -> tuple[int, int]:
    """An MoE layer's shared expert (moe_shared_expert_intermediate_size wide, with its
    sigmoid gate): (parameters, weights a token multiplies by); (0, 0) without one."""
    m, e = config.model, config.moe
    width, h = e.moe_shared_expert_intermediate_size, m.hidden_size
    assert h is not None
    if not width:
        return 0, 0
    ups = 2 if m.activation in GATED_ACTIVATIONS else 1
    matmul = h * width * ups + width * h + (h if e.moe_shared_expert_gate else 0)
    return matmul + ((ups * width + h) if m.use_bias_in_mlp else 0), matmul


def gmlp_width(hidden_size: int) -> int:
    """A gMLP block's gating width (each half of its first projection): GPT-NeoX's ff_mult
    4 x hidden_size, whatever intermediate_size, expansion_factor or the activation say."""
    return 4 * hidden_size


def gmlp_layer(config: NeoXConfig, layer: int) -> LayerCounts:
    """A gMLP block (aMLP: with its tiny attention): norm, hidden -> 2ff, the gate's norm,
    the seq x seq spatial projection (computed whole: 2 FLOPs per position and channel), ff ->
    hidden."""
    m = config.model
    assert m.hidden_size and m.seq_length
    h, s, a = m.hidden_size, m.seq_length, m.gmlp_attn_dim
    ff = gmlp_width(h)
    norm = norm_params(m)
    gate_norm = norm if norm <= 1 else norm // h * ff  # scalenorm: one scalar at any width
    matmul = h * 2 * ff + ff * h
    params = norm + matmul + gate_norm + s * s + s
    forward = 2 * matmul + 2 * s * ff
    if layer_attention_types(config)[layer] == "amlp":
        tiny = 2 * ff * 3 * a + a * ff
        params += tiny + 3 * a + ff
        forward += 2 * tiny + 2 * 2 * s * a  # its projections, scores and weighted sum
    return LayerCounts(params, params, forward)


LAYER_COUNTS = {"global": attention_layer, "flash": attention_layer}
LAYER_COUNTS |= {"gmlp": gmlp_layer, "amlp": gmlp_layer}


@dataclass(frozen=True)
class RWKVWidths:
    dim_att: int
    head_size: int
    ffn_dim: int


def rwkv_widths(m: ModelConfig) -> RWKVWidths:
    """GPT-NeoX's RWKV widths: dim_att (hidden_size where unset), heads of dim_att /
    num_attention_heads, and a channel mix of intermediate_size or expansion_factor (3.5) x
    hidden_size, rounded down to a multiple of 32."""
    assert m.hidden_size and m.num_attention_heads
    dim_att = m.dim_att or m.hidden_size
    ffn = m.intermediate_size or int((m.expansion_factor or 3.5) * m.hidden_size)
    return RWKVWidths(dim_att, dim_att // m.num_attention_heads, int(ffn // 32 * 32))


RWKV_MIX_RANK, RWKV_DECAY_RANK = 32, 64
"""The low-rank widths of RWKV-6's five token-shift mixes and of its decay."""


def rwkv_layer(config: NeoXConfig, layer: int) -> LayerCounts:
    """An RWKV-6 layer: ln1, the time mix, ln2, the channel mix. FLOPs: every weight a token
    meets (the projections and low-rank mixes) and the WKV recurrence's state read-out and
    update (2 multiply-adds per state element: 4 x dim_att x head_size)."""
    m = config.model
    assert m.hidden_size
    h, w = m.hidden_size, rwkv_widths(m)
    d, f = w.dim_att, w.ffn_dim
    mixes = 6 * h + h * 5 * RWKV_MIX_RANK + 5 * RWKV_MIX_RANK * h
    decay = d + h * RWKV_DECAY_RANK + RWKV_DECAY_RANK * d
    time_matmul = 5 * RWKV_MIX_RANK * h * 2 + RWKV_DECAY_RANK * (h + d) + 5 * h * d
    time_mix = mixes + decay + d + 5 * h * d + 2 * d  # + bonus u, projections, GroupNorm
    channel_matmul = 2 * h * f + h * h
    params = 4 * h + time_mix + 2 * h + channel_matmul
    forward = 2 * (time_matmul + channel_matmul) + 4 * d * w.head_size
    return LayerCounts(params, params, forward)


LAYER_COUNTS |= {"rwkv": rwkv_layer}


def sparse_attention_layer(config: NeoXConfig, layer: int) -> LayerCounts:
    """A block-sparse attention layer: global attention's parameters; its scores and weighted
    values over the share of the causal (query, key) pairs its layout lets through (a layout
    that keeps every block counts as global attention does)."""
    m = config.model
    assert m.hidden_size and m.num_attention_heads and m.seq_length
    dense = attention_layer(config, layer)
    kind = layer_attention_types(config)[layer]
    context = min(m.seq_length, m.sliding_window_width or m.seq_length)
    scores = attention_counts(m, context).mixing
    spec = sparsity(kind, m.sparsity_config)
    density = layout_density(spec, m.num_attention_heads, m.seq_length, layer)
    return replace(dense, forward_flops=dense.forward_flops - scores + round(scores * density))


@lru_cache(maxsize=256)
def layout_density(spec: Sparsity, heads: int, seq_length: int, layer: int) -> float:
    """The share of causal pairs layer ``layer``'s layout attends to (its heads' mean)."""
    return causal_density(build_layout(spec, heads, seq_length, layer), spec.block)


LAYER_COUNTS |= dict.fromkeys(SPARSE_TYPES, sparse_attention_layer)


MAMBA_STATE, MAMBA_CONV = 16, 4
"""Mamba's state size per channel and convolution width (GPT-NeoX's fixed d_state, d_conv)."""


def mamba_layer(config: NeoXConfig, layer: int) -> LayerCounts:
    """A mamba layer: its norm and mixer (in_proj, conv1d, x_proj, dt_proj, A_log, D,
    out_proj). Forward FLOPs per token: 2 per weight of the four linears and the
    convolution, and the scan's elementwise work, 7 per channel and state (dt x A, its exp,
    decay x h + input, (dt u) x B, C . h) plus 4 per channel (dt x u, D x u and its sum, the
    gate's product); softplus and silu are not counted, as attention's softmax is not."""
    m = config.model
    assert m.hidden_size
    h, d, r, n = m.hidden_size, mamba_inner(m), math.ceil(m.hidden_size / 16), MAMBA_STATE
    matmul = h * 2 * d + d * (r + 2 * n) + r * d + d * h
    biases = (2 * d + (r + 2 * n) + h) if m.mamba_use_bias_in_linears else 0
    conv = d * MAMBA_CONV + (d if m.mamba_use_bias_in_conv else 0)
    params = norm_params(m) + matmul + biases + conv + d + d * n + d  # dt bias, A_log, D
    forward = 2 * (matmul + d * MAMBA_CONV) + d * (7 * n + 4)
    return LayerCounts(params, params, forward)


LAYER_COUNTS |= {"mamba": mamba_layer}
"""Each attention_config layer type's counts (models/block.py's FAMILIES builds them)."""


@dataclass(frozen=True)
class ModelCounts:
    total: int
    embedding: int
    """Input embedding, learned positions and an untied output head."""
    active: int
    """Parameters one token passes through (differs from total only with MoE)."""
    flops_per_token: int
    """Training FLOPs (forward + backward) per token, model FLOPs (no recomputation)."""
    moe_layers: int
    mtp: int = 0
    """The multi-token prediction modules' parameters (in ``total``; training only)."""


def mtp_module(config: NeoXConfig, last: LayerCounts) -> LayerCounts:
    """One MTP module (models/mtp.py): a block of the last layer's kind (``last``), its three
    norms (enorm, hnorm, shared_head.norm) and eh_proj; the shared output head's FLOPs are
    the caller's to add (they depend on the padded vocabulary)."""
    m = config.model
    assert m.hidden_size
    h = m.hidden_size
    own = 3 * norm_params(m) + 2 * h * h
    return LayerCounts(last.params + own, last.active + own, last.forward_flops + 4 * h * h)


def count(config: NeoXConfig, vocab: int) -> ModelCounts:
    """Parameters and training FLOPs per token for the padded vocabulary ``vocab``."""
    m = config.model
    assert m.hidden_size and m.num_layers and m.num_attention_heads and m.seq_length
    h = m.hidden_size
    embedding = vocab * h
    if m.pos_emb == "learned":
        embedding += ((m.max_position_embeddings or m.seq_length) + m.opt_pos_emb_offset) * h
        if config.optimizer.use_bnb_optimizer:  # StableEmbedding's LayerNorm
            embedding += 2 * h
    if m.pos_emb == "rpe":  # one [buckets, heads] table for every layer
        embedding += m.rpe_num_buckets * m.num_attention_heads
    # a reward model's head is one value per position (GPT-NeoX's rm_linear), not the vocabulary
    reward_model = config.training.train_impl == "rm"
    head = h if reward_model else vocab * h
    own_head = m.no_weight_tying or reward_model
    total = embedding + norm_params(m) + (head if own_head else 0)
    prompt = soft_prompt(config)  # soft_prompt_tuning's vectors
    total += prompt.n_tokens * h if prompt is not None else 0
    active = total
    forward = 2 * head
    moe_layers = 0
    owners = layer_owners(config)  # a layer sharing another's weights adds none of its own
    for layer, kind in enumerate(layer_attention_types(config)):
        counts = LAYER_COUNTS[kind](config, layer)
        if not owners or owners[layer] == layer:
            total += counts.params
            active += counts.active
        forward += counts.forward_flops
        moe_layers += counts.moe
    mtp = 0
    if m.mtp_num_layers:  # D modules, each with a block of the last layer's kind
        module = mtp_module(config, counts)
        mtp = m.mtp_num_layers * module.params
        total += mtp
        active += m.mtp_num_layers * module.active
        forward += m.mtp_num_layers * (module.forward_flops + 2 * head)
    return ModelCounts(
        total=total,
        embedding=embedding + (head if own_head else 0),
        active=active,
        flops_per_token=3 * forward,
        moe_layers=moe_layers,
        mtp=mtp,
    )
