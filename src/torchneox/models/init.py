"""GPT-NeoX's weight initialisations (`init_method`, `output_layer_init_method`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

InitFn = Callable[[torch.Tensor, torch.Generator | None], None]


def _normal(std: float) -> InitFn:
    return lambda t, g=None: nn.init.normal_(t, mean=0.0, std=std, generator=g)


def init_function(method: str, std: float, num_layers: int, hidden_size: int) -> InitFn:
    """The initialiser GPT-NeoX names ``method`` (init_method_std is ``std``)."""
    if method == "normal":
        return _normal(std)
    if method == "scaled_normal":
        return _normal(std / math.sqrt(2.0 * num_layers))
    if method == "single_residual_scaled_normal":
        return _normal(std / math.sqrt(num_layers))
    if method == "small_init":
        return _normal(math.sqrt(2.0 / (5.0 * hidden_size)))
    if method == "wang_init":
        return _normal(2.0 / num_layers / math.sqrt(hidden_size))
    if method == "orthogonal":
        return lambda t, g=None: nn.init.orthogonal_(t, gain=math.sqrt(2.0), generator=g)
    if method == "scaled_orthogonal":
        return lambda t, g=None: nn.init.orthogonal_(
            t, gain=math.sqrt(2.0 / num_layers), generator=g
        )
    if method == "xavier_uniform":
        return lambda t, g=None: nn.init.xavier_uniform_(t, generator=g)
    if method == "xavier_normal":
        return lambda t, g=None: nn.init.xavier_normal_(t, generator=g)
    raise ValueError(f"unknown init method {method!r}")
