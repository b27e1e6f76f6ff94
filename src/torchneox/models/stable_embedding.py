"""GPT-NeoX's learned position embedding under use_bnb_optimizer: bitsandbytes'
``bnb.nn.StableEmbedding``, written in torch (the same computation whether bitsandbytes is
installed or not): the lookup, then a LayerNorm computed in fp32 and cast back to the
weight's dtype. Its parameters are ``weight`` and ``norm.weight`` / ``norm.bias``, the names a
GPT-NeoX checkpoint gives them under ``position_embeddings``. GPT-NeoX draws the weight with
its init_method after construction (over StableEmbedding's xavier_uniform), so it is drawn as
any position embedding is; the norm starts at ones and zeros."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StableEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.norm = nn.LayerNorm(embedding_dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        emb = super().forward(input)
        norm = self.norm
        out = F.layer_norm(
            emb.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps
        )
        return out.to(self.weight.dtype)
