"""``lora``: low-rank adapters on the model's linear layers, read and checked once.

``lora: {rank, alpha, dropout, target_modules}`` puts on each targeted linear layer of every
block an adapter whose output, (alpha / rank) x B(A(dropout(x))), is added to the layer's: A
[rank, in] drawn as PEFT draws it (kaiming-uniform, a = sqrt(5)), B [out, rank] zeros, so the
model starts as its base. The base is frozen; only the adapters train. ``target_modules``
names the layers by torchneox's names (attention.wq, mlp.up, ...) or by the Hugging Face
names they convert to (q_proj, up_proj, ...); PEFT's defaults when left out: rank 8, alpha 8,
dropout 0, q_proj and v_proj.

``base_dtype: bf16`` stores the frozen base's linear weights and biases (every block's and the
output head's) in bfloat16, half their bytes. Under ``precision: bfloat16`` autocast casts
those weights to bfloat16 at each use anyway, so the run computes exactly what the fp32 base
computes; under fp32 or fp16 each layer casts its bfloat16 weight to the input's dtype. The
base's embeddings, norms and the adapters stay fp32 (autocast reads them in fp32). Default
``fp32``: the base kept as every torchneox run keeps its weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchneox.base.errors import ConfigError, did_you_mean
from torchneox.config.checker import Checker
from torchneox.config.checks.model import layer_attention_types
from torchneox.config.features.sharing import layer_owners
from torchneox.config.numbers import number, whole
from torchneox.config.sizes import (
    MAMBA_STATE,
    gmlp_width,
    head_dim,
    is_moe_layer,
    kv_heads,
    mamba_inner,
    mlp_widths,
    rwkv_widths,
)

NAME = "lora"
KEYS = ("rank", "alpha", "dropout", "target_modules", "base_dtype")
HF_NAMES = {
    "q_proj": "attention.wq",
    "k_proj": "attention.wk",
    "v_proj": "attention.wv",
    "o_proj": "attention.wo",
    "gate_proj": "mlp.gate",
    "up_proj": "mlp.up",
    "down_proj": "mlp.down",
}
"""The Hugging Face (Llama family) name of each attention or MLP layer torchneox can adapt."""
MAMBA_HF_NAMES = {
    "in_proj": "mamba.in_proj",
    "x_proj": "mamba.x_proj",
    "dt_proj": "mamba.dt_proj",
    "out_proj": "mamba.out_proj",
}
"""The Hugging Face (MambaForCausalLM) name of each Mamba projection."""
ATTENTION_MLP = tuple(HF_NAMES.values())
"""The attention and MLP linears (on an MoE layer, mlp.up/gate/down adapt every expert's
weight and the shared expert's layer)."""
FAMILY_TARGETS = {
    "attention": (*ATTENTION_MLP, "mlp.router"),
    "mamba": tuple(MAMBA_HF_NAMES.values()),
    "rwkv": (
        *(f"time_mix.{n}" for n in ("receptance", "key", "value", "gate", "output")),
        *(f"channel_mix.{n}" for n in ("key", "receptance", "value")),
    ),
    "gmlp": ("gmlp.input_linear", "gmlp.output_linear"),
    "amlp": ("gmlp.sgu.attn.proj_qkv", "gmlp.sgu.attn.proj_ffn"),
}
"""The layers each layer family can adapt, by their names in the block (after layers.{i}.);
amlp's are its tiny attention's, beside gmlp's."""
OURS = tuple(t for targets in FAMILY_TARGETS.values() for t in targets)
ALIASES = HF_NAMES | MAMBA_HF_NAMES
DEFAULTS = {"rank": 8, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
"""PEFT's LoraConfig defaults (its Llama target modules)."""
BASE_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
"""base_dtype's spellings, by the dtype they name."""
BASE_LINEARS = (*ATTENTION_MLP, "output")
"""The base's linear layers base_dtype: bf16 stores in bfloat16 (a reward model's value head
trains, and stays fp32; the other families' projections and MoE experts stay fp32)."""


def family_of_type(kind: str) -> str:
    """The family (a FAMILY_TARGETS key) of an attention_config layer type."""
    return kind if kind in ("mamba", "rwkv", "gmlp", "amlp") else "attention"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    """torchneox's layer names, in OURS' order (attention.wq, ..., mlp.down)."""
    base_dtype: str = "fp32"
    """How the frozen base's linear weights are stored: fp32 or bf16."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets_layer(self, module: str) -> bool:
        """Whether the module named ``module`` (layers.{i}.attention.wq, ...) is adapted."""
        parts = module.split(".")
        return len(parts) >= 4 and parts[0] == "layers" and ".".join(parts[2:]) in self.targets

    def hf_names(self) -> list[str]:
        theirs = {ours: hf for hf, ours in ALIASES.items()}
        return [theirs.get(t, t) for t in self.targets]


def lora_spec(cfg: Any) -> LoraSpec | None:
    """The adapters of a checked config; None without ``lora``."""
    given = cfg.training.lora
    if given is None:
        return None
    c = DEFAULTS | dict(given)
    targets = {ALIASES.get(str(t), str(t)) for t in c["target_modules"]}
    return LoraSpec(
        int(c["rank"]),
        float(c["alpha"]),
        float(c["dropout"]),
        tuple(t for t in OURS if t in targets),
        BASE_DTYPES[str(c.get("base_dtype", "fp32"))],
    )


def refuse_other_adapter_scale(saved: Any, now: Any, step_dir: Any) -> None:
    """A run resuming its own checkpoint with another lora rank or alpha: its adapters were
    trained at one scale (alpha / rank) and would go on at another, without a word."""
    before, after = lora_spec(saved), lora_spec(now)
    if before is None or after is None:
        return
    if (before.rank, before.alpha) != (after.rank, after.alpha):
        raise ConfigError(
            f"save holds this run's own checkpoint {step_dir}, whose adapters trained with rank "
            f"{before.rank}, alpha {before.alpha:g}; the config gives rank {after.rank}, alpha "
            f"{after.alpha:g}: give lora as it was to resume it, or name another save folder",
            key="lora",
        )


def is_base_linear(name: str) -> bool:
    """Whether parameter ``name`` (layers.0.attention.wq.weight, output.weight, ...) is a
    weight or bias of one of the base's linear layers (BASE_LINEARS), which ``base_dtype: bf16``
    stores in bfloat16."""
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return False
    parts = module.split(".")
    if parts == ["output"]:
        return True
    return len(parts) == 4 and parts[0] == "layers" and ".".join(parts[2:]) in ATTENTION_MLP


def adapter_parameters(cfg: Any, spec: LoraSpec) -> int:
    """How many numbers the adapters hold: rank x (in + out) per adapted layer (per expert on
    an MoE layer), once per shared weight (num_unique_layers)."""
    kinds = layer_attention_types(cfg)
    owners = layer_owners(cfg)
    total = 0
    for layer, kind in enumerate(kinds):
        if owners and owners[layer] != layer:  # it holds its owner's adapters
            continue
        shapes = layer_shapes(cfg, layer, kind)
        total += spec.rank * sum(n * (i + o) for t in spec.targets for n, i, o in shapes.get(t, ()))
    return total


def layer_shapes(cfg: Any, layer: int, kind: str) -> dict[str, list[tuple[int, int, int]]]:
    """Each layer a target names in layer ``layer`` (of type ``kind``): (how many, in, out)."""
    m, family = cfg.model, family_of_type(kind)
    h = m.hidden_size
    if family == "mamba":
        d, r = mamba_inner(m), math.ceil(h / 16)
        return {
            "mamba.in_proj": [(1, h, 2 * d)],
            "mamba.x_proj": [(1, d, r + 2 * MAMBA_STATE)],
            "mamba.dt_proj": [(1, r, d)],
            "mamba.out_proj": [(1, d, h)],
        }
    if family == "rwkv":
        w = rwkv_widths(m)
        d, f = w.dim_att, w.ffn_dim
        time = {f"time_mix.{n}": [(1, h, d)] for n in ("receptance", "key", "value", "gate")}
        return time | {
            "time_mix.output": [(1, d, h)],
            "channel_mix.key": [(1, h, f)],
            "channel_mix.receptance": [(1, h, h)],
            "channel_mix.value": [(1, f, h)],
        }
    if family in ("gmlp", "amlp"):
        ff, a = gmlp_width(h), m.gmlp_attn_dim
        out = {"gmlp.input_linear": [(1, h, 2 * ff)], "gmlp.output_linear": [(1, ff, h)]}
        if family == "amlp":
            out |= {"gmlp.sgu.attn.proj_qkv": [(1, 2 * ff, 3 * a)]}
            out |= {"gmlp.sgu.attn.proj_ffn": [(1, a, ff)]}
        return out
    return _attention_shapes(cfg, layer)


def _attention_shapes(cfg: Any, layer: int) -> dict[str, list[tuple[int, int, int]]]:
    m, e = cfg.model, cfg.moe
    h, d = m.hidden_size, head_dim(m)
    q, kv, widths = m.num_attention_heads * d, kv_heads(m) * d, mlp_widths(m)
    out = {
        "attention.wq": [(1, h, q)],
        "attention.wk": [(1, h, kv)],
        "attention.wv": [(1, h, kv)],
        "attention.wo": [(1, q, h)],
    }
    w, experts, gated = widths.down, 1, widths.gated
    if is_moe_layer(e, layer):
        experts = e.moe_num_experts
        out["mlp.router"] = [(1, h, experts)]
    mlp = {"mlp.up": [(experts, h, w)], "mlp.down": [(experts, w, h)]}
    if gated:
        mlp["mlp.gate"] = [(experts, h, w)]
    shared = e.moe_shared_expert_intermediate_size if experts > 1 else 0
    for name in list(mlp):
        if shared:  # the shared expert's own layer, adapted with the experts'
            i, o = (shared, h) if name == "mlp.down" else (h, shared)
            mlp[name] = [*mlp[name], (1, i, o)]
    return out | mlp


def describe(cfg: Any, spec: LoraSpec) -> str:
    """explain's row: the adapted layers and what trains."""
    count = adapter_parameters(cfg, spec)
    names = ", ".join(f"{t} ({hf})" for t, hf in zip(spec.targets, spec.hf_names(), strict=True))
    stored = (
        "stored in bf16 (its linear weights; autocast casts them at each use)"
        if spec.base_dtype == "bf16"
        else "in fp32 (base_dtype: bf16 halves its linear weights)"
    )
    return (
        f"rank {spec.rank}, alpha {spec.alpha:g} (scale {spec.scale:g}), dropout "
        f"{spec.dropout:g} on {names} of each of the {cfg.model.num_layers} layers: "
        f"{count:,} trainable parameters (A kaiming-uniform, B zeros), the base frozen, "
        f"{stored}"
    )


def check_lora(ch: Checker) -> None:
    """Each mistake in the dict, and what the adapters do not run with, in one line."""
    c = ch.c.training.lora
    if c is None:
        return
    if not isinstance(c, dict):
        ch.fail(NAME, f"must be a mapping {{{', '.join(KEYS)}}}, got {c!r}")
    for name in c:
        if name not in KEYS:
            ch.fail(NAME, f"unknown key {name}{did_you_mean(str(name), KEYS)}", path=str(name))
    _read_numbers(ch, c)
    c = DEFAULTS | c
    _check_targets(ch, c["target_modules"])
    base = c.get("base_dtype", "fp32")
    if str(base) not in BASE_DTYPES:
        ch.fail(
            NAME,
            f"base_dtype must be fp32 or bf16, got {base!r}{did_you_mean(str(base), BASE_DTYPES)}",
            path="base_dtype",
        )


def _read_numbers(ch: Checker, given: dict) -> None:
    """rank, alpha and dropout checked, each written back as the number it is (text such as
    1e3, which YAML reads as a string, counts as that number, as it does for a flat key)."""
    rules = {
        "rank": (whole, lambda v: v >= 1, "an integer >= 1"),
        "alpha": (number, lambda v: v > 0, "a number > 0"),
        "dropout": (number, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    }
    for name, (read, holds, what) in rules.items():
        if name not in given:
            continue
        value = read(given[name])
        if value is None or not holds(value):
            ch.fail(NAME, f"{name} must be {what}, got {given[name]!r}", path=name)
        given[name] = value


def _check_targets(ch: Checker, targets: Any) -> None:
    if isinstance(targets, str):  # PEFT reads a string as a regular expression
        ch.fail(
            NAME,
            f"target_modules must be a list of layer names, got the text {targets!r}: write "
            f"[{targets}] (a string is a regular expression to PEFT, which torchneox does not "
            "read)",
            path="target_modules",
        )
    if not isinstance(targets, list) or not targets:
        ch.fail(NAME, f"target_modules must be a list of layer names, got {targets!r}")
    known = (*OURS, *ALIASES)
    for t in targets:
        if str(t) not in known:
            ch.fail(
                NAME,
                f"target_modules: unknown layer {t!r}{did_you_mean(str(t), known)} (one of "
                f"{', '.join(OURS)}, or their Hugging Face names {', '.join(ALIASES)})",
                path="target_modules",
            )
    ours = {ALIASES.get(str(t), str(t)) for t in targets}
    if "mlp.gate" in ours and not mlp_widths(ch.c.model).gated:
        ch.fail(NAME, "target_modules names mlp.gate, but the activation is not gated")
    _check_present(ch, ours)


def _check_present(ch: Checker, ours: set[str]) -> None:
    """Each target names a layer the model has (none would be adapted without a word)."""
    c = ch.c
    kinds = layer_attention_types(c)
    if not kinds:  # the layers come later (a Hugging Face folder's config.json), checked then
        return
    families = {family_of_type(k) for k in kinds}
    if "amlp" in families:
        families.add("gmlp")
    moe = any(
        is_moe_layer(c.moe, i) for i, k in enumerate(kinds) if family_of_type(k) == "attention"
    )
    for family, names in FAMILY_TARGETS.items():
        for t in sorted(ours & set(names)):
            if family not in families:
                ch.fail(
                    NAME,
                    f"target_modules names {t}, a layer of {family} blocks, and "
                    f"attention_config gives no {family} layer",
                    path="target_modules",
                )
            if t == "mlp.router" and not moe:
                ch.fail(
                    NAME,
                    "target_modules names mlp.router, and the model has no MoE layer "
                    "(moe_num_experts > 1)",
                    path="target_modules",
                )
