"""Layer weight sharing (``num_unique_layers``, ``param_sharing_style``), read and checked once.

``num_layers`` layers hold the weights of ``num_unique_layers`` distinct blocks, in
Megatron-LM's order (its ``_get_layer_index``; GPT-NeoX's help text: 4 layers, 2 unique):

- grouped: layer i uses unique block i % U (1, 2, 1, 2);
- spaced: layer i uses unique block i // (L / U) (1, 1, 2, 2).

Each unique block is held by the first layer that uses it (its *owner*): the other layers hold
the owner's parameters themselves (the same tensors), so the optimizer, the checkpoints and
every count see them once, under the owner's names. GPT-NeoX only validates these keys.
"""

from __future__ import annotations

from typing import Any

from torchneox.config.checker import Checker

STYLES = ("grouped", "spaced")


def unique_index(layer: int, num_layers: int, num_unique: int, style: str) -> int:
    """Which unique block (0-based) layer ``layer`` uses."""
    if style == "grouped":
        return layer % num_unique
    return layer // (num_layers // num_unique)


def owners(num_layers: int, num_unique: int | None, style: str) -> tuple[int, ...]:
    """Per layer, the layer that holds its weights (itself for an owner); empty when nothing
    is shared."""
    if num_unique is None or num_unique >= num_layers:
        return ()
    first: dict[int, int] = {}
    out = []
    for layer in range(num_layers):
        out.append(first.setdefault(unique_index(layer, num_layers, num_unique, style), layer))
    return tuple(out)


def layer_owners(cfg: Any) -> tuple[int, ...]:
    """The owners of a checked config's layers (empty: no sharing)."""
    m = cfg.model
    return owners(m.num_layers or 0, m.num_unique_layers, m.param_sharing_style)


def check_sharing(ch: Checker, kinds: list[str], moe_layers: list[bool]) -> None:
    """GPT-NeoX's two checks, then what sharing needs here: shared layers of one kind, and a
    layout that keeps every shared tensor in one place. ``kinds``: each layer's attention type;
    ``moe_layers``: whether each layer's MLP is a mixture of experts."""
    c = ch.c
    m = c.model
    if m.param_sharing_style not in STYLES:
        ch.fail(
            "param_sharing_style",
            f"must be grouped or spaced, got {m.param_sharing_style!r}",
        )
    unique = m.num_unique_layers
    if unique is None or not m.num_layers:
        return
    key = "num_unique_layers"
    if unique > m.num_layers:
        ch.fail(key, f"{unique} is more than num_layers {m.num_layers}; make it at most that")
    if m.num_layers % unique:
        ch.fail(key, f"num_layers {m.num_layers} is not a multiple of {unique}; make it one")
    held = owners(m.num_layers, unique, m.param_sharing_style)
    for layer, owner in enumerate(held):
        if kinds[layer] != kinds[owner] or moe_layers[layer] != moe_layers[owner]:
            what = f"{kinds[layer]}{' MoE' * moe_layers[layer]}"
            ch.fail(
                key,
                f"layer {layer} ({what}) would share the weights of layer {owner} "
                f"({kinds[owner]}{' MoE' * moe_layers[owner]}); shared layers must be of one "
                "kind: change attention_config, moe_expert_interval or param_sharing_style",
            )
