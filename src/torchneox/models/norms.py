"""Normalisation layers selected by the `norm` key."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (eps inside the root, as Llama and torch define it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class HeadRMSNorm(nn.Module):
    """GPT-NeoX's query/key rmsnorm: each head normalised over its dimensions, with a weight
    for every head and dimension ([heads, head_dim]); the input is [..., heads, head_dim]."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.weight.shape[-1],), None, self.eps) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class ScaleNorm(nn.Module):
    """x / max(||x||, eps) * g, with one learned scalar g."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True).clamp(min=self.eps) * self.g

    def reset_parameters(self) -> None:
        nn.init.ones_(self.g)


def build_norm(kind: str, dim: int, eps: float, bias: bool) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "non_parametric_layernorm":
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "scalenorm":
        return ScaleNorm(eps)
    raise ValueError(f"unknown norm {kind!r}")
