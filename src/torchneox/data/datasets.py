"""The train / valid / test datasets a config describes, sized as GPT-NeoX sizes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from torchneox.base.errors import ConfigError, DataError
from torchneox.config.features.streaming import streams
from torchneox.config.load import LoadedConfig
from torchneox.config.schema import DataConfig, NeoXConfig
from torchneox.config.validate import split_shares
from torchneox.data.blend import BlendedDataset, samples_per_dataset, weights_by_num_documents
from torchneox.data.documents import Column, check_aligned, document_samples
from torchneox.data.epochs import apply_train_epochs, cycle_epochs, epoch_samples
from torchneox.data.gpt_dataset import GPTDataset, split_ranges
from torchneox.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")


class Samples(Protocol):
    """Token ids [seq_length + 1] per sample; post-training data: a dict of such arrays
    (text/label/reward, or pos/neg/pos_label/neg_label)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray | dict[str, np.ndarray]: ...


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
        # train_epochs: exactly one epoch, read again each epoch (data/epochs.py)
        "train": epoch_samples(cfg) if t.train_epochs else t.train_iters * train_batch_size,
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
    """The train, valid and test samples of a run: its data group's datasets, cut into
    ``seq_length`` samples shuffled by the seed, as many as the training group's steps and
    evaluations take (the helpers below each take the data group alone)."""
    d = cfg.data
    seq, seed = cfg.model.seq_length, cfg.training.seed
    assert seq is not None
    counts = num_samples(cfg, train_batch_size)
    out: dict[str, Samples | None] = dict.fromkeys(SPLITS)
    if d.data_path:
        return _split_one(d.data_path, d.split, counts, seq, seed, vocab_size)
    if d.dataset_impl == "pairwise" and not d.pos_train_data_paths:
        raise DataError("no data: dataset_impl 'pairwise' reads pos_/neg_train_data_paths")
    if d.dataset_impl != "pairwise" and not d.train_data_paths:
        raise DataError("no data: set data_path or train_data_paths")
    t = cfg.training
    precompute = cfg.textgen.precompute_model_name if t.train_impl in ("dpo", "kto") else None
    for name in SPLITS:
        prefixes = _split_prefixes(d, name)
        if not prefixes or counts[name] == 0:
            continue
        columns = [_columns(d, name, i, vocab_size, precompute) for i in range(len(prefixes))]
        weights = getattr(d, f"{name}_data_weights") or [1.0] * len(prefixes)
        if d.weight_by_num_documents:
            sizes = [len(c[0].data) for c in columns]
            weights = weights_by_num_documents(sizes, d.weighted_sampler_alpha)
        per = samples_per_dataset(weights, counts[name])
        parts = [
            _dataset(d, seq, seed, cols, f"{name}_{i}", n)
            for i, (cols, n) in enumerate(zip(columns, per, strict=True))
        ]
        out[name] = BlendedDataset(parts, weights)
    return Splits(**out)


def _split_one(
    path: str, split: str, counts: dict[str, int], seq: int, seed: int, vocab_size: int | None
) -> Splits:
    """``data_path``'s documents divided by ``split``. An evaluation split with no documents,
    or with fewer tokens than one sample, is not evaluated, and a note says so; a training
    split that small is refused (by GPTDataset)."""
    ds = _open(path, vocab_size)
    out: dict[str, Samples | None] = dict.fromkeys(SPLITS)
    notes = []
    for i, (name, (start, stop)) in enumerate(
        zip(SPLITS, split_ranges(split, len(ds)), strict=True)
    ):
        if counts[name] == 0 or (stop == start and split_shares(split)[i] == 0):
            continue
        tokens = int(ds.sizes[start:stop].sum(dtype=np.int64))
        if i and stop == start:
            notes.append(
                f"{path}: split {split!r} gives the {name} split none of the {len(ds)} "
                f"documents; {name} is not evaluated (as in GPT-NeoX)"
            )
        elif i and tokens < seq + 1:
            notes.append(
                f"{path}: split {split!r} gives the {name} split {tokens:,} tokens, fewer than "
                f"one sample of seq_length + 1 = {seq + 1:,}; {name} is not evaluated"
            )
        elif stop > start:
            docs = np.arange(start, stop, dtype=np.int32)
            out[name] = GPTDataset(ds, name, docs, counts[name], seq, seed)
    if out["train"] is None:
        raise DataError(f"{path}: split {split!r} leaves no training documents")
    return Splits(**out, notes=notes)


def _split_prefixes(d: DataConfig, split: str) -> list[str]:
    if d.dataset_impl != "pairwise":
        return list(getattr(d, f"{split}_data_paths") or [])
    pos = getattr(d, f"pos_{split}_data_paths") or []
    neg = getattr(d, f"neg_{split}_data_paths") or []
    if len(pos) != len(neg):
        raise ConfigError(
            f"{len(pos)} chosen datasets but {len(neg)} rejected ones; give one neg_{split} "
            "dataset per pos_ one",
            key=f"neg_{split}_data_paths",
        )
    return list(pos)


def _paths_at(d: DataConfig, key: str, i: int, count: int) -> str | None:
    paths = getattr(d, key) or []
    if paths and len(paths) != count:
        raise ConfigError(f"{len(paths)} paths, but the datasets they go with are {count}", key=key)
    return paths[i] if paths else None


def _columns(
    d: DataConfig, split: str, i: int, vocab_size: int | None, precompute: str | None
) -> list[Column]:
    """The arrays of dataset i of a split: tokens, labels (-100 padding), rewards, and the
    reference's log-probabilities precomputed as ``precompute``."""
    count = len(_split_prefixes(d, split))
    sides = ("pos_", "neg_") if d.dataset_impl == "pairwise" else ("",)
    texts, labels, rewards = [], [], []
    for side in sides:
        key = {"": "text", "pos_": "pos", "neg_": "neg"}[side]
        text = _open(str(_paths_at(d, f"{side}{split}_data_paths", i, count)), vocab_size)
        texts.append(Column(key, text))
        label_path = _paths_at(d, f"{side}{split}_label_data_paths", i, count)
        if label_path is not None:
            label = _open(label_path, vocab_size)
            check_aligned(text, label, "labels")
            labels.append(Column(f"{key}_label" if side else "label", label, pad=-100))
    if len(texts) == 2 and len(texts[0].data) != len(texts[1].data):
        pos, neg = texts[0].data, texts[1].data
        raise DataError(
            f"{neg.prefix}: {len(neg)} rejected documents but {pos.prefix} has {len(pos)} "
            "chosen ones; pairs must be preprocessed from the same jsonl"
        )
    if len(texts) == 2 and len(labels) == 1:
        raise ConfigError(
            "labels given for one side of the pairs only; give both pos_ and neg_ label paths",
            key=f"neg_{split}_label_data_paths",
        )
    if len(texts) == 2 and not labels:
        # no label datasets: the tokens are their own labels and the padding after them is
        # masked (-100), as GPT-NeoX means it ("pad with 0s ... since it's masked") where its
        # mask (token >= 0) keeps the padding and DPO sums log-probabilities over it
        labels = [Column(f"{t.key}_label", t.data, pad=-100) for t in texts]
    refs = _precomputed(precompute, texts) if precompute else []
    reward_path = _paths_at(d, f"{split}_reward_data_paths", i, count)
    if reward_path is not None and not sides[0]:
        reward = _open(reward_path, None)
        check_aligned(texts[0].data, reward, "rewards")
        rewards.append(Column("reward", reward, per_document=True, dtype=np.float32))
    return [*texts, *labels, *rewards, *refs]


def _precomputed(name: str, texts: list[Column]) -> list[Column]:
    """DPO's and KTO's precomputed reference log-probabilities (PREFIX_{precompute_model_name},
    seq_length values per document), beside each token dataset."""
    out = []
    for text in texts:
        prefix = f"{text.data.prefix}_{name}"
        try:
            data = IndexedDataset(prefix)
        except DataError:
            raise DataError(
                f"{prefix}: no precomputed log-probabilities (precompute_model_name {name!r}); "
                "write them with `torchneox generate CONFIG --checkpoint REFERENCE "
                "--text-gen-type precompute`"
            ) from None
        if len(data) < len(text.data) or data.dtype != np.float32:
            raise DataError(
                f"{prefix}: {len(data)} {data.dtype} documents, but {text.data.prefix} has "
                f"{len(text.data)}: these log-probabilities belong to other data; precompute again"
            )
        key = {"text": "ref", "pos": "pos_ref", "neg": "neg_ref"}[text.key]
        out.append(Column(key, data, dtype=np.float32))
    return out


def _dataset(
    d: DataConfig, seq: int, seed: int, columns: list[Column], name: str, num_samples: int
) -> Samples:
    if d.pack_impl == "packed" and d.dataset_impl != "pairwise":
        text = columns[0].data
        labels = next((c.data for c in columns if c.key == "label"), None)
        docs = np.arange(len(text), dtype=np.int32)
        return GPTDataset(text, name, docs, num_samples, seq, seed, labels=labels)
    pairwise = d.dataset_impl == "pairwise"
    return document_samples(columns, d.pack_impl, num_samples, seq, seed, d.allow_chopped, pairwise)


def step_batch(
    loaded: LoadedConfig, iteration: int
) -> tuple[int, np.ndarray | dict[str, np.ndarray]]:
    """The global batch training step ``iteration`` (1-based) sees, as one process reads it:
    the index of its first sample, and its token ids [train_batch_size, seq_length + 1] (for
    post-training data a dict of such arrays: text/label/reward or pos/neg and their labels)."""
    from torchneox.config.derive import derive

    if loaded.config.training.train_epochs and derive(loaded)["train_batch_size"] is not None:
        loaded = apply_train_epochs(loaded, world_size=1)
    d = derive(loaded, world_size=1)
    tbs = d["train_batch_size"]
    if tbs is None:
        raise ConfigError(
            "needs train_micro_batch_size_per_gpu or train_batch_size", key="train_batch_size"
        )
    train_iters = loaded.config.training.train_iters
    if iteration < 1 or (train_iters and iteration > train_iters):
        raise ConfigError(f"--iteration must be between 1 and train_iters ({train_iters})")
    if streams(loaded.config.data):
        return (iteration - 1) * tbs, _streamed_batch(loaded.config, iteration, tbs)
    samples = cycle_epochs(loaded.config, build_splits(loaded.config, tbs).train, d)
    assert samples is not None
    start = (iteration - 1) * tbs
    rows = [samples[i] for i in range(start, start + tbs)]
    if isinstance(rows[0], dict):
        return start, {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return start, np.stack(rows)


def _streamed_batch(cfg: NeoXConfig, iteration: int, tbs: int) -> np.ndarray:
    """A streamed run's batch of step ``iteration`` as one process reads it: the samples
    before it read (and tokenized) on the way."""
    from torchneox.data.stream.build import stream_split
    from torchneox.data.stream.encode import Encoder, Tokenize

    split = stream_split(cfg, "train", num_samples(cfg, tbs)["train"])
    assert split is not None
    tokenize = Tokenize(Encoder(cfg.tokenizer, cfg.data.jsonl_keys[0]), 0)
    split.set_tokenize(tokenize)
    for _ in range((iteration - 1) * tbs):
        split.next()
    return np.stack([split.next() for _ in range(tbs)])
