"""``train_epochs`` made into steps: one epoch of the training split counted from its index,
the config given the train_iters GPT-NeoX computes, and the split read in the same order every
epoch (GPT-NeoX cycles its loader over one epoch's global micro-batches)."""

from __future__ import annotations

import copy

import numpy as np

from torchneox.base.errors import DataError
from torchneox.config.derive import derive
from torchneox.config.derived import Derived
from torchneox.config.features.epochs import epoch_iterations
from torchneox.config.load import LoadedConfig
from torchneox.config.schema import NeoXConfig
from torchneox.data.gpt_dataset import split_ranges
from torchneox.data.indexed import IndexedDataset, paths


def epoch_samples(cfg: NeoXConfig) -> int:
    """Samples of one epoch of data_path's train split: (its tokens - 1) // seq_length."""
    d, seq = cfg.data, cfg.model.seq_length
    assert d.data_path and seq
    ds = IndexedDataset(d.data_path)
    start, stop = split_ranges(d.split, len(ds))[0]
    tokens = int(ds.sizes[start:stop].sum(dtype=np.int64))
    return max(0, (tokens - 1) // seq)


def apply_train_epochs(loaded: LoadedConfig, world_size: int | None = None) -> LoadedConfig:
    """``loaded`` itself without train_epochs; else a copy whose train_iters is the epochs'
    (its origin the reason). Raises DataError when the epochs hold no step."""
    t = loaded.config.training
    if t.train_epochs is None:
        return loaded
    d = derive(loaded, world_size=world_size)
    mb, gas = d["train_micro_batch_size_per_gpu"], d["gradient_accumulation_steps"]
    samples = epoch_samples(loaded.config)
    iters, _, why = epoch_iterations(samples, mb, d["data_parallel_size"], gas, t.train_epochs)
    if iters < 1:
        raise DataError(
            f"{loaded.config.data.data_path}: train_epochs {t.train_epochs} makes no step "
            f"({why}); add data or give train_iters"
        )
    out = copy.deepcopy(loaded)
    out.config.training.train_iters = iters
    out.origin["train_iters"] = f"train_epochs: {why}"
    return out


class EpochCycle:
    """The first ``period`` samples (one epoch's whole global micro-batches) again and again,
    ``length`` samples in all: epoch 2 is epoch 1 in the same order."""

    def __init__(self, samples, period: int, length: int):
        self.samples, self.period, self.length = samples, period, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if not 0 <= i < self.length:
            raise IndexError(i)
        return self.samples[i % self.period]


def cycle_epochs(cfg: NeoXConfig, samples, derived: Derived):
    """The training split of a train_epochs run as GPT-NeoX reads it; others unchanged."""
    t = cfg.training
    if t.train_epochs is None or samples is None or t.train_iters is None:
        return samples
    per_batch = derived["train_micro_batch_size_per_gpu"] * derived["data_parallel_size"]
    period = epoch_samples(cfg) // per_batch * per_batch
    return EpochCycle(samples, period, t.train_iters * derived["train_batch_size"])


def explained_epochs(loaded: LoadedConfig, world_size: int | None = None) -> LoadedConfig:
    """For ``config explain``: the epochs counted where the data and batch are known (a config
    whose data is on another machine is explained with train_iters left to the run)."""
    cfg = loaded.config
    if cfg.training.train_epochs is None or not cfg.data.data_path:
        return loaded
    if not paths(cfg.data.data_path)[1].is_file() or not cfg.model.seq_length:
        return loaded
    if derive(loaded, world_size=world_size)["train_batch_size"] is None:
        return loaded
    return apply_train_epochs(loaded, world_size)
