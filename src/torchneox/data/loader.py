"""Batches for training and evaluation: consecutive samples, each data-parallel rank its share,
and a position that is part of the checkpoint so a resumed run sees the same samples.

Step k (counting from 1) uses samples [(k-1) x B, k x B) of the split, B the global batch.
Micro-batch m of rank r takes ``mb`` samples starting at ``m x mb x dp + r x mb`` within the
global batch, as GPT-NeoX's sampler does.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from torchneox.data.datasets import Samples

Batch = torch.Tensor | dict[str, torch.Tensor]


def stack(samples: list) -> Batch:
    """Samples as one micro-batch: token ids [mb, seq + 1], or a dict of such per key."""
    if isinstance(samples[0], dict):
        return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
    return torch.from_numpy(np.stack(samples))


class BatchLoader:
    def __init__(
        self,
        samples: Samples,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        prefetch: bool = True,
    ):
        self.samples = samples
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batches") if prefetch else None
        self._next: Future | None = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def indices(self, start: int) -> list[np.ndarray]:
        """Sample indices of each micro-batch of this rank, for a global batch at ``start``."""
        base = start + self.dp_rank * self.micro_batch
        stride = self.micro_batch * self.dp_size
        return [base + m * stride + np.arange(self.micro_batch) for m in range(self.grad_accum)]

    def _load(self, start: int) -> list[Batch]:
        return [stack([self.samples[int(i)] for i in idx]) for idx in self.indices(start)]

    def next(self) -> list[Batch]:
        """The micro-batches ([mb, seq + 1] int64 each; post-training data: a dict of them) of
        the next global batch."""
        start = self.consumed
        if self._next is not None:
            batch = self._next.result()
        else:
            batch = self._load(start)
        self.consumed += self.global_batch
        if self._pool is not None:
            self._next = self._pool.submit(self._load, self.consumed)
        return batch

    def has_full_batch(self) -> bool:
        """Whether the split still holds a whole global batch (evaluation stops when it does not,
        as GPT-NeoX's drop-last loaders do)."""
        return self.consumed + self.global_batch <= len(self.samples)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed_samples"])
        self._next = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
