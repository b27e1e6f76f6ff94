"""DeepSeek-V3's multi-token prediction (MTP): ``mtp_num_layers`` modules after the last layer.

Module k (1..D) reads the previous depth's hidden state h (depth 0: the last layer's output,
before the final norm) and, at each position t, the embedding of the token k positions ahead:

    h_k = block_k(eh_proj([enorm(embed(token[t + k])), hnorm(h_{k-1})]))
    logits_k = head(shared_head.norm(h_k))

a block of the last layer's kind, and the model's own embedding and output head (shared, not
copied). Depth k's logits at t predict the token k + 1 past the next one (the label at t + k);
the last k positions have no token ahead and count for nothing (their loss mask is 0). The
parameters are named as DeepSeek-V3's, so a Hugging Face name maps by one rule:
``mtp.{k-1}.{enorm,hnorm,eh_proj,shared_head.norm}`` and the block's own names
(``mtp.{k-1}.attention.wq.weight``...) are its ``model.layers.{num_layers + k - 1}.*``.

Training reads them (the model's forward given ``mtp_tokens_BT``: under context parallelism the
whole sequence's inputs, of which each rank embeds the tokens ahead of its own positions);
generation leaves them out, unless it drafts with depth 1 (``draft_logits``: speculative
decoding, inference/speculative.py).
"""

from __future__ import annotations

import torch
from torch import nn

from torchneox.models.args import ModelArgs
from torchneox.models.block import Block
from torchneox.models.linear import Linear
from torchneox.models.mixers.attention import AttentionBias, KVCache
from torchneox.models.moe import RouterStats
from torchneox.models.norms import build_norm


def ahead(x_BT: torch.Tensor, k: int) -> torch.Tensor:
    """``x_BT`` moved k positions left, the last k positions zero (False, for a mask)."""
    t = x_BT.shape[1]
    pad = x_BT.new_zeros(x_BT.shape[0], min(k, t))
    return torch.cat([x_BT[:, k:], pad], dim=1)


class SharedHead(nn.Module):
    """DeepSeek-V3's ``shared_head``: the module's own norm before the model's output head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = build_norm(args.norm, args.hidden_size, args.norm_eps, args.norm_bias)


class MTPLayer(Block):
    """One MTP depth: the two norms, eh_proj (2h -> h), a block of the last layer's kind (its
    sublayers are this module's own, under the block's names) and ``shared_head.norm``."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, args.num_layers - 1)
        h = args.hidden_size
        self.enorm = build_norm(args.norm, h, args.norm_eps, args.norm_bias)
        self.hnorm = build_norm(args.norm, h, args.norm_eps, args.norm_bias)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(args)

    def forward(  # type: ignore[override]
        self,
        h: torch.Tensor,
        embedded: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, RouterStats | None]:
        """This depth's hidden state (before ``shared_head.norm``) and its router statistics
        (``cache``: the module's own, when generation drafts with it)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        return super().forward(x, rope, bias, cache)


def build_mtp(args: ModelArgs) -> nn.ModuleDict | None:
    if not args.mtp_depth:
        return None
    return nn.ModuleDict({str(k): MTPLayer(args) for k in range(args.mtp_depth)})


def mtp_logits(
    model: nn.Module, h, tokens_BT, rope, bias, stats: list, index: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Each depth's logits from the last layer's output ``h`` and the inputs ``tokens_BT``
    (``model``: the Transformer; its embedding and head are the ones used); each MoE block's
    statistics appended to ``stats``. ``index``: context parallelism's positions of this
    rank's tokens, ``tokens_BT`` then the whole sequence's (the tokens ahead of a position
    may lie in another rank's part)."""
    out = []
    for k, layer in enumerate(model.mtp.values(), start=1):
        tokens_ahead = ahead(tokens_BT, k)
        if index is not None:
            tokens_ahead = tokens_ahead[:, index]
        embedded = model.embed(tokens_ahead)
        if model.embedded_output is not None:  # sequence parallelism: this rank's slice
            embedded = model.embedded_output(embedded)
        h, layer_stats = layer(h, embedded, rope, bias)
        if layer_stats is not None:
            stats.append(layer_stats)
        out.append(model.logits(layer.shared_head.norm(h)))
    return out


def mtp_depths(model: nn.Module, h, tokens_BT, rope, bias, stats: list, index=None) -> list:
    """Each depth's logits when the forward was given ``tokens_BT`` and ``model`` holds the
    MTP modules and its head (a pipeline's last stage; the forward returns (logits, depth 1's
    logits, ..., depth D's): tensors, as a stage's output must be); else none."""
    if tokens_BT is None or model.mtp is None or model.final_norm is None:
        return []
    return mtp_logits(model, h, tokens_BT, rope, bias, stats, index)


def draft_cache(model: nn.Module, batch: int, room: int, dtype, device) -> KVCache:
    """A KV cache for depth 1's block alone (it computes as the last layer does, under that
    layer's index): ``room`` positions."""
    cache = KVCache(model.args, batch, room, dtype, device)
    last = model.args.num_layers - 1
    row = cache.slot_of[last]
    cache.k, cache.v = cache.k[row : row + 1].clone(), cache.v[row : row + 1].clone()
    cache.slot_of = {last: 0}
    return cache


def draft_logits(
    model: nn.Module, h_BTH: torch.Tensor, ahead_BT: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Depth 1's logits [B, T, V] at the T positions after ``cache``'s (``draft_cache``) from
    the last layer's outputs there and the tokens one ahead of them: at each, the prediction
    of the token after next, as training computes it (``mtp_logits``)."""
    t, start = h_BTH.shape[1], cache.length
    rope = model._rope(None, start, t)
    bias = model._attention_bias(t, start, None, h_BTH.device)
    layer = model.mtp["0"]
    embedded = model.embed(ahead_BT)
    x, _ = layer(h_BTH, embedded, rope, bias, cache)
    cache.length += t
    return model.logits(layer.shared_head.norm(x))
