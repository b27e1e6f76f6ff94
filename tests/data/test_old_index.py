"""data_impl cached: Megatron's older TNTIDX index, written here as GPT-NeoX's
IndexedDatasetBuilder writes it (int32 tokens, element offsets, int64 sizes), reads as the same
sequences and documents as the MMIDIDX preprocess wrote, and a run on it trains exactly as on
the mmap copy; a damaged one is refused in one line."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

from tests.helpers import losses, train
from torchneox.base.errors import DataError
from torchneox.data.indexed import IndexedDataset


def write_tntidx(source: IndexedDataset, prefix: str) -> None:
    """GPT-NeoX's IndexedDatasetBuilder (int32 by default) over ``source``'s sequences."""
    data_offsets, sizes = [0], []
    with open(prefix + ".bin", "wb") as out:
        for i in range(len(source)):
            tokens = np.asarray(source[i], dtype=np.int32)
            out.write(tokens.tobytes())
            data_offsets.append(data_offsets[-1] + len(tokens))
            sizes.append(len(tokens))
    doc_idx = list(source.doc_idx)
    with open(prefix + ".idx", "wb") as idx:
        idx.write(b"TNTIDX\x00\x00")
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<QQ", 4, 4))  # int32's code and size
        idx.write(struct.pack("<QQ", len(data_offsets) - 1, len(sizes)))
        idx.write(struct.pack("<Q", len(doc_idx)))
        for longs in (list(range(len(sizes) + 1)), data_offsets, sizes, doc_idx):
            idx.write(np.array(longs, dtype=np.int64).tobytes())


def test_old_index_reads_the_same_sequences(tiny_data, tmp_path):
    mmap = IndexedDataset(tiny_data)
    write_tntidx(mmap, str(tmp_path / "old"))
    old = IndexedDataset(tmp_path / "old")
    assert len(old) == len(mmap) and old.num_tokens == mmap.num_tokens
    assert np.array_equal(old.doc_idx, mmap.doc_idx)
    for i in (0, 1, len(mmap) // 2, len(mmap) - 1):
        assert np.array_equal(old[i], mmap[i])
        assert np.array_equal(old.get(i, 2, 3), mmap.get(i, 2, 3))


def test_a_run_on_the_old_index_trains_as_on_mmap(make_config, tiny_data, tmp_path):
    write_tntidx(IndexedDataset(tiny_data), str(tmp_path / "old"))
    config = make_config(train_iters=3)
    train(config, f"save={tmp_path / 'a'}")
    train(config, f"save={tmp_path / 'b'}", f"data_path={tmp_path / 'old'}", "data_impl=cached")
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


def test_a_damaged_old_index_is_one_line(tiny_data, tmp_path):
    write_tntidx(IndexedDataset(tiny_data), str(tmp_path / "old"))
    shutil.copy(tmp_path / "old.bin", tmp_path / "cut.bin")
    raw = (tmp_path / "old.idx").read_bytes()
    (tmp_path / "cut.idx").write_bytes(raw[: len(raw) - 40])
    with pytest.raises(DataError, match=r"cut\.idx: \d+ bytes, its header promises \d+; truncated"):
        IndexedDataset(tmp_path / "cut")


@pytest.mark.parametrize(
    "where, value, said",
    [
        ("offsets", 7, "sequence offsets that do not follow the sequence lengths"),
        ("sizes", -3, "a negative sequence length at item 5"),
        ("docs", 10**6, "a document index that does not rise from 0 to the number of sequences"),
    ],
)
def test_an_old_index_damaged_in_place_is_one_line(tiny_data, tmp_path, where, value, said):
    """The same size, one long changed: the arrays disagree, and the dataset is refused instead
    of read wrong."""
    source = IndexedDataset(tiny_data)
    write_tntidx(source, str(tmp_path / "old"))
    raw = bytearray((tmp_path / "old.idx").read_bytes())
    count, header = len(source), 8 + 6 * 8
    start = {"offsets": count + 1 + 5, "sizes": 2 * (count + 1) + 5, "docs": 3 * count + 3}
    at = header + 8 * start[where]
    raw[at : at + 8] = np.array([value], dtype=np.int64).tobytes()
    (tmp_path / "old.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"old.idx: damaged index \\({said}\\)"):
        IndexedDataset(tmp_path / "old")
