"""soft_prompt_tuning's start: the prompt from ``init_string``'s token embeddings.

The prompt is drawn uniform in [-init_range, init_range] where a run draws its weights
(``models/transformer.py``); a run that starts it (from scratch, or from a checkpoint without a
prompt: GPT-NeoX's use, a trained model's) and gives ``init_string`` then sets it to the
embeddings of the string's tokens, tokenised with the run's tokenizer, repeated or cut to
n_tokens as GPT-NeoX's SoftEmbedding does. A checkpoint holding a prompt keeps its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchneox.base.errors import ConfigError
from torchneox.config.features.soft_prompt import NAME, soft_prompt
from torchneox.config.schema import NeoXConfig
from torchneox.data.tokenizers import build_tokenizer
from torchneox.models.transformer import Transformer
from torchneox.parallel.shards import local_part


def prompt_rows(embedding: torch.Tensor, ids: list[int], n_tokens: int) -> torch.Tensor:
    """[n_tokens, hidden] the embeddings of ``ids``, repeated or cut to n_tokens."""
    rows = embedding[torch.tensor(ids, dtype=torch.long, device=embedding.device)]
    return rows.repeat(math.ceil(n_tokens / len(ids)), 1)[:n_tokens]


@torch.no_grad()
def start_soft_prompt(model: Transformer, cfg: NeoXConfig, fresh: bool) -> bool:
    """Set the prompt of a run that starts it (``fresh``) from init_string; returns whether it
    did. Every rank calls it (a sharded embedding is gathered whole)."""
    spec = soft_prompt(cfg)
    if spec is None or not fresh or not spec.init_string or model.soft_prompt is None:
        return False
    ids = build_tokenizer(cfg.tokenizer).encode(spec.init_string)
    if not ids:
        raise ConfigError(
            f"init_string {spec.init_string!r} has no tokens in the run's tokenizer; give "
            "another or drop it (the prompt is then drawn from init_range)",
            key=NAME,
        )
    embed = model.embed.weight
    whole = embed.full_tensor() if isinstance(embed, DTensor) else embed
    rows = prompt_rows(whole, ids, spec.n_tokens)
    local, where = local_part(model.soft_prompt.weight)
    local.copy_(rows if where is None else rows[where])
    return True


def before_text(prep: Any, n_tokens: int, seq_length: int, multiple: int = 1) -> Any:
    """Context parallelism: an objective's micro-batch (``Prepared``) as the sequence the
    model runs, the prompt's ``n_tokens`` positions (placeholders, which the model's embedding
    fills with the prompt) before the text cut to ``seq_length - n_tokens``, out of the loss,
    then padding out of the loss to a ``multiple`` of tokens (a curriculum's shorter text: the
    context ranks' 2 x cp equal chunks; causal attention keeps the padding from every earlier
    position); the context ranks then take their chunks of it, and the loss is one process's.
    ``text``: the text's tokens kept (what the objective scores)."""
    text = min(prep.inputs.shape[1], seq_length - n_tokens)
    pad = -(n_tokens + text) % multiple
    mask = prep.mask if prep.mask is not None else torch.ones_like(prep.inputs, dtype=torch.bool)

    def put_after(x: torch.Tensor, value: Any) -> torch.Tensor:
        head = torch.full((x.shape[0], n_tokens), value, dtype=x.dtype, device=x.device)
        tail = torch.full((x.shape[0], pad), value, dtype=x.dtype, device=x.device)
        return torch.cat([head, x[:, :text], tail], dim=1)

    # the post-training objectives' per-position values move with the labels (KTO's
    # rewards, a precomputed reference's and reinforce's sampling log-probabilities)
    moved = {
        name: put_after(value, 0)
        for name in ("rewards", "reference_logp", "old_logp")
        if (value := getattr(prep, name)) is not None and value.dim() == 2
    }
    return dataclasses.replace(
        prep,
        inputs=put_after(prep.inputs, 0),
        labels=put_after(prep.labels, 0),
        mask=put_after(mask, False),
        text=text,
        **moved,
    )
