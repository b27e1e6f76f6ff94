"""``torchneox eval``: perplexity of a checkpoint on any .bin/.idx dataset."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from torchneox.base.errors import DataError
from torchneox.data.gpt_dataset import GPTDataset
from torchneox.data.indexed import IndexedDataset
from torchneox.models.transformer import Transformer
from torchneox.train.loss import lm_loss


@torch.no_grad()
def perplexity(
    model: Transformer,
    prefix: str,
    seq_length: int,
    batches: int,
    batch_size: int,
    seed: int = 1234,
) -> dict[str, float]:
    """Mean loss over ``batches`` batches of packed samples from all of the dataset's documents
    (in GPT-NeoX's sample order for ``seed``), and its perplexity."""
    ds = IndexedDataset(prefix)
    if len(ds) == 0:
        raise DataError(f"{prefix}: the dataset has no documents")
    vocab = model.args.vocab_size
    if ds.max_token() >= vocab:
        raise DataError(
            f"{prefix}: token id {ds.max_token()} is outside the model's vocabulary of {vocab}"
        )
    samples = GPTDataset(
        ds, "eval", np.arange(len(ds), dtype=np.int32), batches * batch_size, seq_length, seed
    )
    batches = min(batches, len(samples) // batch_size)
    if batches == 0:
        raise DataError(f"{prefix}: fewer than {batch_size} samples of {seq_length + 1} tokens")
    model.eval()
    device = model.embed.weight.device
    losses = []
    for b in range(batches):
        tokens = torch.from_numpy(
            np.stack([samples[i] for i in range(b * batch_size, (b + 1) * batch_size)])
        )
        tokens = tokens.to(device)
        losses.append(lm_loss(model(tokens[:, :-1]), tokens[:, 1:], None).item())
    loss = float(np.mean(losses))
    return {
        "dataset": str(Path(prefix)),
        "batches": batches,
        "tokens": batches * batch_size * seq_length,
        "lm_loss": loss,
        "ppl": math.exp(min(loss, 50)),
    }
