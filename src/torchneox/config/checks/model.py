"""The model's checks: sizes and their divisibility, attention types per layer, activations,
positions and rope scaling, mixture of experts."""

from __future__ import annotations

from typing import Any

from torchneox.base.errors import ConfigError, did_you_mean
from torchneox.config.checker import Checker
from torchneox.config.features.sparsity import SPARSE_TYPES, check_sparsity
from torchneox.config.refusals import refusal
from torchneox.config.schema import NeoXConfig

MAX_LAYERS = 100_000  # per-layer lists are built from num_layers; far past any real model
ROPE_SCALING_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
"""Each rope scaling type's required fields."""
ROPE_SCALING_OPTIONAL = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
}
ATTENTION_TYPES_OK = ("global", "flash", "mamba", "gmlp", "amlp", "rwkv", *SPARSE_TYPES)
POSITIONS = {"learned": "learned positions", "sinusoidal": "sinusoidal positions"}
POSITIONS |= {"rpe": "rpe", "alibi": "alibi"}
"""The pos_emb values that are features of config/refusals.py's table, by their name there."""
ATTENTION_TYPES_REFUSED = {
    "ring": "ring attention",
}


def _attention_kinds(attention_config: Any) -> list[str]:
    """The type names an attention_config mentions, however malformed the rest of it is."""
    kinds: list[str] = []
    for item in attention_config if isinstance(attention_config, list) else []:
        if isinstance(item, list | tuple) and item and isinstance(item[0], list | tuple):
            kinds += [k for k in item[0] if isinstance(k, str)]
    return kinds


def _check_model(ch: Checker) -> None:
    m = ch.c.model
    if m.num_layers and m.num_layers > MAX_LAYERS:
        ch.fail("num_layers", f"{m.num_layers:,} layers is more than {MAX_LAYERS:,}; is it a typo?")
    if m.activation == "gelu" and m.onnx_safe and m.bias_gelu_fusion:
        ch.fail(
            "bias_gelu_fusion",
            "cannot be set together with onnx_safe for activation gelu (GPT-NeoX refuses the "
            "pair too); choose one gelu",
        )
    if (
        not m.head_dim
        and m.hidden_size
        and m.num_attention_heads
        and m.hidden_size % m.num_attention_heads
        and not _attention_free(m.attention_config)
    ):
        ch.fail(
            "num_attention_heads",
            f"hidden_size {m.hidden_size} is not divisible by num_attention_heads "
            f"{m.num_attention_heads}; every head needs the same width (or set head_dim)",
        )
    if (
        m.num_kv_heads
        and m.num_attention_heads
        and (m.num_kv_heads > m.num_attention_heads or m.num_attention_heads % m.num_kv_heads)
    ):
        ch.fail(
            "num_kv_heads",
            f"num_attention_heads {m.num_attention_heads} is not a multiple of num_kv_heads "
            f"{m.num_kv_heads}; each key/value head must serve the same number of query heads",
        )
    if m.seq_length and m.max_position_embeddings and m.max_position_embeddings < m.seq_length:
        ch.fail(
            "max_position_embeddings",
            f"{m.max_position_embeddings} is shorter than seq_length {m.seq_length}",
        )
    _check_positions(ch)
    _check_block_layout(ch)
    types = layer_attention_types(ch.c, ch.origin)
    _check_gmlp(ch, types)
    _check_sparsity(ch, types)
    _check_mamba(ch, types)
    if "rwkv" in types:
        _check_rwkv(ch)
    if m.mtp_num_layers:
        _check_mtp(ch)
    if m.mla_kv_lora_rank:
        _check_mla(ch)


def _check_mtp(ch: Checker) -> None:
    """Multi-token prediction is a term of language modelling's loss (train_impl normal)."""
    impl = ch.c.training.train_impl
    if impl != "normal":
        ch.fail("mtp_num_layers", f"with train_impl {impl} {refusal('mtp', impl)}; set it 0")
    sp = ch.c.model.soft_prompt_tuning
    if sp and sp.get("enabled", False):
        reason = refusal("mtp", "soft prompt")
        ch.fail("mtp_num_layers", f"with soft_prompt_tuning {reason}; set one of them off")


def _check_mla(ch: Checker) -> None:
    """Multi-head latent attention: rotary positions of its own sizes, none of the options its
    projections do not have (its attention layers, global or block-sparse, are MLA; the other
    families' layers are their own)."""
    m = ch.c.model
    key = "mla_kv_lora_rank"
    if m.pos_emb != "rotary":
        reason = refusal("mla", POSITIONS.get(m.pos_emb, "rpe"))
        ch.fail("pos_emb", f"{m.pos_emb!r} with MLA ({key}) {reason}; set rotary")
    if m.mla_qk_rope_head_dim % 2:
        ch.fail("mla_qk_rope_head_dim", f"{m.mla_qk_rope_head_dim} is odd; rotary needs pairs")
    refused = (
        ("head_dim", m.head_dim is not None, "mla_qk_nope_head_dim and mla_qk_rope_head_dim"),
        ("num_kv_heads", m.num_kv_heads not in (None, m.num_attention_heads), "one latent"),
        ("rotary_pct", m.rotary_pct != 1.0, "mla_qk_rope_head_dim"),
    )
    for name, given, instead in refused:
        if given:
            ch.fail(name, f"does not apply with MLA ({key}), which has {instead}; unset it")
    for name, given, feature in (
        ("use_qk_layernorm", m.use_qk_layernorm, "qk layernorm"),
        ("use_mup", ch.c.training.use_mup, "mup"),
    ):
        if given:
            ch.fail(name, f"with MLA ({key}) {refusal(feature, 'mla')}; unset it")


def _check_gmlp(ch: Checker, types: list[str]) -> None:
    """gmlp/amlp layers: their spatial gating covers seq_length positions of one sequence."""
    kind = next((k for k in types if k in ("gmlp", "amlp")), None)
    if kind is None:
        return
    m = ch.c.model
    if m.seq_length and m.max_position_embeddings and m.max_position_embeddings > m.seq_length:
        ch.fail(
            "max_position_embeddings",
            f"{m.max_position_embeddings} is longer than seq_length {m.seq_length}, but "
            f"'{kind}' layers mix at most seq_length positions (their seq x seq gating); "
            "leave it unset or equal to seq_length",
        )
    if m.inter_document_attention_masking:
        ch.fail(
            "inter_document_attention_masking",
            f"with '{kind}' layers {refusal('document masking', kind)}; set it false",
        )


def _check_rwkv(ch: Checker) -> None:
    """RWKV's widths, as GPT-NeoX asserts them (multiples of 32, whole heads)."""
    m = ch.c.model
    if not (m.hidden_size and m.num_attention_heads):
        return
    if m.hidden_size % 32:
        ch.fail("hidden_size", f"{m.hidden_size} is not a multiple of 32, as RWKV layers need")
    dim_att = m.dim_att or m.hidden_size
    if dim_att % 32 or dim_att % m.num_attention_heads:
        ch.fail(
            "dim_att" if m.dim_att else "num_attention_heads",
            f"RWKV's dim_att {dim_att} must be a multiple of 32 and of num_attention_heads "
            f"{m.num_attention_heads} (its heads are dim_att / num_attention_heads wide)",
        )
    if m.intermediate_size and m.expansion_factor:
        ch.fail(
            "expansion_factor",
            "RWKV layers take intermediate_size or expansion_factor, not both; unset one",
        )
    ffn = m.intermediate_size or int((m.expansion_factor or 3.5) * m.hidden_size)
    if ffn < 32:
        ch.fail(
            "intermediate_size" if m.intermediate_size else "expansion_factor",
            f"gives RWKV a channel mix of {ffn}, rounded down to a multiple of 32: 0; "
            "make it at least 32",
        )


def _check_sparsity(ch: Checker, kinds: list[str]) -> None:
    """sparsity_config's fields, and DeepSpeed's rules for the sparse layers it lays out."""
    m = ch.c.model
    problem = check_sparsity(m.sparsity_config, kinds, m.seq_length)
    if problem is not None:
        field, message = problem  # the message names the field
        ch.fail("sparsity_config", message, path=field or None)
    sparse = sorted(set(kinds) & set(SPARSE_TYPES))
    if sparse and m.max_position_embeddings and m.max_position_embeddings > (m.seq_length or 0):
        ch.fail(
            "max_position_embeddings",
            f"{m.max_position_embeddings} is longer than seq_length {m.seq_length}, the "
            f"positions the block-sparse layout of '{sparse[0]}' covers (as in GPT-NeoX); set "
            "max_position_embeddings to seq_length",
        )


def _check_mamba(ch: Checker, types: list[str]) -> None:
    """mamba layers: what GPT-NeoX's mamba asserts, and what torchneox's does not build."""
    m = ch.c.model
    mamba = "mamba" in types
    if mamba and m.mamba_inner_func_fusion and m.mamba_use_bias_in_linears:
        ch.fail(
            "mamba_inner_func_fusion",
            "cannot be set with mamba_use_bias_in_linears (mamba-ssm's mamba_inner_fn has no "
            "x_proj bias; GPT-NeoX refuses the pair too); set one of them false",
        )
    if mamba and m.intermediate_size and m.expansion_factor:
        ch.fail(
            "expansion_factor",
            "cannot be set with intermediate_size for mamba layers (d_inner is one or the "
            "other, as GPT-NeoX asserts); remove one",
        )


def _attention_free(attention_config: Any) -> bool:
    """Whether every layer is a mamba layer (GPT-NeoX then ignores num_attention_heads)."""
    kinds = _attention_kinds(attention_config)
    return bool(kinds) and set(kinds) == {"mamba"}


def _check_positions(ch: Checker) -> None:
    m = ch.c.model
    if m.pos_emb == "rpe" and m.rpe_max_distance <= m.rpe_num_buckets // 2:
        ch.fail(
            "rpe_max_distance",
            f"{m.rpe_max_distance} must exceed rpe_num_buckets / 2 = {m.rpe_num_buckets // 2} "
            "(the exact buckets; the logarithmic ones reach up to rpe_max_distance)",
        )
    if m.pos_emb == "rotary" and not _attention_free(m.attention_config):
        if not 0.0 < m.rotary_pct <= 1.0:
            ch.fail("rotary_pct", f"must be in (0, 1], got {m.rotary_pct}")
        if (
            m.hidden_size
            and m.num_attention_heads
            and (m.head_dim or not m.hidden_size % m.num_attention_heads)
        ):
            head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
            rotary_dims = int(head_dim * m.rotary_pct)
            if rotary_dims % 2 or rotary_dims == 0:
                ch.fail(
                    "rotary_pct",
                    f"rotates {rotary_dims} of {head_dim} head dimensions (rotary_pct "
                    f"{m.rotary_pct}); rotary needs an even, non-zero number",
                )


def _check_block_layout(ch: Checker) -> None:
    """Residual, norm placement and query/key norms."""
    m = ch.c.model
    if m.gpt_j_tied and not m.gpt_j_residual:
        ch.fail("gpt_j_tied", "only means something with gpt_j_residual: true")
    if m.norm_position == "output" and m.gpt_j_residual:
        ch.fail(
            "norm_position",
            "'output' (OLMo 2's post-norm) is built for the sequential residual; set "
            "gpt_j_residual: false or norm_position: input",
        )
    if not m.use_qk_layernorm or m.qk_norm_scope != "neox":
        return
    if m.norm not in ("rmsnorm", "layernorm", "te_rmsnorm", "te_layernorm"):
        ch.fail(
            "norm",
            f"{m.norm!r} with use_qk_layernorm and qk_norm_scope neox: GPT-NeoX's shared query/"
            "key norm is built for rmsnorm and layernorm; set qk_norm_scope head or width",
        )
    if m.num_kv_heads and m.num_kv_heads != m.num_attention_heads:
        ch.fail(
            "qk_norm_scope",
            "neox (GPT-NeoX's one norm for queries and keys, which fails there too) cannot "
            f"take {m.num_attention_heads} query heads and {m.num_kv_heads} key heads; set "
            "qk_norm_scope head or width",
        )


def layer_attention_types(config: NeoXConfig, origin: dict[str, str] | None = None) -> list[str]:
    """attention_config expanded to one type per layer, as GPT-NeoX's expand_attention_types
    does: each [[types...], n] entry repeats its pattern n times (``[[["mamba", "global"], 4]]``
    is 8 layers), [[types...], "all"] repeats it over every layer, and a list of names is one
    per layer already."""
    m = config.model
    source = (origin or {}).get("attention_config", "defaults")
    if m.attention_config is None:
        return ["global"] * (m.num_layers or 0)

    def fail(message: str) -> None:
        raise ConfigError(message, source=source, key="attention_config")

    entries = m.attention_config
    if entries and all(isinstance(item, str) for item in entries):  # already one per layer
        entries = [[list(entries), 1]]
    types_per_layer: list[str] = []
    for item in entries:
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], list)):
            fail(f"each entry must be [[types...], count], got {item!r}")
        kinds, count = item
        _check_kinds(kinds, fail)
        if count == "all":
            if len(entries) > 1:  # GPT-NeoX silently drops the other entries
                fail("an entry with 'all' describes every layer; remove the other entries")
            if not m.num_layers:  # a fragment (GPT-NeoX's sparse.yml): laid out once sized
                return []
            if m.num_layers % len(kinds):
                fail(
                    f"'all' repeats {kinds} over {m.num_layers} layers, not a multiple of {len(kinds)}"
                )
            count = m.num_layers // len(kinds)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            fail(f"repeat count must be a positive integer or 'all', got {count!r}")
        if len(types_per_layer) + count * len(kinds) > (m.num_layers or MAX_LAYERS):
            fail(
                f"describes more than {m.num_layers or MAX_LAYERS:,} layers "
                + (f"but num_layers is {m.num_layers}" if m.num_layers else "(num_layers is unset)")
                + " (each entry's pattern is repeated count times, as in GPT-NeoX)"
            )
        types_per_layer.extend(kinds * count)
    if m.num_layers and len(types_per_layer) != m.num_layers:
        fail(
            f"describes {len(types_per_layer)} layers but num_layers is {m.num_layers} (each "
            "entry's pattern is repeated count times, as in GPT-NeoX)"
        )
    return types_per_layer


def _check_kinds(kinds: list, fail) -> None:
    for kind in kinds:
        if not isinstance(kind, str):
            fail(f"attention type {kind!r} is not a name")
        if kind in ATTENTION_TYPES_REFUSED:
            fail(
                f"'{kind}' attention ({ATTENTION_TYPES_REFUSED[kind]}) is not supported; "
                f"use one of {', '.join(ATTENTION_TYPES_OK)}"
            )
        if kind not in ATTENTION_TYPES_OK:
            fail(f"unknown attention type '{kind}'{did_you_mean(kind, ATTENTION_TYPES_OK)}")


def _check_rope_scaling(ch: Checker) -> None:
    spec = ch.c.model.rope_scaling
    if spec is None:
        return
    kind = spec.get("type", spec.get("rope_type"))
    if kind not in ROPE_SCALING_FIELDS:
        ch.fail(
            "rope_scaling",
            f"type {kind!r} is not built; torchneox scales rotary frequencies as "
            + " or ".join(ROPE_SCALING_FIELDS),
        )
    fields = ROPE_SCALING_FIELDS[kind]
    optional = ROPE_SCALING_OPTIONAL.get(kind, ())
    extra = sorted(set(spec) - {"type", "rope_type", *fields, *optional})
    if extra:
        ch.fail(
            "rope_scaling",
            f"{extra[0]!r} is not a field of {kind} scaling ({', '.join(fields + optional)})",
        )
    given = [(n, True) for n in fields] + [(n, False) for n in optional if n in spec]
    for name, required in given:
        value = spec.get(name)
        if value is None and not required:
            continue
        if name == "truncate":
            if not isinstance(value, bool):
                ch.fail(
                    "rope_scaling", f"yarn's truncate is true or false, got {value!r}", path=name
                )
            continue
        number = not isinstance(value, bool) and isinstance(value, int | float)
        if not number or value < 0 or (required and value == 0):
            bound = "> 0" if required else ">= 0"
            ch.fail(
                "rope_scaling", f"{kind} scaling needs {name} {bound}, got {value!r}", path=name
            )
    if kind == "llama3" and spec["high_freq_factor"] <= spec["low_freq_factor"]:
        ch.fail("rope_scaling", "llama3 scaling needs high_freq_factor > low_freq_factor")
    if kind == "dynamic" and _rotary_dims(ch) == 2:
        ch.fail("rope_scaling", "dynamic scaling needs more than 2 rotary dimensions per head")


def _rotary_dims(ch: Checker) -> int:
    m = ch.c.model
    if not (m.hidden_size and m.num_attention_heads):
        return 0
    return int((m.head_dim or m.hidden_size // m.num_attention_heads) * m.rotary_pct)


def _check_moe(ch: Checker) -> None:
    e = ch.c.moe
    if e.moe_num_experts > 1 and e.moe_top_k > e.moe_num_experts:
        ch.fail("moe_top_k", f"{e.moe_top_k} is more than moe_num_experts {e.moe_num_experts}")
    if e.moe_router_type == "sinkhorn":
        for name, value in (
            ("moe_score_func", e.moe_score_func != "softmax"),
            ("moe_router_bias_update_rate", e.moe_router_bias_update_rate > 0),
        ):
            if value:
                ch.fail(name, "applies to the top-k router only; set moe_router_type: topk")
    _check_expert_groups(ch)
    if e.moe_shared_expert_gate and not e.moe_shared_expert_intermediate_size:
        ch.fail(
            "moe_shared_expert_gate",
            "gates a shared expert; set moe_shared_expert_intermediate_size too",
        )


def _check_expert_groups(ch: Checker) -> None:
    """Group-limited routing (DeepSeek-V3's n_group, topk_group)."""
    e = ch.c.moe
    groups, best = e.moe_expert_groups, e.moe_topk_groups
    if groups == 1 and best == 1:
        return
    if e.moe_router_type != "topk":
        ch.fail("moe_expert_groups", "applies to the top-k router only; set moe_router_type: topk")
    if e.moe_num_experts % groups:
        ch.fail(
            "moe_expert_groups", f"{groups} does not divide moe_num_experts {e.moe_num_experts}"
        )
    if best > groups:
        ch.fail("moe_topk_groups", f"{best} is more than moe_expert_groups {groups}")
    if e.moe_top_k > best * (e.moe_num_experts // groups):
        ch.fail(
            "moe_top_k",
            f"{e.moe_top_k} is more than the experts of moe_topk_groups {best} groups hold",
        )
