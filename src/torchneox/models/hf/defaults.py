"""What transformers assumes for the config.json keys a Hugging Face folder leaves out, per
architecture, and how it reads the rotary keys (a legacy ``rope_scaling`` over
``rope_parameters``): the defaults of transformers' own configuration_*.py (5.x, the same
in 4.x for every key read here), written out so that conversion needs no transformers and a
folder converts into the model transformers builds from it.
tests/models/hf/test_defaults.py holds this table to transformers' config classes.
"""

from __future__ import annotations

from typing import Any

from torchneox.base.errors import HFError
from torchneox.models.hf import deepseek, moe_families

_LLAMA = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # None: one per query head
    "head_dim": None,  # None: hidden_size / num_attention_heads
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
}
_MISTRAL = {k: v for k, v in _LLAMA.items() if k not in ("attention_bias", "mlp_bias")} | {
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096,
}
_QWEN = {k: v for k, v in _LLAMA.items() if k not in ("head_dim", "attention_bias", "mlp_bias")}
_QWEN |= {
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _MISTRAL,
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": _QWEN | {"head_dim": 128, "attention_bias": False},
    "Olmo2ForCausalLM": {k: v for k, v in _LLAMA.items() if k not in ("head_dim", "mlp_bias")}
    | {"vocab_size": 50304, "rms_norm_eps": 1e-5},
    "MixtralForCausalLM": _MISTRAL
    | {
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0,
    },
    "GPTNeoXForCausalLM": {
        "vocab_size": 50432,
        "hidden_size": 6144,
        "num_hidden_layers": 44,
        "num_attention_heads": 64,
        "intermediate_size": 24576,
        "hidden_act": "gelu",
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "max_position_embeddings": 2048,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_parallel_residual": True,
        "attention_bias": True,
    },
    **moe_families.DEFAULTS,
    deepseek.DEEPSEEK_V3: deepseek.DEFAULTS,
}
"""Per causal architecture, the keys torchneox reads and transformers' value for each when
config.json has none. Keys an architecture's modelling code does not read are absent: its
layers have them fixed (Mistral's and Mixtral's projections have no biases whatever
attention_bias says, Qwen2's q/k/v always have them)."""

DEFAULT_THETA = {"MixtralForCausalLM": 1e6}
"""The rope base when no key gives one (transformers' default_theta: 10000 but for these)."""
GPT_NEOX = "GPTNeoXForCausalLM"


def with_defaults(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """config.json with transformers' default for each key it leaves out, and the two keys
    whose null means "derived" (num_key_value_heads, head_dim) resolved as transformers does."""
    out = DEFAULTS[arch] | hf
    heads = out["num_attention_heads"]
    if out.get("num_key_value_heads") is None:
        out["num_key_value_heads"] = heads
    if arch != GPT_NEOX and out.get("head_dim") is None:
        out["head_dim"] = out["hidden_size"] // heads
    return out


SCALED_ROPE = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
"""The rope scaling types torchneox computes, and the fields it reads of each."""


def rope(hf: dict[str, Any], arch: str) -> tuple[float, float, dict[str, Any] | None]:
    """(theta, partial rotary factor, rope_scaling key or None) as transformers reads them: a
    legacy ``rope_scaling`` that is not empty replaces ``rope_parameters`` whole (its theta
    included); what the chosen dict lacks comes from the top-level keys (GPTNeoX's
    rotary_emb_base and rotary_pct, the others' rope_theta and partial_rotary_factor), then
    from the architecture's defaults."""
    legacy = hf.get("rope_scaling")
    key = "rope_scaling" if legacy else "rope_parameters"
    spec = legacy or hf.get("rope_parameters") or {}
    if not isinstance(spec, dict) or any(isinstance(v, dict) for v in spec.values()):
        raise HFError(
            f"{key} {spec!r}: per-layer rotary settings are not mapped (torchneox gives every "
            "layer the same rotary embedding)",
            key=key,
        )
    if arch == GPT_NEOX:
        theta = spec.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
        pct = spec.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    else:
        theta = spec.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA.get(arch, 10000.0)))
        pct = spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    kind = spec.get("rope_type") or spec.get("type") or "default"
    if kind == "default":
        return float(theta), float(pct), None
    if kind not in SCALED_ROPE:
        raise HFError(
            f"rope scaling {kind!r} is unbuilt (torchneox maps "
            f"{', '.join(SCALED_ROPE)}); the model would compute other logits without it",
            key=key,
        )
    chosen = {"type": kind} | {n: spec[n] for n in SCALED_ROPE[kind] if spec.get(n) is not None}
    _original_context(hf, chosen)
    return float(theta), float(pct), chosen


def _original_context(hf: dict[str, Any], spec: dict[str, Any]) -> None:
    """The pretraining context the scaling counts from, as transformers finds it: a top-level
    original_max_position_embeddings first, then the scaling's own, then max_position_
    embeddings (dynamic scaling always counts from max_position_embeddings)."""
    context = hf["max_position_embeddings"]
    if spec["type"] == "dynamic":
        spec["original_max_position_embeddings"] = context
    elif spec["type"] in ("llama3", "yarn"):
        top = hf.get("original_max_position_embeddings")
        spec["original_max_position_embeddings"] = top or spec.get(
            "original_max_position_embeddings", context
        )
