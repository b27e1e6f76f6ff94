"""muP's keys read and checked once (``use_mup``, ``base_shapes_file``, the ``mup_*`` keys):
the base shapes file, the width multiplier, and what explain says muP does to the run.

The base shapes file is mup's own format (``mup.make_base_shapes``): YAML mapping each
parameter's name to its base shape, ``null`` for a dimension that is not a width. torchneox
writes it with save_base_shapes under its own parameter names (one file, not one per rank:
the shapes are the whole, unsharded model's)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from torchneox.base.errors import ConfigError
from torchneox.config.derived import Derived
from torchneox.config.features.optimizer import optimizer_spec
from torchneox.config.load import LoadedConfig

MUP_OPTIMIZERS = ("adam", "adamw", "sgd")
"""The optimizers mup has a rule for: MuAdam (Adam-like) and MuSGD."""

ONLY_WITH_MUP = (
    "coord_check",
    "save_base_shapes",
    "base_shapes_file",
    "mup_init_scale",
    "mup_attn_temp",
    "mup_output_temp",
    "mup_embedding_mult",
    "mup_width_scale",
)
"""The keys that change nothing unless use_mup is true (mup_rp_embedding_mult applies always,
as in GPT-NeoX)."""

EMBED = "embed.weight"


@dataclass(frozen=True)
class MupSpec:
    """What use_mup asks: the scalings and where the base shapes come from."""

    base_shapes_file: str | None
    init_scale: float
    attn_temp: float
    output_temp: float
    embedding_mult: float
    width_scale: int
    save_base_shapes: bool
    coord_check: bool


def mup_spec(loaded: LoadedConfig) -> MupSpec | None:
    """The muP settings of a config (None: use_mup is false), checked."""
    cfg = loaded.config
    t = cfg.training
    if not t.use_mup:
        return None
    source = loaded.origin.get("use_mup")
    if importlib.util.find_spec("mup") is None:
        raise ConfigError(
            "use_mup needs Microsoft's mup package: pip install --no-deps 'mup>=1.0' (its "
            "metadata asks for torchvision, which would replace torch)",
            source=source,
            key="use_mup",
        )
    kind = optimizer_spec(cfg.optimizer).kind
    if kind not in MUP_OPTIMIZERS:
        raise ConfigError(
            f"use_mup takes optimizer type Adam or SGD (mup's MuAdam and MuSGD rules); "
            f"{kind} has none: change optimizer.type or remove use_mup",
            source=loaded.origin.get("optimizer", source),
            key="optimizer.type",
        )
    if "orthogonal" in (cfg.model.init_method, cfg.model.output_layer_init_method):
        raise ConfigError(
            "use_mup has no orthogonal initialisation (nor has GPT-NeoX's): choose another "
            "init_method",
            source=source,
            key="init_method",
        )
    if not t.base_shapes_file and (t.save_base_shapes or not t.coord_check):
        raise ConfigError(
            "use_mup needs base_shapes_file (write it once with save_base_shapes: true at "
            "the base width)",
            source=source,
            key="base_shapes_file",
        )
    return MupSpec(
        t.base_shapes_file,
        t.mup_init_scale,
        t.mup_attn_temp,
        t.mup_output_temp,
        t.mup_embedding_mult,
        t.mup_width_scale,
        t.save_base_shapes,
        t.coord_check,
    )


def read_base_shapes(path: str) -> dict[str, list[int | None]]:
    """The base shapes in ``path``: name -> base dimensions (None: not a width)."""
    where = Path(path)
    if not where.is_file():
        raise ConfigError(
            "does not exist: write it with save_base_shapes: true (at the base width)",
            source=path,
            key="base_shapes_file",
        )
    try:
        shapes = yaml.safe_load(where.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(
            f"is not a base shapes file ({type(e).__name__}): write it again with "
            "save_base_shapes: true",
            source=path,
        ) from None
    for name, v in shapes.items() if isinstance(shapes, dict) else ():
        sizes = isinstance(v, list) and all(
            d is None or (isinstance(d, int) and not isinstance(d, bool) and d > 0) for d in v
        )
        if not sizes:
            raise ConfigError(
                f"{name}: {v!r} is not a base shape (a list of sizes, null where a dimension "
                "is not a width): write it again with save_base_shapes: true",
                source=path,
            )
    if (
        not isinstance(shapes, dict)
        or EMBED not in shapes
        or len(shapes[EMBED]) != 2
        or shapes[EMBED][1] is None
    ):
        raise ConfigError(
            f"is not a torchneox base shapes file (no width for {EMBED}): write it with "
            "save_base_shapes: true",
            source=path,
        )
    return shapes


def width_mult(hidden_size: int, shapes: dict[str, Any]) -> float:
    """The model's width over the base's: what the logits' hidden states are divided by (the
    word embedding's width multiplier, as GPT-NeoX takes it)."""
    return hidden_size / shapes[EMBED][1]


def derive_mup(loaded: LoadedConfig, out: Derived) -> None:
    """What muP does to the run, for explain (nothing when use_mup is false: the keys only
    it reads are listed as having no effect)."""
    cfg = loaded.config
    spec = mup_spec(loaded)
    if spec is None:
        for name in ONLY_WITH_MUP:
            if loaded.given(name):
                out.no_effect[name] = "use_mup is false"
        return
    if spec.save_base_shapes:
        out.put(
            "mup_one_off",
            "save_base_shapes",
            f"this run writes the base shapes to {spec.base_shapes_file} (this model, delta "
            f"hidden_size x {spec.width_scale}) and exits without training",
        )
        return
    if spec.coord_check:
        out.put(
            "mup_one_off",
            "coord_check",
            "this run draws muP's coordinate check (coord_check_up.0.* and coord_check_sp.0.* "
            "in the current folder; the base: base_shapes_file where it exists, else the "
            "smallest width) and exits without training",
        )
        return
    shapes = read_base_shapes(spec.base_shapes_file)  # type: ignore[arg-type]
    if not cfg.model.hidden_size:
        return
    mult = width_mult(cfg.model.hidden_size, shapes)
    base = shapes[EMBED][1]
    out.put(
        "mup_width_mult",
        mult,
        f"{mult:g}: hidden_size {cfg.model.hidden_size} / the base width {base} in "
        f"{spec.base_shapes_file}",
    )
    rule = "MuSGD" if out["optimizer_type"] == "sgd" else "MuAdam"
    out.put("mup_lr", rule, f"{_lr_rule(out, mult)}; {_lr_reason()}")
    out.put("mup_scalings", "GPT-NeoX's", _scalings(spec, mult))


def _lr_rule(out: Derived, mult: float) -> str:
    lr, kind = out["lr"], out["optimizer_type"]
    if lr is None:
        return "unknown: no lr"
    if kind == "sgd":
        return (
            f"vector-like (one width dimension: embeddings, the head, biases, norms) "
            f"lr x {mult:g} = {lr * mult:g}; hidden matrices lr x fan-out / fan-in multiplier "
            f"({lr:g} for square ones); the rest {lr:g}"
        )
    return (
        f"hidden matrices (two width dimensions) lr / {mult:g} = {lr / mult:g} with "
        f"weight decay x {mult:g}; embeddings, the head, biases and norms lr {lr:g}"
    )


def _lr_reason() -> str:
    return (
        "mup's grouping, computed once by parameter name from the whole model's shapes (FSDP2 "
        "and tensor-parallel DTensors keep no infshape); the schedule multiplies each group's "
        "own base lr (GPT-NeoX's overwrote them with one lr)"
    )


def _scalings(spec: MupSpec, mult: float) -> str:
    attn = "1/d" if spec.attn_temp == 1 else f"1/(d x {spec.attn_temp:g})"
    out_div = f"{mult:g}" if spec.output_temp == 1 else f"({mult:g} x {spec.output_temp:g})"
    return (
        f"attention scores x {attn} (not 1/sqrt(d)); embeddings x {spec.embedding_mult:g}; "
        f"logits from hidden / {out_div}; hidden matrices drawn / sqrt({mult:g}); every drawn "
        f"weight x {spec.init_scale:g}"
    )
