"""GPT-NeoX's MMIDIDX token datasets: ``PREFIX.bin`` (tokens) and ``PREFIX.idx`` (index).

The index, little-endian:

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code (uint16 = 8, int32 = 4, ...)
    u64      number of sequences N
    u64      number of document boundaries D (documents + 1)
    i32[N]   sequence lengths in tokens
    i64[N]   byte offset of each sequence in the .bin
    i64[D]   document boundaries as sequence indices, starting at 0

Preprocessing writes one sequence per document, so sequences and documents coincide.

Megatron's older TNTIDX index (GPT-NeoX's ``data_impl: cached``, which its own training no
longer reads at ea7aefd: its reader has no ``get``) is read too, into the same three arrays:

    8 bytes  magic  b"TNTIDX\x00\x00"
    u64      version (1)
    u64 u64  dtype code, bytes per element
    u64 u64  number of items N, number of size entries S (N for token sequences)
    u64      number of document boundaries D
    i64[N+1] dim offsets, i64[N+1] element offsets in the .bin, i64[S] sizes, i64[D] documents
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import numpy as np

from torchneox.base.errors import DataError
from torchneox.config.paths import remove_stale_partials

MAGIC = b"MMIDIDX\x00\x00"
OLD_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float32,
    7: np.float64,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (GPT-NeoX's threshold), int32 otherwise."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """Memory-mapped reader. ``ds[i]`` is sequence i as a numpy array (no copy)."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        bin_path, idx_path = paths(prefix)
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise DataError(f"{p}: no such file (data path prefix {self.prefix!r})")
        self._read_index(idx_path)
        self._check_index(idx_path)
        expected = (
            int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
            if len(self.sizes)
            else 0
        )
        actual = bin_path.stat().st_size
        if actual != expected:
            why = (
                "the file is truncated or belongs to another dataset"
                if actual < expected
                else "the .idx belongs to another dataset, or the .bin was written to since"
            )
            raise DataError(
                f"{bin_path}: {actual} bytes but its .idx describes {expected}; {why}; "
                "preprocess the data again"
            )
        self.data = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if actual else np.zeros(0, self.dtype)
        )

    def _check_index(self, idx_path: Path) -> None:
        """The index's arrays agree with each other (a damaged index whose size is intact
        would otherwise read wrong tokens without a word): sequence lengths not negative, each
        sequence starting where the one before ends, the document index rising from 0 to the
        number of sequences."""
        sizes, pointers, docs = self.sizes, self.pointers, self.doc_idx
        problem = None
        if len(sizes) and int(sizes.min()) < 0:
            problem = f"a negative sequence length at item {int(np.argmin(sizes))}"
        elif len(pointers) and (
            int(pointers[0]) != 0
            or not np.array_equal(
                np.diff(pointers), sizes[:-1].astype(np.int64) * self.dtype.itemsize
            )
        ):
            problem = "sequence offsets that do not follow the sequence lengths"
        elif len(docs) and (
            int(docs[0]) != 0 or int(docs[-1]) != len(sizes) or bool((np.diff(docs) < 0).any())
        ):
            problem = "a document index that does not rise from 0 to the number of sequences"
        if problem is not None:
            raise DataError(f"{idx_path}: damaged index ({problem}); preprocess the data again")

    def _read_index(self, idx_path: Path) -> None:
        raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
        if bytes(raw[:8]) == OLD_MAGIC:
            self._read_old_index(idx_path, raw)
            return
        header = struct.calcsize("<9sQBQQ")
        if len(raw) < header or bytes(raw[:9]) != MAGIC:
            raise DataError(
                f"{idx_path}: not a GPT-NeoX index (wrong magic: neither MMIDIDX nor TNTIDX)"
            )
        _, version, code, count, doc_count = struct.unpack("<9sQBQQ", bytes(raw[:header]))
        if version != VERSION:
            raise DataError(f"{idx_path}: index version {version}, only version {VERSION} is known")
        if code not in DTYPES:
            raise DataError(f"{idx_path}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        need = header + 4 * count + 8 * count + 8 * doc_count
        if len(raw) < need:
            raise DataError(f"{idx_path}: {len(raw)} bytes, its header promises {need}; truncated")
        self.sizes = np.frombuffer(raw, dtype=np.int32, count=count, offset=header)
        self.pointers = np.frombuffer(raw, dtype=np.int64, count=count, offset=header + 4 * count)
        self.doc_idx = np.frombuffer(
            raw, dtype=np.int64, count=doc_count, offset=header + 12 * count
        )

    def _read_old_index(self, idx_path: Path, raw: np.ndarray) -> None:
        """Megatron's TNTIDX index (data_impl cached): its element offsets become byte
        offsets, its int64 sizes the sequence lengths."""
        header = struct.calcsize("<8sQQQQQQ")
        if len(raw) < header:
            raise DataError(f"{idx_path}: {len(raw)} bytes, shorter than a TNTIDX header")
        _, version, code, element, count, size_count, doc_count = struct.unpack(
            "<8sQQQQQQ", bytes(raw[:header])
        )
        if version != VERSION or code not in DTYPES:
            raise DataError(f"{idx_path}: TNTIDX version {version}, dtype code {code}: unknown")
        self.dtype = np.dtype(DTYPES[code])
        if element != self.dtype.itemsize:
            raise DataError(f"{idx_path}: {element} bytes per element for {self.dtype}")
        need = header + 8 * (2 * (count + 1) + size_count + doc_count)
        if len(raw) < need:
            raise DataError(f"{idx_path}: {len(raw)} bytes, its header promises {need}; truncated")
        longs = np.frombuffer(raw, dtype=np.int64, count=(need - header) // 8, offset=header)
        dims, offsets = longs[: count + 1], longs[count + 1 : 2 * count + 2]
        if size_count != count or not np.array_equal(dims, np.arange(count + 1)):
            raise DataError(
                f"{idx_path}: items of more than one dimension; token datasets have one"
            )
        self.sizes = longs[2 * count + 2 : 2 * count + 2 + count].astype(np.int32)
        self.pointers = offsets[:-1] * element
        self.doc_idx = longs[2 * count + 2 + count :]

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.data[start : start + int(self.sizes[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        end = start + (int(self.sizes[i]) - offset if length is None else length)
        return self.data[start:end]

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def max_token(self) -> int:
        return int(self.data.max()) if len(self.data) else -1


class IndexedDatasetWriter:
    """Writes PREFIX.bin/.idx under temporary names (``*.partial-PID``); ``finish()`` renames
    them into place, so an interrupted run never leaves a pair that loads as if complete;
    ``abort()`` removes them. What a writer killed with SIGKILL left is removed by the next
    writer of the same dataset."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.bin_path, self.idx_path = paths(prefix)
        suffix = f".partial-{os.getpid()}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + suffix)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + suffix)
        for final in (self.bin_path, self.idx_path):
            remove_stale_partials(final.parent, f"{final.name}.partial-")
        try:
            self.bin_path.parent.mkdir(parents=True, exist_ok=True)
            self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        except OSError as e:
            raise DataError(
                f"{self.bin_path.parent}: cannot write the dataset there ({e.strerror}); choose "
                "another --output-prefix or fix the folder's permissions"
            ) from None
        self.sizes: list[int] = []
        self.doc_idx: list[int] = [0]

    def add_document(self, tokens: list[int] | np.ndarray) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self.sizes.append(len(array))
        self.doc_idx.append(len(self.sizes))

    def finish(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.asarray(self.sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes):
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self._idx_tmp, "wb") as f:
            f.write(
                struct.pack(
                    "<9sQBQQ", MAGIC, VERSION, CODES[self.dtype], len(sizes), len(self.doc_idx)
                )
            )
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.doc_idx, dtype=np.int64).tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        # an old .idx must never pair with the new .bin: drop it before the .bin lands
        self.idx_path.unlink(missing_ok=True)
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)

    def abort(self) -> None:
        """Remove what was written; works on a full disk too (closing may fail to flush)."""
        with contextlib.suppress(OSError):
            self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)
