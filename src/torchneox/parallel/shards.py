"""This rank's part of a sharded parameter (a DTensor's local tensor and the slice of the whole
it holds), told to the model's initialisation from outside: the model draws every weight whole
from the generator of its name and keeps the part this says, so that every layout starts from
one process's weights."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_part(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """This rank's tensor of ``param`` and where it sits in the whole one (None: it is whole)."""
    if not isinstance(param, DTensor):
        return param, None
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
