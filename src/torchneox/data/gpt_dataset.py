"""GPT-NeoX's GPT dataset: documents shuffled per epoch, packed into samples of seq_length + 1
tokens (consecutive samples share one token), and the sample order shuffled.

The three index arrays are the ones GPT-NeoX builds, computed with vectorised numpy instead of
its C++ helper, and cached as .npy files under GPT-NeoX's own names:

    doc_idx      int32  document ids repeated once per epoch, shuffled across all epochs together
    sample_idx   [S+1, 2] (position in doc_idx, offset in that document) where each sample starts
    shuffle_idx  uint32 arange(S) shuffled

One ``numpy.random.RandomState(seed)`` shuffles doc_idx and then shuffle_idx. S is
``(epochs * tokens_per_epoch - 1) // seq_length`` and the dataset has S - 1 samples.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchneox.base.errors import DataError
from torchneox.config.validate import split_shares
from torchneox.data.indexed import IndexedDataset

INDEX_CACHE_ENV = "TORCHNEOX_INDEX_CACHE"


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """The smallest number of epochs that yields ``num_samples`` samples."""
    if tokens_per_epoch <= 1:
        raise DataError("the dataset has no tokens to make samples from")
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    while epochs > 1 and ((epochs - 1) * tokens_per_epoch - 1) // seq_length >= num_samples:
        epochs -= 1
    return epochs


def build_doc_idx(documents: np.ndarray, epochs: int, rng: np.random.RandomState) -> np.ndarray:
    doc_idx = np.tile(documents.astype(np.int32), epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, count: int
) -> np.ndarray:
    """Start of each of ``count + 1`` samples: sample k starts at token k * seq_length of the
    concatenated documents; its last token is the next sample's first."""
    lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    positions = np.arange(count + 1, dtype=np.int64) * seq_length
    which = np.searchsorted(ends, positions, side="right")
    # a sample ending exactly on a document's last token stays in that document
    offsets = positions - starts[which]
    dtype = (
        np.int32
        if max(len(doc_idx), int(lengths.max(initial=0))) < np.iinfo(np.int32).max
        else np.int64
    )
    out = np.empty((count + 1, 2), dtype=dtype)
    out[:, 0] = which
    out[:, 1] = offsets
    return out


def build_shuffle_idx(size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if size < np.iinfo(np.uint32).max - 1 else np.int64
    idx = np.arange(size, dtype=dtype)
    rng.shuffle(idx)
    return idx


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_index_fits(
    tokens_per_epoch: int, documents: int, num_samples: int, seq_length: int, name: str
) -> int:
    """The epochs the samples need; refused with the numbers when their index arrays would
    take more than half of this machine's memory (a corpus far too small for train_iters)."""
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    count = (epochs * tokens_per_epoch - 1) // seq_length
    needed = epochs * documents * 4 + (count + 1) * 2 * 8 + count * 8
    if needed > _memory_bytes() // 2:
        raise DataError(
            f"the {name} split has {tokens_per_epoch:,} tokens: {num_samples:,} samples of "
            f"{seq_length} tokens need {epochs:,} epochs of it, whose sample index would take "
            f"{needed / 2**30:.1f} GiB (this machine has {_memory_bytes() / 2**30:.0f}); lower "
            "train_iters (or the batch size, eval_iters), or add data"
        )
    return epochs


def build_indices(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    name: str = "train",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    epochs = check_index_fits(tokens_per_epoch, len(documents), num_samples, seq_length, name)
    rng = np.random.RandomState(seed)
    doc_idx = build_doc_idx(documents, epochs, rng)
    count = (epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, count)
    shuffle_idx = build_shuffle_idx(count, rng)
    return doc_idx, sample_idx, shuffle_idx


def index_file_names(
    prefix: str, name: str, num_samples: int, seq_length: int, seed: int
) -> dict[str, str]:
    """GPT-NeoX's cache file names, so that its caches and ours are interchangeable."""
    stem = f"{Path(prefix).name}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_packedpi_ac"
    return {kind: f"{stem}_{kind}.npy" for kind in ("doc_idx", "sample_idx", "shuffle_idx")}


def _cache_dir(prefix: str) -> Path:
    """Beside the data when writable (as GPT-NeoX does), else a per-user cache."""
    if os.environ.get(INDEX_CACHE_ENV):
        return Path(os.environ[INDEX_CACHE_ENV])
    here = Path(prefix).resolve().parent
    if os.access(here, os.W_OK):
        return here
    digest = hashlib.sha1(str(here).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "torchneox" / "index" / digest


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".partial-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".partial-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


@dataclass
class GPTDataset:
    """Samples of seq_length + 1 token ids (int64) from ``documents`` of an indexed dataset."""

    indexed: IndexedDataset
    name: str
    documents: np.ndarray
    num_samples: int
    seq_length: int
    seed: int
    labels: IndexedDataset | None = None  # a label dataset: samples are {"text", "label"}

    def __post_init__(self) -> None:
        if len(self.documents) == 0:
            raise DataError(f"{self.indexed.prefix}: the {self.name} split has no documents")
        tokens = int(self.indexed.sizes[self.documents].sum(dtype=np.int64))
        if tokens < self.seq_length + 1:
            raise DataError(
                f"{self.indexed.prefix}: the {self.name} split has {tokens:,} tokens "
                f"({len(self.documents):,} document{'s' * (len(self.documents) != 1)}), fewer than one sample of seq_length + 1 "
                f"= {self.seq_length + 1:,} tokens (each sample would repeat them); add data or "
                "lower seq_length"
            )
        names = index_file_names(
            self.indexed.prefix, self.name, self.num_samples, self.seq_length, self.seed
        )
        folder = _cache_dir(self.indexed.prefix)
        files = {k: folder / v for k, v in names.items()}
        stem = names["doc_idx"].removesuffix("_doc_idx.npy")
        source = folder / f"{stem}.source.json"
        fingerprint = self._fingerprint()
        if not self._cache_valid(files, source, fingerprint):
            folder.mkdir(parents=True, exist_ok=True)
            # one process builds; the others wait on the lock, then map what it wrote
            with open(folder / f"{stem}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not self._cache_valid(files, source, fingerprint):
                    arrays = build_indices(
                        self.indexed.sizes,
                        self.documents,
                        self.num_samples,
                        self.seq_length,
                        self.seed,
                        self.name,
                    )
                    for kind, array in zip(
                        ("doc_idx", "sample_idx", "shuffle_idx"), arrays, strict=True
                    ):
                        _save_atomic(files[kind], array)
                    _write_atomic(source, json.dumps(fingerprint))
        self.doc_idx = np.load(files["doc_idx"], mmap_mode="r")
        self.sample_idx = np.load(files["sample_idx"], mmap_mode="r")
        self.shuffle_idx = np.load(files["shuffle_idx"], mmap_mode="r")
        self.index_files = files

    def _fingerprint(self) -> dict[str, object]:
        """What the index arrays depend on: the documents' sizes (so a corpus preprocessed again
        to the same prefix is noticed), the documents of this split, and the settings."""
        digest = hashlib.sha256()
        digest.update(np.ascontiguousarray(self.indexed.sizes).tobytes())
        digest.update(np.ascontiguousarray(self.documents, dtype=np.int64).tobytes())
        return {
            "sizes_and_documents_sha256": digest.hexdigest(),
            "documents": len(self.documents),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
        }

    def _cache_valid(self, files: dict[str, Path], source: Path, fingerprint: dict) -> bool:
        """Cached arrays built from this data. Caches without a source record (GPT-NeoX's own)
        are used when their shapes fit the data; a record that differs means a rebuild."""
        if not all(f.is_file() for f in files.values()):
            return False
        if source.is_file():
            try:
                return json.loads(source.read_text()) == fingerprint
            except (OSError, ValueError):
                return False
        try:
            doc_idx = np.load(files["doc_idx"], mmap_mode="r")
            sample_idx = np.load(files["sample_idx"], mmap_mode="r")
            shuffle_idx = np.load(files["shuffle_idx"], mmap_mode="r")
        except (OSError, ValueError):
            return False
        epochs, extra = divmod(len(doc_idx), max(len(self.documents), 1))
        return (
            extra == 0
            and len(sample_idx) == len(shuffle_idx) + 1
            and np.array_equal(np.unique(doc_idx), np.unique(self.documents))
            and int(sample_idx[-1][0]) < len(doc_idx)
            and epochs
            == num_epochs(
                int(self.indexed.sizes[self.documents].sum(dtype=np.int64)),
                self.seq_length,
                self.num_samples,
            )
        )

    def __len__(self) -> int:
        return len(self.shuffle_idx) - 1

    def __getitem__(self, i: int) -> np.ndarray | dict[str, np.ndarray]:
        if i >= len(self.shuffle_idx):  # as GPT-NeoX: an index past the end wraps around
            i %= len(self)
        s = int(self.shuffle_idx[i])
        first = tuple(int(v) for v in self.sample_idx[s])
        last = tuple(int(v) for v in self.sample_idx[s + 1])
        tokens = self._read(self.indexed, first, last)
        if self.labels is None:
            return tokens
        return {"text": tokens, "label": self._read(self.labels, first, last)}

    def _read(
        self, data: IndexedDataset, first: tuple[int, int], last: tuple[int, int]
    ) -> np.ndarray:
        (doc_f, off_f), (doc_l, off_l) = first, last
        if doc_f == doc_l:
            tokens = data.get(int(self.doc_idx[doc_f]), off_f, off_l - off_f + 1)
            return tokens.astype(np.int64)
        parts = [data.get(int(self.doc_idx[doc_f]), off_f)]
        parts += [data[int(self.doc_idx[j])] for j in range(doc_f + 1, doc_l)]
        parts.append(data.get(int(self.doc_idx[doc_l]), 0, off_l + 1))
        return np.concatenate(parts).astype(np.int64)


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """GPT-NeoX's document split: proportions rounded, the rounding error taken off the end."""
    parts = split_shares(split)
    total = sum(parts)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p / total * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]
