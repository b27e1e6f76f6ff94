"""The feed-forward block: plain (up -> act -> down) or gated (act(gate) * up -> down)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from torchneox.models.args import ModelArgs
from torchneox.models.linear import Linear


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


SQRT_2_OVER_PI = 0.79788456  # GPT-NeoX's constant, as it writes it (fp32 rounds it as sqrt(2/pi))


class _TanhGelu(torch.autograd.Function):
    """GPT-NeoX's fused bias_gelu (``bias_gelu_fusion: true``): the tanh approximation of gelu,
    x/2 (1 + tanh(0.79788456 x (1 + 0.044715 x^2))), with GPT-NeoX's hand-written derivative."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(SQRT_2_OVER_PI * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(SQRT_2_OVER_PI * x * (1 + 0.044715 * x * x))
        slope = 0.5 * x * ((1 - t * t) * (SQRT_2_OVER_PI + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return slope * grad


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return _TanhGelu.apply(x)


def onnx_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's gelu under ``onnx_safe: true``: erf with its rounded sqrt(2), 1.41421."""
    return x * 0.5 * (torch.erf(x / 1.41421) + 1.0)


# GPT-NeoX's names; the gated ones apply the function to the gate half. gelu_tanh and
# gelu_onnx are GPT-NeoX's gelu under bias_gelu_fusion and onnx_safe (ModelArgs picks them).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": tanh_gelu,
    "gelu_onnx": onnx_gelu,
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
        self.up = Linear(h, w, bias=bias)
        self.gate = Linear(h, w, bias=bias) if args.gated else None
        self.down = Linear(w, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(self.act(self.up(x)))
        return self.down(self.act(self.gate(x)) * self.up(x))
