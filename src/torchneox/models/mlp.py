"""The feed-forward block: plain (up -> act -> down) or gated (act(gate) * up -> down)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from torchneox.models.args import ModelArgs


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# GPT-NeoX's names; the gated ones apply the function to the gate half.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "softsign": F.softsign,
    "swish": F.silu,
    "silu": F.silu,
    "mish": F.mish,
    "geglu": F.gelu,
    "reglu": F.relu,
    "swiglu": F.silu,
    "bilinear": _identity,
    "glu": torch.sigmoid,
}


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, w, bias = args.hidden_size, args.mlp_width, args.mlp_bias
        self.act = ACTIVATIONS[args.activation]
        self.up = nn.Linear(h, w, bias=bias)
        self.gate = nn.Linear(h, w, bias=bias) if args.gated else None
        self.down = nn.Linear(w, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(self.act(self.up(x)))
        return self.down(self.act(self.gate(x)) * self.up(x))
