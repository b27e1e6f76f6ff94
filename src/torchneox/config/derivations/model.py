"""The model's derived values: the padded vocabulary, head and MLP sizes, rotary dimensions,
the residual form, the attention, and the parameter and FLOP counts (config/sizes.py)."""

from __future__ import annotations

import importlib.util
import math
from decimal import Decimal

from torchneox.base.errors import ConfigError
from torchneox.config import sizes
from torchneox.config.checks.model import layer_attention_types
from torchneox.config.derived import Derived
from torchneox.config.features.lora import adapter_parameters, lora_spec
from torchneox.config.features.lora import describe as describe_lora
from torchneox.config.features.mup import derive_mup
from torchneox.config.features.sharing import layer_owners
from torchneox.config.features.soft_prompt import soft_prompt
from torchneox.config.features.sparsity import ATTENTION_LAYER_TYPES, SPARSE_TYPES, sparsity
from torchneox.config.load import LoadedConfig
from torchneox.config.schema import ModelConfig, NeoXConfig
from torchneox.config.vocab import GPT2_VOCAB, tokenizer_vocab_size

MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _vocab(loaded: LoadedConfig, out: Derived) -> int:
    cfg = loaded.config
    m, mp = cfg.model, cfg.parallel.model_parallel_size
    info = tokenizer_vocab_size(cfg)
    if cfg.tokenizer.padded_vocab_size is not None:
        padded = cfg.tokenizer.padded_vocab_size
        if info.exact and info.size is not None and padded < info.size:
            raise ConfigError(
                f"{padded} is smaller than the tokenizer's vocabulary ({info.size})",
                source=loaded.source("padded_vocab_size"),
                key="padded_vocab_size",
            )
        out.put("vocab_size", info.size, info.reason)
        return out.put("padded_vocab_size", padded, f"{padded}, as given")
    vocab, why = info.size, info.reason
    if vocab is None:
        vocab = GPT2_VOCAB
        why += f"; assuming GPT-2's {GPT2_VOCAB} tokens for the sizes below"
        out.notes.append(
            f"vocabulary size assumed to be {GPT2_VOCAB}: make vocab_file readable or give "
            "padded_vocab_size for exact parameter counts"
        )
    out.put("vocab_size", vocab, why)
    multiple = m.make_vocab_size_divisible_by * mp
    padded = sizes.padded_vocab(vocab, m.make_vocab_size_divisible_by, mp)
    return out.put(
        "padded_vocab_size",
        padded,
        f"{padded}: {vocab} rounded up to a multiple of make_vocab_size_divisible_by "
        f"{m.make_vocab_size_divisible_by} x model_parallel_size {mp} = {multiple}",
    )


def derive_model(loaded: LoadedConfig, out: Derived) -> None:
    """The padded vocabulary, the model's shapes, its parameters and FLOPs per token."""
    cfg = loaded.config
    padded = _vocab(loaded, out)
    derive_mup(loaded, out)
    missing = [k for k in MODEL_KEYS if cfg.get(k) is None]
    if missing:
        why = f"unknown: {', '.join(missing)} not set"
        out.put("num_parameters", None, why)
        out.put("flops_per_token", None, why)
        return
    _shapes(loaded, out)
    _counts(cfg, out, padded)
    _sharing_and_prompt(cfg, out)
    if (spec := lora_spec(cfg)) is not None:
        count = adapter_parameters(cfg, spec)
        out.put("lora_trainable_parameters", count, describe_lora(cfg, spec))


def _sharing_and_prompt(cfg: NeoXConfig, out: Derived) -> None:
    """What num_unique_layers and soft_prompt_tuning do to the model (the counts above hold
    each shared tensor once, and the prompt)."""
    m = cfg.model
    held = layer_owners(cfg)
    if held:
        order = " ".join(str(sorted(set(held)).index(o) + 1) for o in held)
        out.put(
            "layer_sharing",
            m.num_unique_layers,
            f"{m.num_layers} layers hold {m.num_unique_layers} distinct blocks "
            f"({m.param_sharing_style}: {order}); each shared tensor is one parameter",
        )
    spec = soft_prompt(cfg)
    if spec is not None:
        trained = spec.n_tokens * (m.hidden_size or 0)
        alone = "the prompt alone"
        if cfg.training.train_impl == "rm":  # the value head trains beside it
            trained += m.hidden_size or 0
            alone = "the prompt and the reward model's value head, which trains beside it"
        out.put(
            "trainable_parameters",
            trained,
            f"{trained:,}: soft_prompt_tuning's {spec.describe()}; the optimizer holds state "
            f"for {alone}",
        )


def _shapes(loaded: LoadedConfig, out: Derived) -> None:
    cfg = loaded.config
    m = cfg.model
    d, kv = sizes.head_dim(cfg.model), sizes.kv_heads(cfg.model)
    if not m.mla_kv_lora_rank:
        out.put(
            "head_dim",
            d,
            f"{d} = hidden_size {m.hidden_size} / num_attention_heads {m.num_attention_heads}",
        )
    attention = (
        "multi-head"
        if kv == m.num_attention_heads
        else ("multi-query" if kv == 1 else "grouped-query")
    )
    if m.mla_kv_lora_rank:
        _mla(cfg, out)
    else:
        out.put("num_kv_heads", kv, f"{kv}: {attention} attention")
    widths = sizes.mlp_widths(cfg.model)
    how = (
        f"gated {m.activation}: two halves of {widths.down}" if widths.gated else f"{m.activation}"
    )
    out.put("mlp_width", widths.down, f"{widths.down} ({how}; GPT-NeoX's sizing rules)")
    if m.pos_emb == "rotary" and not m.mla_kv_lora_rank:
        r = sizes.rotary_dims(cfg.model)
        out.put(
            "rotary_dims",
            r,
            f"{r} of {d} head dimensions (rotary_pct {m.rotary_pct}), rotate-half layout",
        )
    residual = (
        "parallel (GPT-J): x + attn(norm(x)) + mlp(norm(x))"
        if m.gpt_j_residual
        else ("sequential: x + attn(norm(x)), then + mlp(norm(.))")
    )
    out.put("residual", "parallel" if m.gpt_j_residual else "sequential", residual)
    _layers(cfg, layer_attention_types(cfg, loaded.origin), out)


def _layers(cfg: NeoXConfig, kinds: list[str], out: Derived) -> None:
    """The attention line, the layer types as runs, and each family's own line."""
    m = cfg.model
    attention = sum(k in ATTENTION_LAYER_TYPES for k in kinds)
    sparse = sum(k in SPARSE_TYPES for k in kinds)
    if attention:
        out.put(
            "attention",
            "sdpa" + (f", window {m.sliding_window_width}" if m.sliding_window_width else ""),
            "causal scaled_dot_product_attention on "
            + (f"all {attention}" if attention == len(kinds) else f"{attention} of {len(kinds)}")
            + " layers"
            + (" ('flash' and 'global' alike)" if m.attention_config else "")
            + (f", {sparse} of them block-sparse (sparse_layouts)" if sparse else ""),
        )
    else:
        out.put("attention", "none", "no layer of attention_config is an attention layer")
    if set(kinds) - {"global", "flash"}:
        out.put(
            "layers",
            layer_runs(kinds),
            "attention_config, layer by layer: "
            + ", ".join(
                dict.fromkeys(
                    LAYER_TEXT.get(kind, f"{kind}: block-sparse attention (sparse_layouts)")
                    for kind in kinds
                )
            ),
        )
    if attention:
        _kv_cache(cfg, attention, out)
    _gmlp(cfg, kinds, out)
    _sparse_layouts(cfg, kinds, out)
    if "mamba" in kinds:
        _mamba(cfg, out, kinds.count("mamba"))
    if "rwkv" in kinds:
        _rwkv(cfg, kinds.count("rwkv"), out)


def _mla(cfg: NeoXConfig, out: Derived) -> None:
    m = cfg.model
    nope, rope, v = m.mla_qk_nope_head_dim, m.mla_qk_rope_head_dim, m.mla_v_head_dim
    queries = (
        f"queries through a {m.mla_q_lora_rank}-wide latent" if m.mla_q_lora_rank else "queries"
    )
    out.put(
        "mla",
        f"kv latent {m.mla_kv_lora_rank}, heads {nope}+{rope}/{v}",
        f"multi-head latent attention: {queries}; keys and values of {m.num_attention_heads} "
        f"heads from a {m.mla_kv_lora_rank}-wide latent (RMSNorm); each head's keys {nope} "
        f"dimensions without positions and {rope} rotary ones shared by all heads, values {v}; "
        f"scores scaled by 1/sqrt({nope + rope})",
    )


def _kv_cache(cfg: NeoXConfig, layers: int, out: Derived) -> None:
    """What decoding keeps per token, in the precision's dtype."""
    m = cfg.model
    numbers = layers * sizes.kv_cache_per_token(m)
    width = 4 if out.get("precision") == "fp32" else 2
    what = (
        f"the {m.mla_kv_lora_rank}-wide latent and the {m.mla_qk_rope_head_dim} rotary key dimensions"
        if m.mla_kv_lora_rank
        else f"keys and values of {sizes.kv_heads(m)} heads of {sizes.head_dim(m)}"
    )
    out.put(
        "kv_cache_bytes_per_token",
        numbers * width,
        f"{numbers * width:,}: {layers} attention layers x {what} "
        f"({sizes.kv_cache_per_token(m)} numbers) x {width} bytes",
    )


def _gmlp(cfg: NeoXConfig, kinds: list[str], out: Derived) -> None:
    m = cfg.model
    gmlp, amlp = kinds.count("gmlp"), kinds.count("amlp")
    if not gmlp + amlp:
        return
    ff = sizes.gmlp_width(m.hidden_size)
    tiny = f", {amlp} aMLP with a one-head attention of width {m.gmlp_attn_dim}" if amlp else ""
    out.put(
        "gmlp",
        gmlp + amlp,
        f"{gmlp + amlp} of {len(kinds)} layers are gMLP blocks{tiny}: x + gmlp(norm(x)), "
        f"gating width {ff} (4 x hidden_size), a causal {m.seq_length} x {m.seq_length} "
        "spatial projection, no MLP",
    )


def _mamba(cfg: NeoXConfig, out: Derived, layers: int) -> None:
    """The mamba layers' shapes and which kernels run them (the fusion keys ask for CUDA
    kernels that may not be installed)."""
    m = cfg.model
    d = sizes.mamba_inner(m)
    source = (
        f"intermediate_size {d}"
        if m.intermediate_size
        else f"expansion_factor {m.expansion_factor or 2} x hidden_size {m.hidden_size}"
    )
    out.put(
        "mamba",
        f"{layers} layer{'s' * (layers > 1)}, d_inner {d}",
        f"{layers} mamba layer{'s' * (layers > 1)}: d_inner {d} ({source}), dt_rank {math.ceil(m.hidden_size / 16)}, "
        f"state {sizes.MAMBA_STATE}, conv {sizes.MAMBA_CONV}; {mamba_kernels(m)}",
    )


def mamba_kernels(m: ModelConfig, device_type: str | None = None) -> str:
    """What runs mamba's convolution and scan, in one line (on ``device_type``, or wherever
    the run lands)."""
    asked = [
        k
        for k in (
            "mamba_inner_func_fusion",
            "mamba_selective_scan_fusion",
            "mamba_causal_conv_fusion",
        )
        if getattr(m, k)
    ]
    ours = "torchneox's parallel scan and torch's conv1d"
    if not asked:
        return f"{ours} on every device (no fusion key set)"
    if not all(importlib.util.find_spec(p) for p in ("mamba_ssm", "causal_conv1d")):
        return (
            f"{asked[0]} is set but mamba-ssm / causal-conv1d are not installed: {ours} run instead"
        )
    if device_type not in (None, "cuda"):
        return f"{asked[0]} is set but the kernels are CUDA's: on {device_type} {ours} run instead"
    return (
        f"{', '.join(asked)}: mamba-ssm / causal-conv1d's kernels on CUDA for training forwards; "
        f"{ours} on CPUs and when decoding"
    )


def _sparse_layouts(cfg: NeoXConfig, kinds: list[str], out: Derived) -> None:
    """Each block-sparse layer's type and the share of causal pairs its layout attends to."""
    m = cfg.model
    layers = [(i, kind) for i, kind in enumerate(kinds) if kind in SPARSE_TYPES]
    if not layers:
        return
    groups: dict[str, list[str]] = {}  # "type share" -> its layers
    for i, kind in layers:
        spec = sparsity(kind, m.sparsity_config)
        density = sizes.layout_density(spec, m.num_attention_heads, m.seq_length, i)
        groups.setdefault(f"{kind} {density:.1%}", []).append(str(i))
    shares = [f"{text} (layer{'s' * (len(at) > 1)} {', '.join(at)})" for text, at in groups.items()]
    block = sparsity(layers[0][1], m.sparsity_config).block
    out.put(
        "sparse_layouts",
        ", ".join(shares),
        f"each sparse type and the share of the causal (query, key) pairs its block layout "
        f"attends to (block {block}, DeepSpeed's layouts; each layer draws its own random "
        "blocks); the FLOPs count only those pairs",
    )


def _rwkv(cfg: NeoXConfig, layers: int, out: Derived) -> None:
    w = sizes.rwkv_widths(cfg.model)
    out.put(
        "rwkv",
        f"{layers} layer{'s' * (layers > 1)}",
        f"{layers} RWKV-6 layer{'s' * (layers > 1)}: dim_att {w.dim_att} ({cfg.model.num_attention_heads} heads of "
        f"{w.head_size}), channel mix {w.ffn_dim} (GPT-NeoX's rules), ln1/ln2 LayerNorm eps 1e-5",
    )


LAYER_TEXT = {
    "global": "global/flash: x + attention(norm(x)), then + mlp(norm(.))",
    "flash": "global/flash: x + attention(norm(x)), then + mlp(norm(.))",
    "mamba": "mamba: x + mamba(norm(x)) (selective state space, no MLP)",
    "rwkv": "rwkv: x + time_mix(norm(x)), then + channel_mix(norm(.)) (RWKV-6)",
    "gmlp": "gmlp: spatial gating over the sequence, no attention",
    "amlp": "amlp: gMLP's spatial gating with a one-head tiny attention",
}
"""What each attention_config type builds (a block-sparse type: attention with its layout)."""


def layer_runs(kinds: list[str]) -> str:
    """The layer types as runs of consecutive layers: '0-1 mamba, 2 global, 3 mamba'."""
    runs: list[tuple[int, int, str]] = []
    for i, kind in enumerate(kinds):
        if runs and runs[-1][2] == kind:
            runs[-1] = (runs[-1][0], i, kind)
        else:
            runs.append((i, i, kind))
    return ", ".join(f"{a}-{b} {k}" if b > a else f"{a} {k}" for a, b, k in runs)


def _expert_text(cfg: NeoXConfig) -> str:
    """DeepSeek-V3's expert options, as explain names them (empty without them)."""
    e, parts = cfg.moe, []
    if e.moe_intermediate_size:
        parts.append(f"experts {e.moe_intermediate_size} wide")
    if e.moe_expert_groups > 1:
        parts.append(f"from the best {e.moe_topk_groups} of {e.moe_expert_groups} groups")
    if e.moe_first_dense_layers:
        parts.append(f"after {e.moe_first_dense_layers} dense layers")
    return "".join(f", {p}" for p in parts)


def _shared_text(cfg: NeoXConfig) -> str:
    """What explain says of the MoE layers' shared expert (empty without one)."""
    params, _ = sizes.shared_expert(cfg)
    if not params:
        return ""
    gate = ", sigmoid-gated" if cfg.moe.moe_shared_expert_gate else ""
    return f", and a shared expert of {params:,} parameters each ({_human(params)}{gate})"


def _counts(cfg: NeoXConfig, out: Derived, padded: int) -> None:
    m = cfg.model
    counts = sizes.count(cfg, padded)
    tied = "tied to the embedding" if not m.no_weight_tying else "its own weights"
    out.put(
        "num_parameters",
        counts.total,
        f"{counts.total:,} ({_human(counts.total)}), of which {counts.embedding:,} in embeddings; "
        f"output head {tied}"
        + (
            f"; {counts.mtp:,} in {m.mtp_num_layers} MTP modules (training only)" * bool(counts.mtp)
        ),
    )
    if counts.moe_layers:
        out.put(
            "num_active_parameters",
            counts.active,
            f"{counts.active:,} ({_human(counts.active)}) reach each token: {counts.moe_layers} MoE "
            f"layers of {cfg.moe.moe_num_experts} experts, top-{cfg.moe.moe_top_k}"
            + _expert_text(cfg)
            + _shared_text(cfg),
        )
    kinds = layer_attention_types(cfg)
    mixing = [
        f"attention scores over {min(m.seq_length, m.sliding_window_width or m.seq_length)} "
        "positions"
    ] * any(k in ATTENTION_LAYER_TYPES for k in kinds)
    mixing += ["the RWKV recurrence's state read-out and update"] * ("rwkv" in kinds)
    mixing += ["mamba's scans: 7 per channel and state"] * ("mamba" in kinds)
    out.put(
        "flops_per_token",
        counts.flops_per_token,
        f"{counts.flops_per_token:,} ({_human(counts.flops_per_token)}FLOP) = 3 x forward "
        f"(2 per weight a token meets, output head included, plus {' and '.join(mixing)})",
    )


def _human(n: float) -> str:
    if n >= 1e300:  # past what a float holds (a fuzzed vocabulary): in decimal notation
        return f"{Decimal(int(n)):.3e} "
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"
