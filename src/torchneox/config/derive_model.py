"""The model's derived values: the padded vocabulary, head and MLP sizes, rotary dimensions,
the residual form, the attention, and the parameter and FLOP counts (config/sizes.py)."""

from __future__ import annotations

import importlib.util
import math
from decimal import Decimal

from torchneox.base.errors import ConfigError
from torchneox.config import sizes
from torchneox.config.derived import Derived
from torchneox.config.load import LoadedConfig
from torchneox.config.schema import ModelConfig, NeoXConfig
from torchneox.config.validate_model import layer_attention_types
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
    missing = [k for k in MODEL_KEYS if cfg.get(k) is None]
    if missing:
        why = f"unknown: {', '.join(missing)} not set"
        out.put("num_parameters", None, why)
        out.put("flops_per_token", None, why)
        return
    _shapes(loaded, out)
    _counts(cfg, out, padded)


def _shapes(loaded: LoadedConfig, out: Derived) -> None:
    cfg = loaded.config
    m = cfg.model
    d, kv = sizes.head_dim(cfg.model), sizes.kv_heads(cfg.model)
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
    out.put("num_kv_heads", kv, f"{kv}: {attention} attention")
    widths = sizes.mlp_widths(cfg.model)
    how = (
        f"gated {m.activation}: two halves of {widths.down}" if widths.gated else f"{m.activation}"
    )
    out.put("mlp_width", widths.down, f"{widths.down} ({how}; GPT-NeoX's sizing rules)")
    if m.pos_emb == "rotary":
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
    kinds = layer_attention_types(cfg, loaded.origin)
    attention = [k for k in kinds if k in ("global", "flash")]
    out.put(
        "attention",
        "sdpa" + (f", window {m.sliding_window_width}" if m.sliding_window_width else ""),
        (
            f"causal scaled_dot_product_attention on all {len(kinds)} layers"
            if len(attention) == len(kinds)
            else f"causal scaled_dot_product_attention on {len(attention)} of {len(kinds)} layers"
        )
        + (" ('flash' and 'global' alike)" if m.attention_config else ""),
    )
    if "mamba" in kinds:
        _mamba(cfg, out, kinds.count("mamba"))


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
        f"{layers} layers, d_inner {d}",
        f"{layers} mamba layers: d_inner {d} ({source}), dt_rank {math.ceil(m.hidden_size / 16)}, "
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


def _counts(cfg: NeoXConfig, out: Derived, padded: int) -> None:
    m = cfg.model
    counts = sizes.count(cfg, padded)
    tied = "tied to the embedding" if not m.no_weight_tying else "its own weights"
    out.put(
        "num_parameters",
        counts.total,
        f"{counts.total:,} ({_human(counts.total)}), of which {counts.embedding:,} in embeddings; "
        f"output head {tied}",
    )
    if counts.moe_layers:
        out.put(
            "num_active_parameters",
            counts.active,
            f"{counts.active:,} ({_human(counts.active)}) reach each token: {counts.moe_layers} MoE "
            f"layers of {cfg.moe.moe_num_experts} experts, top-{cfg.moe.moe_top_k}",
        )
    out.put(
        "flops_per_token",
        counts.flops_per_token,
        f"{counts.flops_per_token:,} ({_human(counts.flops_per_token)}FLOP) = 3 x forward "
        f"(2 per weight a token meets, output head included, plus attention scores over "
        f"{min(m.seq_length, m.sliding_window_width or m.seq_length)} positions"
        + (
            ", and mamba's scans: 7 per channel and state"
            if "mamba" in str(m.attention_config)
            else ""
        )
        + ")",
    )


def _human(n: float) -> str:
    if n >= 1e300:  # past what a float holds (a fuzzed vocabulary): in decimal notation
        return f"{Decimal(int(n)):.3e} "
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"
