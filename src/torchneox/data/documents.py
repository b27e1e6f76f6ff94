"""Samples of whole documents, for post-training: GPT-NeoX's ``pack_impl`` ``unpacked`` (one
document per sample) and ``pack_until_overflow`` (documents added to a sample while they fit),
over a text dataset with its label and reward datasets (GPT2Dataset), or over pairs of chosen
and rejected documents (``dataset_impl: pairwise``, PairwiseDataset).

A sample is its documents whole, then the first token of the document after them (its label
masked when the labels come from a label dataset: that document's own first label, -100 from
the chat tool), truncated or padded to seq_length + 1: tokens with 0, labels with -100, rewards
(one value per document, repeated over its tokens) with 0. The orders are GPT-NeoX's, drawn from
one ``numpy.random.RandomState(seed)``:

    unpacked             the sample order first: arange(S) shuffled (pairwise: arange(S) % D);
                         then sample k is the k-th usable document, in document order, cycling
    pack_until_overflow  arange(S) shuffled, then the documents in a shuffled order (shuffled
                         again every pass) packed while their total fits seq_length + 1

A document is left out when it is longer than a sample and ``allow_chopped`` is false. A
document whose labels are all masked within the sample (nothing to learn) is refused with its
file and number, where GPT-NeoX skips it silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from torchneox.base.errors import DataError
from torchneox.data.indexed import IndexedDataset


@dataclass(frozen=True)
class Column:
    """One array of every sample: ``key`` in the batch, read from ``data``."""

    key: str
    data: IndexedDataset
    pad: int = 0
    per_document: bool = False  # one value per document (a reward), spread over its tokens
    dtype: type = np.int64


def check_aligned(text: IndexedDataset, other: IndexedDataset, what: str) -> None:
    """A label or reward dataset must describe the documents of its text dataset."""
    if len(other) != len(text):
        raise DataError(
            f"{other.prefix}: {len(other)} documents, but its text dataset {text.prefix} has "
            f"{len(text)}; {what} must come from the same preprocessing run"
        )
    if what == "labels" and not np.array_equal(other.sizes, text.sizes):
        n = int(np.argmax(other.sizes != text.sizes))
        raise DataError(
            f"{other.prefix}: document {n} has {other.sizes[n]} labels but {text.prefix} gives "
            f"it {text.sizes[n]} tokens; the labels do not belong to this text dataset"
        )
    if what == "rewards" and not np.all(other.sizes == 1):
        n = int(np.argmax(other.sizes != 1))
        raise DataError(f"{other.prefix}: document {n} has {other.sizes[n]} rewards, not one")


def _labelled_within(labels: IndexedDataset, docs: np.ndarray, width: int) -> np.ndarray:
    """Whether each of ``docs`` has a label >= 0 among its first ``width`` positions."""
    out = np.empty(len(docs), dtype=bool)
    for n, d in enumerate(docs):
        out[n] = bool(np.any(labels.get(int(d), 0, min(int(labels.sizes[d]), width)) >= 0))
    return out


def usable_documents(
    sizes: Sequence[np.ndarray],
    labels: Sequence[IndexedDataset],
    n_docs: int,
    seq_length: int,
    allow_chopped: bool,
    label_width: int,
) -> np.ndarray:
    """Which documents samples are made of: not longer than a sample (unless chopped samples
    are allowed), and with something to learn (refused otherwise)."""
    keep = np.ones(n_docs, dtype=bool)
    if not allow_chopped:
        for s in sizes:
            keep &= s[:n_docs] <= seq_length + 1
    for lab in labels:
        docs = np.flatnonzero(keep)
        bad = docs[~_labelled_within(lab, docs, label_width)]
        if len(bad):
            raise DataError(
                f"{lab.prefix}: document {int(bad[0])} has no label within its first "
                f"{label_width} tokens (all -100: nothing to learn)"
                + (f", nor do {len(bad) - 1} others" if len(bad) > 1 else "")
                + "; remove it from the jsonl, raise seq_length, or set allow_chopped: false "
                "to leave out documents longer than a sample"
            )
    if not keep.any():
        raise DataError(
            f"{labels[0].prefix if labels else 'the dataset'}: every document is longer than a "
            f"sample of {seq_length + 1} tokens and allow_chopped is false; raise seq_length or "
            "set allow_chopped: true"
        )
    return keep


def unpacked_order(
    keep: np.ndarray, num_samples: int, seed: int, pairwise: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed=seed)
    if pairwise:
        shuffle_idx = np.array([i % len(keep) for i in range(num_samples)], dtype=np.int64)
    else:
        shuffle_idx = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(shuffle_idx)
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx[:, 0] = np.arange(num_samples + 1)
    # the k-th usable document in document order, cycling, num_samples + 1 of them
    doc_idx = np.resize(np.flatnonzero(keep), num_samples + 1).astype(np.int64)
    return doc_idx, sample_idx, shuffle_idx


def overflow_order(
    keep: np.ndarray, lengths: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pack_until_overflow: documents taken in a shuffled order (reshuffled each pass), a new
    sample started when the next one would overflow seq_length + 1 tokens."""
    rng = np.random.RandomState(seed=seed)
    shuffle_idx = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(shuffle_idx)
    order = np.arange(len(keep))
    rng.shuffle(order)
    starts: list[int] = []
    doc_idx: list[int] = []
    running, cursor = 0, 0
    while len(starts) < num_samples:
        d = int(order[cursor])
        if keep[d]:
            n = int(lengths[d])
            if running == 0 or running + n > seq_length + 1:
                starts.append(len(doc_idx))
                running = n
            else:
                running += n
            doc_idx.append(d)
        cursor += 1
        if cursor == len(order):
            cursor = 0
            rng.shuffle(order)
    starts.append(len(doc_idx))
    sample_idx = np.zeros((len(starts), 2), dtype=np.int64)
    sample_idx[:, 0] = starts
    return np.asarray(doc_idx, dtype=np.int64), sample_idx, shuffle_idx


class DocumentSamples:
    """Samples of whole documents (dicts of arrays [seq_length + 1]) in GPT-NeoX's order."""

    def __init__(
        self,
        columns: list[Column],
        orders: tuple[np.ndarray, np.ndarray, np.ndarray],
        seq_length: int,
    ):
        self.columns, self.seq_length = columns, seq_length
        self.doc_idx, self.sample_idx, self.shuffle_idx = orders

    def __len__(self) -> int:
        return min(len(self.shuffle_idx) - 1, len(self.sample_idx) - 1)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if i >= len(self.shuffle_idx):  # as GPT-NeoX: an index past the end wraps around
            i %= len(self)
        s = int(self.shuffle_idx[i])
        first, last = int(self.sample_idx[s][0]), int(self.sample_idx[s + 1][0])
        if last >= len(self.doc_idx):
            # the last packed sample has no next document: GPT-NeoX's reader fails on it and
            # takes the sample at (its position modulo the length) instead
            return self[s % len(self)]
        docs = [int(self.doc_idx[j]) for j in range(first, last)]
        after = int(self.doc_idx[last])
        out: dict[str, np.ndarray] = {}
        lengths: list[int] = []
        for col in self.columns:
            if col.per_document:
                spans = zip([*docs, after], lengths, strict=True)
                parts = [np.full(n, col.data[d][0]) for d, n in spans]
            else:
                parts = [np.asarray(col.data[d]) for d in docs]
                head = min(1, int(col.data.sizes[after]))
                parts.append(np.asarray(col.data.get(after, 0, head)))
                lengths = [len(p) for p in parts]
            out[col.key] = _fit(np.concatenate(parts), self.seq_length + 1, col.pad, col.dtype)
        return out


def _fit(values: np.ndarray, size: int, pad: int, dtype: type) -> np.ndarray:
    if len(values) >= size:
        return values[:size].astype(dtype)
    return np.pad(values.astype(dtype), (0, size - len(values)), constant_values=pad)


def document_samples(
    columns: list[Column],
    pack_impl: str,
    num_samples: int,
    seq_length: int,
    seed: int,
    allow_chopped: bool,
    pairwise: bool,
) -> DocumentSamples:
    """GPT-NeoX's unpacked or pack_until_overflow samples over ``columns`` (the first one, or
    for pairs the first two, are the token datasets; the label columns are checked)."""
    texts = [c.data for c in columns if c.key in ("text", "pos", "neg")]
    labels = [c.data for c in columns if c.key in ("label", "pos_label", "neg_label")]
    n_docs = len(texts[0])
    width = seq_length if pack_impl == "unpacked" else seq_length + 1
    keep = usable_documents(
        [t.sizes for t in texts], labels, n_docs, seq_length, allow_chopped, width
    )
    if pack_impl == "unpacked":
        orders = unpacked_order(keep, num_samples, seed, pairwise)
    else:
        lengths = np.max(np.stack([t.sizes[:n_docs] for t in texts]), axis=0)
        orders = overflow_order(keep, lengths, num_samples, seq_length, seed)
    return DocumentSamples(columns, orders, seq_length)
