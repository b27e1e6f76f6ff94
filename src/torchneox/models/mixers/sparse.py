"""Block-sparse attention: GPT-NeoX's ``local``, ``sparse_fixed``, ``sparse_variable``,
``bigbird`` and ``bslongformer`` layers.

The same attention as ``global`` (the same parameters and names), whose scores are limited to
the blocks of the layer's layout (config/features/sparsity.py: DeepSpeed's rules, [heads, blocks,
blocks] over ``seq_length``), ANDed with the causal mask and whatever else the call masks
(padding, documents, ALiBi's biases). The layout is fixed per layer, computed at build from
the layer's index (each layer its own random blocks) and kept as a non-persistent buffer;
the mask is taken at the positions of the call's queries and keys: 0..T in training, after
the cache's length when decoding, the gathered positions under context parallelism.

Where it runs: on the CPU (and wherever the call masks more than causality) a dense boolean
mask through ``scaled_dot_product_attention``; on CUDA, for whole sequences from position 0
without dropout (training and prefill), FlexAttention with a block mask built once per length
from the layout (``torch.nn.attention.flex_attention``, compiled once per process).

In a model with multi-head latent attention (``mla_kv_lora_rank``) a block-sparse layer is
MLA under its layout (``SparseMLA``): the same latents, the scores limited alike.

Under tensor parallelism each rank holds a slice of the heads; ``keep_heads`` makes it use
those heads' layouts (different_layout_per_head), so every layout computes what one process
computes.
"""

from __future__ import annotations

import torch

from torchneox.config.features.sparsity import build_layout
from torchneox.models.args import ModelArgs
from torchneox.models.mixers.attention import Attention, AttentionBias
from torchneox.models.mixers.mla import MLA

_COMPILED_FLEX = None


class SparseAttention(Attention):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer)
        self._init_layout(args, layer)

    def _init_layout(self, args: ModelArgs, layer: int) -> None:
        spec = args.sparsity(layer)
        assert spec is not None, f"layer {layer} is not a block-sparse layer"
        self.spec, self.num_heads, self.seq_length = spec, args.num_heads, args.seq_length
        self.heads = (0, args.num_heads)
        """This rank's query heads [first, end) (tensor parallelism keeps a slice)."""
        self.register_buffer("layout", self._layout(None), persistent=False)
        self._block_masks: dict[tuple, object] = {}

    def _layout(self, device: torch.device | str | None) -> torch.Tensor:
        layout = build_layout(self.spec, self.num_heads, self.seq_length, self.layer)
        return torch.from_numpy(layout).to("cpu" if device is None else device)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the layout on ``device`` (after ``to_empty``)."""
        self.layout = self._layout(device)
        self._block_masks.clear()

    def keep_heads(self, rank: int, ranks: int) -> None:
        """Tensor parallelism: this rank holds query heads ``rank``/``ranks`` of the layer's."""
        per_rank = self.num_heads // ranks
        self.heads = (rank * per_rank, (rank + 1) * per_rank)
        self._block_masks.clear()

    def _head_layouts(self) -> torch.Tensor:
        """[heads of this rank | 1, blocks, blocks]."""
        if self.layout.shape[0] == 1:
            return self.layout
        return self.layout[self.heads[0] : self.heads[1]]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: AttentionBias
    ) -> torch.Tensor:
        flex = _flex_applies(q, bias, self.dropout if self.training else 0.0)
        if flex and q.shape[-1] == v.shape[-1]:
            return self._flex(q, k, v)
        q_slot, k_slot = _positions(bias, q.shape[-2], k.shape[-2], q.device)
        q_pos, k_pos = q_slot[None], k_slot[None]
        if bias.valid_BS is not None:  # left padding: a row's positions count its real tokens
            k_pos = (bias.valid_BS.long().cumsum(-1) - 1).clamp(min=0)
            q_pos = k_pos[:, q_slot]
        allowed = sparse_mask(self._head_layouts(), self.spec.block, q_pos, k_pos)
        mask = bias.mask
        if mask is None:
            mask = allowed & (k_slot[None, :] <= q_slot[:, None])
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:  # ALiBi's biases: -inf outside the layout
            mask = mask.masked_fill(~allowed, float("-inf"))
        dense = AttentionBias(mask, is_causal=False, gather=bias.gather, valid_BS=bias.valid_BS)
        return super()._attend(q, k, v, dense)

    def _flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        global _COMPILED_FLEX
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        t, s = q.shape[-2], k.shape[-2]
        key = (t, s, q.device)
        if key not in self._block_masks:
            layouts, block = self._head_layouts(), self.spec.block
            shared = layouts.shape[0] == 1

            def mask_mod(b, h, q_idx, kv_idx):
                allowed = layouts[0 if shared else h, q_idx // block, kv_idx // block]
                return allowed & (kv_idx <= q_idx)

            heads = None if shared else layouts.shape[0]
            self._block_masks[key] = create_block_mask(
                mask_mod, None, heads, t, s, device=q.device
            )  # fmt: skip
        return _COMPILED_FLEX(
            q, k, v, block_mask=self._block_masks[key], scale=self.scale, enable_gqa=self.grouped
        )  # fmt: skip


class SparseMLA(MLA, SparseAttention):
    """Multi-head latent attention (mixers/mla.py: its parameters and names) whose scores are
    limited to the blocks of the layer's layout, as ``SparseAttention``'s: a block-sparse
    layer of a model with ``mla_kv_lora_rank``."""

    def __init__(self, args: ModelArgs, layer: int):
        MLA.__init__(self, args, layer)
        self._init_layout(args, layer)


def _flex_applies(q: torch.Tensor, bias: AttentionBias, dropout: float) -> bool:
    """FlexAttention runs whole causal sequences on CUDA (the rest: the dense mask); MLA's
    values, narrower than its queries, take the dense mask."""
    plain = bias.is_causal and bias.mask is None and bias.gather is None
    return q.device.type == "cuda" and plain and dropout == 0.0 and q.shape[-2] > 1


def _positions(
    bias: AttentionBias, t: int, s: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] the positions (cache slots) of the queries, [S] of the keys: the call's (context
    parallelism, a static cache), else the last T of 0..S (training: S = T; decoding after a
    cache)."""
    if bias.positions is not None:
        return bias.positions
    return torch.arange(s - t, s, device=device), torch.arange(s, device=device)


def sparse_mask(
    layouts: torch.Tensor, block: int, q_pos: torch.Tensor, k_pos: torch.Tensor
) -> torch.Tensor:
    """bool [B | 1, heads | 1, T, S]: the layout's blocks at the queries' positions [B | 1, T]
    and the keys' [B | 1, S] (positions past the layout, unwritten slots of a static cache,
    take its last block: they are masked anyway)."""
    last = layouts.shape[-1] - 1
    qb = torch.div(q_pos, block, rounding_mode="floor").clamp(max=last)
    kb = torch.div(k_pos, block, rounding_mode="floor").clamp(max=last)
    return layouts[:, qb[:, :, None], kb[:, None, :]].transpose(0, 1)
