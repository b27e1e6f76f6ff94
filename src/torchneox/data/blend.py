"""GPT-NeoX's dataset blending: weights, per-dataset sample counts and the blend order."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from torchneox.data.gpt_dataset import GPTDataset


def normalize(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    return [w / total for w in weights]


def samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """Each dataset is asked for a little more than its share (GPT-NeoX's 0.5% margin)."""
    return [int(math.ceil(num_samples * w * 1.005)) for w in normalize(weights)]


def weights_by_num_documents(num_documents: Sequence[int], alpha: float) -> list[float]:
    """GPT-NeoX's weight_by_num_documents: document shares tempered by alpha, then
    multiplied by one minus the share, normalised."""
    if len(num_documents) == 1:
        return [1.0]
    total = sum(num_documents)
    shares = [n / total for n in num_documents]
    tempered = normalize([s**alpha for s in shares])
    return normalize([t * (1 - s) for t, s in zip(tempered, shares, strict=True)])


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """At each position take the dataset furthest behind its share: the largest
    ``w[d] * max(k, 1) - taken[d]``, the first on ties."""
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    which = np.empty(size, dtype=np.uint8)
    index = np.empty(size, dtype=np.int64)
    for k in range(size):
        x = max(float(k), 1.0)
        best, best_err = 0, w[0] * x - taken[0]
        for d in range(1, len(w)):
            err = w[d] * x - taken[d]
            if err > best_err:
                best, best_err = d, err
        which[k] = best
        index[k] = taken[best]
        taken[best] += 1
    return which, index


class BlendedDataset:
    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float]):
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = sum(len(d) for d in self.datasets)
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, self.size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        i %= self.size
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
