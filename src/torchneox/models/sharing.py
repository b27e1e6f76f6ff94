"""Layer weight sharing in the model: the layers that share an owner's weights hold the owner's
parameters themselves (the same ``nn.Parameter`` objects), so ``parameters()`` and
``named_parameters()`` give each shared tensor once, under its owner's name.

Anything that replaces a module's parameters (``to_empty``, ``.to()``, tensor parallelism,
FSDP2's materialisation) gives each module a tensor of its own: ``tie_layers`` makes them one
again, and ``Transformer._apply`` calls it after every move. A state dict holds each shared
tensor once (the owner's key); loading one fills the sharers' keys from their owner's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _plain(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def tie_layers(model: nn.Module) -> None:
    """Every layer that shares weights holds its owner's parameters (a pipeline stage ties
    what it holds of both)."""
    owners = model.args.layer_owners
    layers = model.layers
    for layer, owner in enumerate(owners):
        if owner == layer or str(layer) not in layers or str(owner) not in layers:
            continue
        theirs = dict(layers[str(owner)].named_modules())
        for name, module in layers[str(layer)].named_modules():
            for pname in list(module._parameters):
                source = theirs[name]._parameters[pname]
                if module._parameters[pname] is not source:
                    module._parameters[pname] = source


def shared_keys(model: nn.Module) -> dict[str, str]:
    """Each sharer's parameter (its plain name) -> the owner's it holds."""
    owners = model.args.layer_owners
    out: dict[str, str] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        plain = _plain(name)
        parts = plain.split(".")
        if parts[0] != "layers":
            continue
        layer = int(parts[1])
        if owners[layer] != layer:
            out[plain] = ".".join(["layers", str(owners[layer]), *parts[2:]])
    return out


def drop_shared(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """state_dict's post hook: the sharers' keys dropped (their owner's holds the tensor)."""
    for key in shared_keys(module):
        state.pop(prefix + key, None)


def fill_shared(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict's pre hook: each sharer's key given its owner's tensor."""
    for key, owner in shared_keys(module).items():
        if prefix + owner in state and prefix + key not in state:
            state[prefix + key] = state[prefix + owner]


def install(model: nn.Module) -> None:
    """Tie the layers and hook the state dict (a model without sharing is left alone)."""
    if not model.args.layer_owners:
        return
    tie_layers(model)
    model.register_state_dict_post_hook(drop_shared)
    model.register_load_state_dict_pre_hook(fill_shared)


def per_layer_state(model: nn.Module, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state dict (``model``'s, or ``state`` taken from it) with every layer's tensors
    under its own name (a sharer's a copy of its owner's): what formats without sharing
    (Hugging Face, whose safetensors files refuse one tensor under two names) are written
    from."""
    state = model.state_dict() if state is None else state
    if model.args.layer_owners:
        for key, owner in shared_keys(model).items():
            state[key] = state[owner].clone()
    return state
