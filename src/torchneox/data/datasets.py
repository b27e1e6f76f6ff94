"""The train / valid / test datasets a config describes, sized as GPT-NeoX sizes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from torchneox.base.errors import ConfigError, DataError
from torchneox.config.load import LoadedConfig
from torchneox.config.schema import NeoXConfig
from torchneox.config.validate import split_shares
from torchneox.data.blend import BlendedDataset, samples_per_dataset, weights_by_num_documents
from torchneox.data.gpt_dataset import GPTDataset, split_ranges
from torchneox.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")


class Samples(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


@dataclass
class Splits:
    train: Samples | None
    valid: Samples | None
    test: Samples | None
    notes: list[str] = field(default_factory=list)
    """What was left out and why (an evaluation split with no documents), for the run's log."""

    def get(self, name: str) -> Samples | None:
        return getattr(self, name)


def num_samples(cfg: NeoXConfig, train_batch_size: int) -> dict[str, int]:
    """Samples each split must provide: all training steps, every evaluation, one test run."""
    t = cfg.training
    if t.train_iters is None:
        raise DataError("train_iters is not set, so the number of samples is unknown")
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters
    return {
        "train": t.train_iters * train_batch_size,
        "valid": evals * train_batch_size,
        "test": t.eval_iters * train_batch_size,
    }


def _open(prefix: str, vocab_size: int | None) -> IndexedDataset:
    ds = IndexedDataset(prefix)
    if len(ds) == 0:
        raise DataError(f"{prefix}: the dataset has no documents")
    if vocab_size is not None:
        top = ds.max_token()
        if top >= vocab_size:
            raise DataError(
                f"{prefix}: token id {top} is outside the model's vocabulary of {vocab_size}; "
                "was it preprocessed with another tokenizer?"
            )
    return ds


def build_splits(cfg: NeoXConfig, train_batch_size: int, vocab_size: int | None = None) -> Splits:
    d = cfg.data
    seq, seed = cfg.model.seq_length, cfg.training.seed
    assert seq is not None
    counts = num_samples(cfg, train_batch_size)
    out: dict[str, Samples | None] = dict.fromkeys(SPLITS)
    if d.data_path:
        ds = _open(d.data_path, vocab_size)
        for name, (start, stop) in zip(SPLITS, split_ranges(d.split, len(ds)), strict=True):
            if stop > start and counts[name] > 0:
                docs = np.arange(start, stop, dtype=np.int32)
                out[name] = GPTDataset(ds, name, docs, counts[name], seq, seed)
        if out["train"] is None:
            raise DataError(f"{d.data_path}: split {d.split!r} leaves no training documents")
        shares = split_shares(d.split)
        notes = [
            f"{d.data_path}: split {d.split!r} gives the {name} split none of the {len(ds)} "
            f"documents; {name} is not evaluated (as in GPT-NeoX)"
            for i, name in enumerate(SPLITS)
            if i and shares[i] > 0 and counts[name] > 0 and out[name] is None
        ]
        return Splits(**out, notes=notes)
    if not d.train_data_paths:
        raise DataError("no data: set data_path or train_data_paths")
    for name in SPLITS:
        paths = getattr(d, f"{name}_data_paths")
        if not paths or counts[name] == 0:
            continue
        indexed = [_open(p, vocab_size) for p in paths]
        weights = getattr(d, f"{name}_data_weights") or [1.0] * len(paths)
        if d.weight_by_num_documents:
            weights = weights_by_num_documents([len(x) for x in indexed], d.weighted_sampler_alpha)
        per = samples_per_dataset(weights, counts[name])
        parts = [
            GPTDataset(x, f"{name}_{i}", np.arange(len(x), dtype=np.int32), n, seq, seed)
            for i, (x, n) in enumerate(zip(indexed, per, strict=True))
        ]
        out[name] = BlendedDataset(parts, weights)
    return Splits(**out)


def step_batch(loaded: LoadedConfig, iteration: int) -> tuple[int, np.ndarray]:
    """The global batch training step ``iteration`` (1-based) sees, as one process reads it:
    the index of its first sample, and its token ids [train_batch_size, seq_length + 1]."""
    from torchneox.config.derive import derive

    tbs = derive(loaded, world_size=1)["train_batch_size"]
    if tbs is None:
        raise ConfigError(
            "needs train_micro_batch_size_per_gpu or train_batch_size", key="train_batch_size"
        )
    train_iters = loaded.config.training.train_iters
    if iteration < 1 or (train_iters and iteration > train_iters):
        raise ConfigError(f"--iteration must be between 1 and train_iters ({train_iters})")
    samples = build_splits(loaded.config, tbs).train
    assert samples is not None
    start = (iteration - 1) * tbs
    return start, np.stack([samples[i] for i in range(start, start + tbs)])
