"""The streamed splits a config describes, for one data-parallel rank: each split's sources
(streamed ones packed on the fly, .bin/.idx ones in GPT-NeoX's order) mixed by its weights.

``data_path`` streamed: one source whose documents ``split`` divides by a hash of each
document's place (unit and row), so that a document is in the same split every epoch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from torchneox.base.errors import DataError
from torchneox.config.features.streaming import is_stream, split_paths
from torchneox.config.schema import NeoXConfig
from torchneox.config.validate import split_shares
from torchneox.data.blend import samples_per_dataset
from torchneox.data.gpt_dataset import GPTDataset
from torchneox.data.indexed import IndexedDataset
from torchneox.data.stream.encode import Encoder
from torchneox.data.stream.loader import Gather, StreamLoader
from torchneox.data.stream.order import DocStream, Placement
from torchneox.data.stream.samples import IndexedSource, PackedSource, StreamSplit
from torchneox.data.stream.sources import resolve

SPLITS = ("train", "valid", "test")


def held_ranges(split: str) -> list[tuple[float, float] | None]:
    """The hash range of each split's documents (None: the split has none)."""
    shares = split_shares(split)
    total = sum(shares)
    out: list[tuple[float, float] | None] = []
    low = 0.0
    for i, share in enumerate(shares):
        high = 1.0 if i == 2 or sum(shares[i + 1 :]) == 0 else low + share / total
        out.append((low, high) if share > 0 else None)
        low = high
    return out


def fingerprint(cfg: NeoXConfig) -> str:
    """What the order of the streamed samples depends on (the worker count is not of it)."""
    d = cfg.data
    keys = {
        "paths": {s: split_paths(d, s) for s in SPLITS},
        "weights": {s: getattr(d, f"{s}_data_weights") for s in SPLITS},
        "split": d.split if d.data_path else None,
        "seq_length": cfg.model.seq_length,
        "seed": cfg.training.seed,
        "shuffle": [d.stream_shuffle, d.stream_shuffle_buffer],
        "field": d.jsonl_keys,
        "tokenizer": [cfg.tokenizer.tokenizer_type, cfg.tokenizer.vocab_file],
    }
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def _indexed(path: str, name: str, samples: int, seq: int, seed: int) -> GPTDataset:
    data = IndexedDataset(path)
    if len(data) == 0:
        raise DataError(f"{path}: the dataset has no documents")
    docs = np.arange(len(data), dtype=np.int32)
    return GPTDataset(data, name, docs, samples, seq, seed)


def stream_split(
    cfg: NeoXConfig, split: str, samples: int, rank: int = 0, ranks: int = 1
) -> StreamSplit | None:
    """Rank ``rank`` of ``ranks``'s samples of ``split`` (None: the split has no data);
    ``samples``: how many the run takes of it in all (the .bin/.idx sources are sized by it)."""
    d, seq, seed = cfg.data, cfg.model.seq_length, cfg.training.seed
    assert seq is not None
    paths = split_paths(d, split)
    held = None
    if d.data_path:
        held = held_ranges(d.split)[SPLITS.index(split)]
        if held is None:
            return None
    if not paths or samples == 0:
        return None
    weights = (None if d.data_path else getattr(d, f"{split}_data_weights")) or [1.0] * len(paths)
    per = samples_per_dataset(weights, samples)
    sources: list[Any] = []
    for i, path in enumerate(paths):
        if not is_stream(path):
            data = _indexed(path, f"{split}_{i}", per[i], seq, seed)
            sources.append(IndexedSource(data, rank, ranks))
            continue
        place = Placement(
            seed=seed,
            index=SPLITS.index(split) * 1000 + i,
            rank=rank,
            ranks=ranks,
            shuffle=d.stream_shuffle,
            buffer=d.stream_shuffle_buffer,
            held=None if held == (0.0, 1.0) else held,
        )
        source = resolve(path, "train" if d.data_path else split)
        docs = DocStream(source, d.jsonl_keys[0], place)
        sources.append(PackedSource(docs, seq, d.skip_bad_records))
    return StreamSplit(sources, weights, paths)


def build_loaders(
    cfg: NeoXConfig,
    counts: dict[str, int],
    micro_batch: int,
    grad_accum: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    gather: Gather | None = None,
) -> dict[str, StreamLoader | None]:
    """The train, valid and test loaders of a streamed run for one rank: the train split
    tokenized in num_workers processes a batch ahead, the evaluation splits in this one."""
    d, out = cfg.data, {}
    encoder = Encoder(cfg.tokenizer, d.jsonl_keys[0])
    for name in SPLITS:
        split = stream_split(cfg, name, counts[name], dp_rank, dp_size)
        train = name == "train"
        out[name] = (
            None
            if split is None
            else StreamLoader(
                split,
                micro_batch,
                grad_accum,
                encoder,
                dp_rank=dp_rank,
                dp_size=dp_size,
                workers=d.num_workers if train else 0,
                prefetch=train and d.num_workers > 0,
                fingerprint=fingerprint(cfg),
                gather=gather,
                skip_bad=d.skip_bad_records,
            )
        )
    return out
