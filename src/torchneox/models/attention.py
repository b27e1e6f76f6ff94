"""Causal self-attention through scaled_dot_product_attention, with GQA and a KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from torchneox.models.args import ModelArgs
from torchneox.models.positions import apply_rotary


@dataclass
class AttentionBias:
    """What SDPA needs besides q, k, v: an explicit mask/bias or the causal flag."""

    mask: torch.Tensor | None
    """bool [B|1, 1, T, S] (True = attend) or float [B|1, H, T, S] added to the scores."""
    is_causal: bool


class KVCache:
    """Keys and values of every layer, preallocated for ``max_len`` positions."""

    def __init__(
        self,
        args: ModelArgs,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (args.num_layers, batch, args.num_kv_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    def update(
        self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k_BHTD.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        self.k[layer, :, :, self.length : end] = k_BHTD
        self.v[layer, :, :, self.length : end] = v_BHTD
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.head_dim = args.head_dim
        self.dropout = args.attention_dropout
        self.grouped = args.num_kv_heads != args.num_heads
        bias = args.attn_bias
        h, q_width, kv_width = (
            args.hidden_size,
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        self.wq = nn.Linear(h, q_width, bias=bias)
        self.wk = nn.Linear(h, kv_width, bias=bias)
        self.wv = nn.Linear(h, kv_width, bias=bias)
        self.wo = nn.Linear(q_width, h, bias=args.attn_out_bias)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x_BTD).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x_BTD).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x_BTD).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias.mask,
            is_causal=bias.is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.grouped,
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))
