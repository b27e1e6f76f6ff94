"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values from one compressed latent.

Per token, the hidden state goes down to a latent of ``mla_kv_rank`` (``wkv_a``, which also
gives one rotary key of ``mla_rope_dim`` shared by every head), the latent is normalised
(``kv_norm``, an RMSNorm) and goes up to each head's position-free key part (``mla_nope_dim``)
and its value (``mla_v_dim``) through ``wkv_b``. Queries come straight from the hidden state
(``wq``) or, with ``mla_q_rank``, through their own normalised latent (``wq_a``, ``q_norm``,
``wq_b``); each head's query is ``mla_nope_dim`` position-free dimensions then
``mla_rope_dim`` rotary ones. A head's key is its own position-free part then the shared rotary
key, so the scores are q_nope . k_nope + q_rope . k_rope, scaled by 1/sqrt(nope + rope) (times
YaRN's mscale(factor, mscale_all_dim) squared where rope scaling sets mscale_all_dim, as
DeepSeek-V3 does).

The KV cache keeps what the keys and values are rebuilt from, not the keys and values: per
token, the normalised latent and the rotated rotary key (``mla_kv_rank + mla_rope_dim``
numbers, whatever the heads), as ``kv_cache_widths`` (mixers/attention.py) sizes ``KVCache``.

Under tensor parallelism the down projections (``wq_a``, ``wkv_a``) and the latents' norms are
whole on every rank and the up projections (``wq``/``wq_b``, ``wkv_b``) and ``wo`` are split by
heads (parallel/tensor_parallel.py); the shared rotary key meets only this rank's heads, so the
plan sets ``shared_key_grad`` to sum its gradient over the ranks.

Under context parallelism each rank rotates its own tokens' rotary key at their positions in
the whole sequence (``rope`` is taken there), and ``bias.gather`` brings every rank's latents
and rotary keys (not the heads' keys and values); the keys and values are then rebuilt from the
whole sequence and the rank's queries attend to them under the context mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from torchneox.models.args import ModelArgs
from torchneox.models.linear import Linear
from torchneox.models.mixers.attention import Attention, AttentionBias, KVCache
from torchneox.models.norms import build_norm
from torchneox.models.positions import apply_rotary


def mla_scale(args: ModelArgs) -> float:
    """DeepSeek-V3's softmax scale: 1/sqrt(qk head dims), times YaRN's mscale squared where the
    rope scaling has mscale_all_dim (0.1 x mscale_all_dim x ln(factor) + 1, for factor > 1)."""
    scale = (args.mla_nope_dim + args.mla_rope_dim) ** -0.5
    spec = dict(args.rope_scaling)
    all_dim, factor = spec.get("mscale_all_dim"), spec.get("factor", 1.0)
    if spec and all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLA(Attention):
    """The mixer of an MLA layer. State dict: ``wq`` [heads x (nope + rope), H] or ``wq_a``
    [q_rank, H], ``q_norm`` [q_rank], ``wq_b`` [heads x (nope + rope), q_rank]; ``wkv_a``
    [kv_rank + rope, H], ``kv_norm`` [kv_rank], ``wkv_b`` [heads x (nope + v), kv_rank], ``wo``
    [H, heads x v] (each head's rows together, nope before rope, keys before values)."""

    shared_key_grad: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Tensor parallelism: the rotary key's gradient summed over the ranks (None: one rank)."""

    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        self.layer = layer
        self.nope, self.rope = args.mla_nope_dim, args.mla_rope_dim
        self.v_dim, self.rank = args.mla_v_dim, args.mla_kv_rank
        self.scale = mla_scale(args)
        self.dropout = args.attention_dropout
        self.grouped = False
        self.qk_norm_scope = None
        h, heads, bias = args.hidden_size, args.num_heads, args.attn_bias
        q_width = heads * (self.nope + self.rope)

        def rms(width: int) -> nn.Module:  # DeepSeek's latent norms: eps 1e-6 whatever the model's
            return build_norm("rmsnorm", width, 1e-6, False)

        self.q_latent = bool(args.mla_q_rank)
        if self.q_latent:
            self.wq_a = Linear(h, args.mla_q_rank, bias=bias)
            self.q_norm = rms(args.mla_q_rank)
            self.wq_b = Linear(args.mla_q_rank, q_width, bias=False)
        else:
            self.wq = Linear(h, q_width, bias=False)
        self.wkv_a = Linear(h, self.rank + self.rope, bias=bias)
        self.kv_norm = rms(self.rank)
        self.wkv_b = Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = Linear(heads * self.v_dim, h, bias=args.attn_out_bias)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q = self.wq_b(self.q_norm(self.wq_a(x_BTD))) if self.q_latent else self.wq(x_BTD)
        q = q.view(b, t, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x_BTD).split([self.rank, self.rope], dim=-1)
        if self.shared_key_grad is not None:
            k_rope = self.shared_key_grad(k_rope)
        latent, k_rope = self.kv_norm(latent)[:, None], k_rope[:, None]  # [B, 1, T, *]
        assert rope is not None, "MLA needs rotary positions"
        q_rope, k_rope = apply_rotary(q_rope, *rope), apply_rotary(k_rope, *rope)
        if cache is not None:  # the latent and the rotary key, not the heads' keys and values
            latent, k_rope = cache.update(self.layer, latent, k_rope)
        if bias.gather is not None:  # context parallel: every rank's latents
            latent, k_rope = bias.gather(latent, k_rope)
        k, v = self._keys_values(latent[:, 0], k_rope)
        out = self._attend(torch.cat((q_nope, q_rope), dim=-1), k, v, bias)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def _keys_values(
        self, latent_BSC: torch.Tensor, k_rope_B1SR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's keys [B, heads, S, nope + rope] and values [B, heads, S, v] from the
        latents and the shared rotary keys."""
        b, s, _ = latent_BSC.shape
        kv = self.wkv_b(latent_BSC).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope_B1SR.expand(-1, k_nope.shape[1], -1, -1)
        return torch.cat((k_nope, k_rope), dim=-1), v
