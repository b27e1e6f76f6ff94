"""muP's optimizer groups: each parameter group split by mup's rule (MuAdam for the Adam
family, MuSGD for sgd), a parameter's InfShape taken by its name from the base shapes, so that
the learning rates are the same in every layout (FSDP2's and tensor parallelism's DTensors keep
no ``infshape`` attribute)."""

from __future__ import annotations

from typing import Any

import torch
from mup.optim import MuAdam, MuSGD
from torch import nn

from torchneox.models.args import MupScales
from torchneox.models.lora import adapted_weight
from torchneox.models.mup import infshape
from torchneox.models.params import is_adapter, plain_name


class _Tagged:
    """A parameter with its InfShape, which is all mup's MuAdam/MuSGD read of it."""

    def __init__(self, param: torch.Tensor, shape: Any):
        self.param, self.infshape = param, shape


def _groups_only(groups: list[dict], **_: Any) -> list[dict]:
    return groups


def mup_groups(
    model: nn.Module, groups: list[dict[str, Any]], kind: str, lr: float, mup: MupScales
) -> list[dict[str, Any]]:
    """``groups`` split by mup's rule (MuSGD for sgd, MuAdam for the Adam-likes), each
    parameter's InfShape taken by its name from the base shapes; each group's ``lr_scale``
    is its learning rate over ``lr`` (what the schedule's rate is multiplied by)."""
    names = {id(p): plain_name(n).removeprefix("module.") for n, p in model.named_parameters()}
    bases = dict(mup.base_shapes)
    out, tagged = [], []
    for g in groups:
        plain = [p for p in g["params"] if not is_adapter(names[id(p)])]
        tagged.append(
            g | {"params": [_Tagged(p, infshape(mup, names[id(p)], p.shape, bases)) for p in plain]}
        )
        adapters = [p for p in g["params"] if is_adapter(names[id(p)])]
        out += _adapter_groups(g, adapters, names, bases, lr, kind)
    rule = MuSGD if kind == "sgd" else MuAdam
    for g in rule(tagged, impl=_groups_only, lr=lr):
        if g["params"]:
            out.append(g | {"params": [t.param for t in g["params"]], "lr_scale": g["lr"] / lr})
    return out


def _adapter_groups(
    group: dict, adapters: list, names: dict, bases: dict, lr: float, kind: str
) -> list[dict[str, Any]]:
    """LoRA's adapters under muP (torchneox's choice, docs/post-training.md), each ranked by
    where its width lies, as muP ranks a layer: A [rank, in] (an expert's [E, in, rank]) has
    the model's width as fan-in and a fixed fan-out, as muP's output layer: its learning rate
    divided by the width multiplier (in over the base shape's in, read from the weight it
    adapts), under Adam and SGD alike. B [out, rank] has a fixed fan-in, as muP's input
    layer: its rate kept under Adam, multiplied by the out multiplier under SGD. Their
    initialisation is PEFT's: A uniform in +-1/sqrt(in) (muP's fan-in scaling), B zeros."""
    out = []
    for p in adapters:
        name = names[id(p)]
        base = bases.get(adapted_weight(name.rsplit(".lora_", 1)[0]))
        dim = 0 if p.dim() == 2 else 2  # a linear's [out, in], an expert's [E, in, out]
        a = name.endswith("lora_A.weight")
        width = None if base is None else base[1 if a else dim]  # None: not a width
        if width is None or not (a or kind == "sgd"):
            scale = 1.0
        else:
            scale = width / p.shape[1] if a else p.shape[dim] / width
        out.append(group | {"params": [p], "lr": lr * scale, "lr_scale": scale})
    return out
