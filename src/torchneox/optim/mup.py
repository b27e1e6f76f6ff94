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
from torchneox.models.mup import infshape
from torchneox.models.transformer import plain_name


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
    tagged = [
        g
        | {"params": [_Tagged(p, infshape(mup, names[id(p)], p.shape, bases)) for p in g["params"]]}
        for g in groups
    ]
    rule = MuSGD if kind == "sgd" else MuAdam
    out = []
    for g in rule(tagged, impl=_groups_only, lr=lr):
        if g["params"]:
            out.append(g | {"params": [t.param for t in g["params"]], "lr_scale": g["lr"] / lr})
    return out
