"""gMLP and aMLP blocks (attention_config ``gmlp`` / ``amlp``), as GPT-NeoX computes them.

GPT-NeoX's ``GMLPBlock`` (megatron/model/gmlp.py), after the block's norm::

    x = act(input_linear(x))               # hidden -> 2 x ff, ff = 4 x hidden, no bias
    res, gate = x.chunk(2)                 # spatial gating unit
    gate = W[:T, :T] (causal) @ norm(gate) + b[:T]     # W: seq x seq, mixing positions
    gate = gate + tiny_attention(x)        # aMLP only: one head of width gmlp_attn_dim
    out = output_linear(gate * res)        # ff -> hidden, no bias

``W`` starts at zero and ``b`` at one, so every block starts as ``res * 1``. The projections'
biases exist in GPT-NeoX's checkpoints but are never added (``skip_bias_add`` and the bias
dropped), so torchneox builds none. The tiny attention reads both halves (before the norm)
and keeps its biases (plain ``nn.Linear``, PyTorch's default initialisation).

Departures (docs/migrating-from-gpt-neox.md): the block keeps the residual every block here
has (``x + gmlp(norm(x))``, as the gMLP paper; GPT-NeoX returns the output alone); the
sequence length is the input's (GPT-NeoX reads the micro-batch size for it, so it runs only
when the two are equal).

A shorter input uses the top-left part of ``W`` (exact: causal). Decoding keeps each earlier
position's normalised gate (and the tiny attention's keys and values) in the cache: a new
token's gate is its row of ``W`` against them, which is what recomputing the prefix gives.
Left padding is exact: each row's positions count from its first real token (``W`` and ``b``
are indexed by those positions) and padded positions are masked out.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from torchneox.base.errors import ConfigError
from torchneox.config.sizes import gmlp_width
from torchneox.models.args import ModelArgs
from torchneox.models.init import InitFn, init_function
from torchneox.models.linear import Linear
from torchneox.models.mixers.attention import AttentionBias, KVCache, StaticKVCache
from torchneox.models.mlp import ACTIVATIONS
from torchneox.models.norms import build_norm

Writers = Callable[[str], Callable[[torch.Tensor], torch.Tensor]]
"""A layer's cache: ``writers(name)(rows)`` stores this forward's rows of the cached tensor
``name`` ([B, T, ...]) and returns all of its rows so far ([B, S, ...])."""


class TinyAttention(nn.Module):
    """aMLP's one-head causal attention over both halves, of width ``d_attn``."""

    def __init__(self, d_ff: int, d_attn: int):
        super().__init__()
        self.proj_qkv = Linear(2 * d_ff, 3 * d_attn)
        self.proj_ffn = Linear(d_attn, d_ff)

    def forward(
        self, x_BTF: torch.Tensor, allowed: torch.Tensor | None, writers: Writers | None = None
    ) -> torch.Tensor:
        """``allowed``: [B|1, T, S] the keys each query sees (None: causal over this input);
        ``writers``: the cache's (``_cache_slots``), which keep the keys and values."""
        q, k, v = self.proj_qkv(x_BTF).chunk(3, dim=-1)
        if writers is not None:
            k, v = writers("k")(k), writers("v")(v)
        q, k, v = q[:, None], k[:, None], v[:, None]
        if allowed is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.proj_ffn(out[:, 0])


class SpatialGatingUnit(nn.Module):
    def __init__(self, args: ModelArgs, d_ff: int, d_attn: int | None):
        super().__init__()
        self.seq_length = args.seq_length
        self.norm = build_norm(args.norm, d_ff, args.norm_eps, args.norm_bias)
        self.proj = nn.Linear(args.seq_length, args.seq_length)
        self.attn = TinyAttention(d_ff, d_attn) if d_attn is not None else None


class GMLP(nn.Module):
    """A gMLP (or, for ``amlp`` layers, aMLP) mixer: [B, T, hidden] -> [B, T, hidden]."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        h, ff = args.hidden_size, gmlp_width(args.hidden_size)
        self.act = ACTIVATIONS[args.activation]  # gated names: their function, ungated (GPT-NeoX)
        self.input_linear = Linear(h, 2 * ff, bias=False)
        amlp = args.layer_type(layer) == "amlp"
        self.sgu = SpatialGatingUnit(args, ff, args.gmlp_attn_dim if amlp else None)
        self.output_linear = Linear(ff, h, bias=False)
        self.tp = None
        """Tensor parallelism's collectives (parallel/families.py's ``Split``): the block
        split over tensor ranks by channels."""

    def forward(
        self,
        x_BTH: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = self.input_linear(x_BTH)
        x = self.act(x if self.tp is None else self.tp.whole(x))
        res, gate = x.chunk(2, dim=-1)
        gate = self.sgu.norm(gate)
        t = x.shape[1]
        if cache is None and bias.valid_BS is None:  # training: whole sequences from 0
            gate = self._gate_whole(gate, t)
            allowed, writers = None, None
        else:
            allowed, gate, writers = self._gate_cached(gate, bias, cache)
        if self.tp is not None:  # the norm and the gating whole; then this rank's channels
            res, gate = self.tp.parts(self.tp.copy(torch.cat([res, gate], -1)), 2)
        if self.sgu.attn is not None:
            gate = gate + self.sgu.attn(x, allowed, writers)
        return self.output_linear(gate * res)

    def _too_long(self, length: int) -> ConfigError:
        return ConfigError(
            f"a sequence of {length} tokens is longer than seq_length {self.sgu.seq_length}: "
            "a gmlp/amlp layer's spatial gating covers seq_length positions; generate or "
            "evaluate at most that many",
            key="seq_length",
        )

    def _gate_whole(self, gate_BTF: torch.Tensor, t: int) -> torch.Tensor:
        """W's causal top-left T x T part over the positions, and b's first T entries."""
        if t > self.sgu.seq_length:
            raise self._too_long(t)
        weight, b = self.sgu.proj.weight[:t, :t].tril(), self.sgu.proj.bias[:t]
        return torch.matmul(weight.to(gate_BTF.dtype), gate_BTF) + b.to(gate_BTF.dtype)[:, None]

    def _gate_cached(
        self, gate_BTF: torch.Tensor, bias: AttentionBias, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor, Writers | None]:
        """Decoding or padded rows: (which keys each query may see [B|1, T, S] for the tiny
        attention, the gate, the tiny attention's cache writers or None)."""
        t, seq = gate_BTF.shape[1], self.sgu.seq_length
        # the last position this forward can reach (a static cache: its whole buffer)
        end = t if cache is None else cache.length + t
        end = cache.max_len if isinstance(cache, StaticKVCache) else end
        if end > seq:
            raise self._too_long(end)
        q_idx, writers = _cache_slots(cache, self.layer, t, gate_BTF.device)
        keys = writers("gate")(gate_BTF) if writers is not None else gate_BTF
        s = keys.shape[1]
        k_idx = torch.arange(s, device=gate_BTF.device)
        allowed = (k_idx[None, :] <= q_idx[:, None])[None]  # [1, T, S]
        if bias.valid_BS is None:
            q_pos, k_pos = q_idx[None], k_idx[None]
        else:  # positions count from each row's first real token; padding is never seen
            valid = bias.valid_BS
            real = (valid.long().cumsum(1) - 1).clamp(min=0)
            q_pos, k_pos, allowed = real[:, q_idx], real, allowed & valid[:, None, :]
        w = self.sgu.proj.weight[q_pos[:, :, None], k_pos[:, None, :]] * allowed
        b = self.sgu.proj.bias[q_pos]
        gate = torch.matmul(w.to(keys.dtype), keys) + b.to(keys.dtype)[..., None]
        # a padded query still sees itself in the tiny attention, so no row is empty
        allowed = allowed | (k_idx[None, :] == q_idx[:, None])[None]
        return allowed, gate, writers


def _cache_slots(
    cache: KVCache | None, layer: int, t: int, device: torch.device
) -> tuple[torch.Tensor, Writers | None]:
    """The cache positions of this forward's tokens [T], and a writer per cached tensor name
    (it stores this forward's rows and returns every cached row, [B, S, ...]); no writers
    without a cache."""
    if cache is None:
        return torch.arange(t, device=device), None
    state = cache.state(layer)
    static = isinstance(cache, StaticKVCache)
    q_idx = (
        cache.queries(t) if static else torch.arange(cache.length, cache.length + t, device=device)
    )

    def writer(name: str):
        def write(rows: torch.Tensor) -> torch.Tensor:
            if name not in state:
                shape = (rows.shape[0], cache.max_len, *rows.shape[2:])
                state[name] = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
            buffer = state[name]
            if static:
                buffer.index_copy_(1, q_idx, rows.to(buffer.dtype))
                return buffer
            buffer[:, cache.length : cache.length + t] = rows.to(buffer.dtype)
            return buffer[:, : cache.length + t]

        return write

    return q_idx, writer


def _torch_default(tensor: torch.Tensor, generator: torch.Generator | None, fan_in: int) -> None:
    """nn.Linear's own initialisation (weight and bias uniform in +-1/sqrt(fan_in)), which
    GPT-NeoX's tiny attention keeps."""
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(tensor, -bound, bound, generator=generator)


def gmlp_init(args: ModelArgs, name: str) -> InitFn | None:
    """The gMLP block's own initialisations (``name`` inside the block): W zero, b one, the
    tiny attention as nn.Linear, output_linear by output_layer_init_method."""
    ff = gmlp_width(args.hidden_size)
    if name == "gmlp.sgu.proj.weight":
        return lambda t, g=None: nn.init.zeros_(t)
    if name == "gmlp.sgu.proj.bias":
        return lambda t, g=None: nn.init.ones_(t)
    fan_in = {"gmlp.sgu.attn.proj_qkv": 2 * ff, "gmlp.sgu.attn.proj_ffn": args.gmlp_attn_dim}
    module = name.rpartition(".")[0]
    if module in fan_in:
        return lambda t, g=None: _torch_default(t, g, fan_in[module])
    if name == "gmlp.output_linear.weight":
        method = args.output_init_method
        return init_function(method, args.init_std, args.num_layers, args.hidden_size)
    return None
