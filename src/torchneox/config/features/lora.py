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

from dataclasses import dataclass
from typing import Any

from torchneox.base.errors import ConfigError, did_you_mean
from torchneox.config.checker import Checker
from torchneox.config.checks.model import layer_attention_types
from torchneox.config.features.fp8_plan import fp8_plan
from torchneox.config.features.soft_prompt import soft_prompt
from torchneox.config.features.sparsity import ATTENTION_LAYER_TYPES
from torchneox.config.numbers import number, whole
from torchneox.config.sizes import head_dim, kv_heads, mlp_widths

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
"""The Hugging Face (Llama family) name of each layer torchneox can adapt."""
OURS = tuple(HF_NAMES.values())
DEFAULTS = {"rank": 8, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
"""PEFT's LoraConfig defaults (its Llama target modules)."""
BASE_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
"""base_dtype's spellings, by the dtype they name."""
BASE_LINEARS = (*OURS, "output")
"""The base's linear layers base_dtype: bf16 stores in bfloat16 (a reward model's value head
trains, and stays fp32)."""


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
        return len(parts) == 4 and parts[0] == "layers" and ".".join(parts[2:]) in self.targets

    def hf_names(self) -> list[str]:
        theirs = {ours: hf for hf, ours in HF_NAMES.items()}
        return [theirs[t] for t in self.targets]


def lora_spec(cfg: Any) -> LoraSpec | None:
    """The adapters of a checked config; None without ``lora``."""
    given = cfg.training.lora
    if given is None:
        return None
    c = DEFAULTS | dict(given)
    targets = {HF_NAMES.get(str(t), str(t)) for t in c["target_modules"]}
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
    return len(parts) == 4 and parts[0] == "layers" and ".".join(parts[2:]) in OURS


def adapter_parameters(cfg: Any, spec: LoraSpec) -> int:
    """How many numbers the adapters hold: rank x (in + out) per adapted layer."""
    m = cfg.model
    h, d = m.hidden_size, head_dim(m)
    q, kv, w = m.num_attention_heads * d, kv_heads(m) * d, mlp_widths(m).down
    shapes = {
        "attention.wq": (h, q),
        "attention.wk": (h, kv),
        "attention.wv": (h, kv),
        "attention.wo": (q, h),
        "mlp.up": (h, w),
        "mlp.gate": (h, w),
        "mlp.down": (w, h),
    }
    gated = mlp_widths(m).gated
    per_layer = sum(spec.rank * sum(shapes[t]) for t in spec.targets if t != "mlp.gate" or gated)
    return per_layer * m.num_layers


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
    """Each mistake in the dict, and what the adapters are not built for, in one line."""
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
    _check_use(ch)


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
            f"[{targets}] (a string is a regular expression to PEFT, not built here)",
            path="target_modules",
        )
    if not isinstance(targets, list) or not targets:
        ch.fail(NAME, f"target_modules must be a list of layer names, got {targets!r}")
    known = (*OURS, *HF_NAMES)
    for t in targets:
        if str(t) not in known:
            ch.fail(
                NAME,
                f"target_modules: unknown layer {t!r}{did_you_mean(str(t), known)} (one of "
                f"{', '.join(OURS)}, or q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                "down_proj)",
                path="target_modules",
            )
    gate = "mlp.gate" in {HF_NAMES.get(str(t), str(t)) for t in targets}
    if gate and not mlp_widths(ch.c.model).gated:
        ch.fail(NAME, "target_modules names mlp.gate, but the activation is not gated")


def _check_use(ch: Checker) -> None:
    """The objectives, layouts and layer kinds the adapters are not built for yet."""
    c = ch.c
    refused = [
        (
            c.parallel.pipe_parallel_size > 1 and c.training.train_impl in ("rm", "reinforce"),
            f"pipe_parallel_size > 1 and train_impl {c.training.train_impl}",
        ),
        (c.moe.moe_num_experts > 1, "moe_num_experts > 1"),
        (fp8_plan(c.precision, c.model) is not None, "fp8"),
        (soft_prompt(c) is not None, "soft_prompt_tuning (each freezes the other's)"),
        (c.training.use_mup, "use_mup"),
        (c.model.num_unique_layers is not None, "num_unique_layers (shared layers)"),
    ]
    kinds = sorted(set(layer_attention_types(c)) - set(ATTENTION_LAYER_TYPES))
    if kinds:
        refused.append((True, f"{kinds[0]} layers"))
    for on, what in refused:
        if on:
            ch.fail(NAME, f"lora with {what} is not built yet")
