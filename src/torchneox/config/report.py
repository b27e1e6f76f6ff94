"""What ``config explain`` and ``config keys`` print: text, JSON, resolved YAML, references."""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

from torchneox.config.derivations.rl import SECTION
from torchneox.config.derive import Derived
from torchneox.config.fields import Status
from torchneox.config.load import LoadedConfig, describe_type
from torchneox.config.schema import GROUP_TITLES, KEYS, NeoXConfig

SECTIONS: dict[str, tuple[str, ...]] = {
    "Layout": (
        "world_size",
        "pipe_parallel_size",
        "pipeline_stages",
        "pipeline_schedule_runs",
        "pipeline_schedule",
        "model_parallel_size",
        "context_parallel_size",
        "data_parallel_size",
        "zero_stage",
        "zero_offload",
        "offload_host_bytes_per_rank",
        "distributed_backend",
        "compile",
        "replica_groups",
    ),
    "Batch": (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "tokens_per_step",
        "replicated_batch_size",
        "train_iters",
        "curriculum",
    ),
    "Precision": (
        "precision",
        "amp",
        "loss_scale",
        "gradient_reduce_dtype",
        "zero_param_dtype",
        "fp8",
    ),
    "Optimizer": ("optimizer_type", "eight_bit_adam", "lr", "weight_decay", "gradient_clipping"),
    "Learning-rate schedule": ("lr_schedule", "lr_decay_iters", "warmup_iters"),
    "muP": ("mup_one_off", "mup_width_mult", "mup_lr", "mup_scalings"),
    "Model": (
        "vocab_size",
        "padded_vocab_size",
        "head_dim",
        "num_kv_heads",
        "mla",
        "mlp_width",
        "rotary_dims",
        "position_embedding",
        "residual",
        "attention",
        "kv_cache_bytes_per_token",
        "layers",
        "gmlp",
        "rwkv",
        "sparse_layouts",
        "mamba",
        "layer_sharing",
        "num_parameters",
        "num_active_parameters",
        "trainable_parameters",
        "lora_trainable_parameters",
        "flops_per_token",
    ),
    "Data": ("data",),
    "Checkpoints": ("s3_upload",),
    "Rollouts": SECTION,
    "Launch": ("launch",),
}

STATUS_WORDS = {
    Status.USED: "used",
    Status.NO_EFFECT: "accepted, no effect",
    Status.UNSUPPORTED: "refused when set",
    Status.DERIVED: "derived",
    Status.EXTENSION: "torchneox only",
}


def as_json(derived: Derived) -> dict[str, Any]:
    """The machine-readable explanation; its keys are a stable interface."""
    out = dict(derived.values)
    out["no_effect_keys"] = sorted(derived.no_effect)
    out["no_effect"] = dict(sorted(derived.no_effect.items()))
    out["notes"] = list(derived.notes)
    out["reasons"] = dict(derived.reasons)
    return out


def render_json(derived: Derived) -> str:
    return json.dumps(as_json(derived), indent=2)


def render_text(loaded: LoadedConfig, derived: Derived) -> str:
    lines = [f"torchneox config explain: {' + '.join(loaded.files)}"]
    for title, names in SECTIONS.items():
        present = [n for n in names if n in derived.values]
        if title == "Data":  # one row per streamed source (features/streaming.py)
            present += [n for n in derived.values if n.startswith("data source ")]
        if not present:
            continue
        lines += ["", title]
        width = max(len(n) for n in present)
        shown = {n: _show(derived.values[n]) for n in present}
        value_width = min(max(len(v) for v in shown.values()), 16)
        for name in present:
            lines.append(
                f"  {name:<{width}}  {shown[name]:<{value_width}}  {derived.reasons[name]}"
            )
    if derived.no_effect:
        lines += ["", "Accepted, no effect here"]
        for name, why in sorted(derived.no_effect.items()):
            lines.append(f"  {name}: {why}")
    if derived.notes:
        lines += ["", "Notes"]
        lines += [f"  {note}" for note in derived.notes]
    return "\n".join(lines)


def _show(value: Any) -> str:
    if value is None:
        return "?"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def resolved_config(loaded: LoadedConfig, derived: Derived) -> NeoXConfig:
    """The config with what explain resolved written in: the global and micro batch (the
    accumulation steps then follow from the data-parallel size, so the same file works under
    another layout), precision, and the padded vocabulary (so that it means the same on a
    machine without the tokenizer file)."""
    config = copy.deepcopy(loaded.config)
    for name in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if derived.get(name) is not None:
            config.set(name, derived[name])
    if derived.get("train_batch_size") is not None:
        config.training.gradient_accumulation_steps = KEYS["gradient_accumulation_steps"].default
    config.training.batch_size = None
    if config.training.train_iters is not None:  # counted from train_epochs: the steps it made
        config.training.train_epochs = None
    config.precision.precision = derived["precision"]
    config.tokenizer.padded_vocab_size = derived["padded_vocab_size"]
    return config


def render_yaml(loaded: LoadedConfig, derived: Derived) -> str:
    """Every key that differs from its default, in GPT-NeoX syntax, grouped by concern."""
    config = resolved_config(loaded, derived)
    chunks = [f"# resolved by torchneox from {', '.join(loaded.files)}"]
    group = None
    for name, spec in KEYS.items():
        value = config.get(name)
        if value == spec.default:
            continue
        if spec.group != group:
            group = spec.group
            chunks.append(f"\n# {GROUP_TITLES[group]}")
        chunks.append(yaml.safe_dump({name: value}, sort_keys=False, width=100).rstrip())
    return "\n".join(chunks) + "\n"


# -------------------------------------------------------------------------- references


def _default_text(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, str):
        return repr(default) if default.strip() != default or not default else default
    return json.dumps(default)


def _type_text(tp: Any) -> str:
    return describe_type(tp).removeprefix("an ").removeprefix("a ")


def keys_text() -> str:
    lines: list[str] = []
    group = None
    for name, spec in KEYS.items():
        if spec.group != group:
            group = spec.group
            lines += ["", f"[{GROUP_TITLES[group]}]"]
        status = "" if spec.info.status is Status.USED else f"  [{STATUS_WORDS[spec.info.status]}]"
        bounds = f"  ({spec.info.range})" if spec.info.range else ""
        lines.append(f"  {name} = {_default_text(spec.default)}{bounds}{status}")
        lines.append(f"      {spec.help}" + (f" ({spec.info.why})" if spec.info.why else ""))
    return "\n".join(lines).lstrip("\n")


def keys_markdown() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated by `torchneox config keys --markdown` from the schema in",
        "`src/torchneox/config/`; do not edit by hand. Every key GPT-NeoX documents is here,",
        "plus the few torchneox adds. Status says what torchneox does with it:",
        "",
        "- **used**: read and honoured;",
        "- **accepted, no effect**: loads, changes nothing here (`config explain` lists it with the reason);",
        "- **refused when set**: a feature torchneox does not build; a non-default value is an error;",
        "- **derived**: GPT-NeoX fills it in at launch; torchneox computes its own (see `config explain`);",
        "- **torchneox only**: not a GPT-NeoX key.",
        "",
        "Keys may be written with hyphens or underscores. Numbers written like `1e-5` are read as numbers.",
        "**Allowed** is a number's range (each number's, for a list), checked when the config loads",
        "(`train`, `config explain` and `estimate` refuse the same values).",
    ]
    group = None
    for name, spec in KEYS.items():
        if spec.group != group:
            group = spec.group
            lines += [
                "",
                f"## {GROUP_TITLES[group]}",
                "",
                "| key | type | default | allowed | status | meaning |",
                "|---|---|---|---|---|---|",
            ]
        meaning = spec.help + (f" *{spec.info.why}.*" if spec.info.why else "")
        cells = [
            f"`{name}`",
            _type_text(spec.type),
            f"`{_default_text(spec.default)}`",
            str(spec.info.range or ""),
            STATUS_WORDS[spec.info.status],
            meaning.replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
