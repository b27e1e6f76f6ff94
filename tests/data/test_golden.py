"""Bytes and sample order equal to GPT-NeoX's own, from the golden files in ../shared."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import shared_dir
from torchneox.data.blend import BlendedDataset, samples_per_dataset
from torchneox.data.gpt_dataset import GPTDataset, index_file_names, split_ranges
from torchneox.data.indexed import IndexedDataset
from torchneox.data.preprocess import PreprocessArgs, preprocess

SHARED = shared_dir()
pytestmark = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
GOLDEN = SHARED / "golden" / "neox_dataset" if SHARED else None
TOKENIZER_20B = str(SHARED / "data/tokenizers/gpt_neox_20b/20B_tokenizer.json") if SHARED else None


@pytest.mark.parametrize("name", ["shakespeare", "enwik8"])
@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_gpt_neox_bytes(tmp_path, name, workers):
    (prefix,) = preprocess(
        PreprocessArgs(
            [str(GOLDEN / f"{name}.jsonl")],
            str(tmp_path / name),
            "HFTokenizer",
            TOKENIZER_20B,
            append_eod=True,
            workers=workers,
        )
    )
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"{prefix.name}.{ext}").read_bytes()
        assert ours == (GOLDEN / f"{name}_text_document.{ext}").read_bytes(), ext


def test_reader_sees_the_golden_dataset():
    ds = IndexedDataset(GOLDEN / "shakespeare_text_document")
    assert len(ds) == 7222 and ds.num_tokens == 333019 and ds.dtype == np.uint16
    assert ds[0][-1] == 0  # documents end with end-of-text (id 0 in the 20B tokenizer)


def _case(name: str) -> dict:
    return json.loads((GOLDEN / f"case_{name}" / "case.json").read_text())


@pytest.mark.parametrize("case", ["a", "b", "b_extra_valid", "b_extra_test"])
def test_index_files_equal_gpt_neox(case):
    c = _case(case)
    ds = IndexedDataset(GOLDEN / c["data_prefix"])
    docs = np.arange(c["documents"]["start"], c["documents"]["stop"], dtype=np.int32)
    ours = GPTDataset(ds, c["dataset_name"], docs, c["num_samples"], c["seq_length"], c["seed"])
    for kind in ("doc_idx", "sample_idx", "shuffle_idx"):
        expected = np.load(GOLDEN / f"case_{case}" / f"{kind}.npy")
        got = np.asarray(getattr(ours, kind))
        assert got.dtype == expected.dtype and np.array_equal(got, expected), kind
        assert ours.index_files[kind].name == c["neox_index_files"][kind]
    assert len(ours) == c["len_dataset"]


def test_split_of_949_50_1_equals_gpt_neox():
    assert split_ranges("949,50,1", 7222) == [(0, 6854), (6854, 7215), (7215, 7222)]
    assert _case("b")["split"]["splits_index"] == [0, 6854, 7215, 7222]


def test_first_samples_equal_gpt_neox():
    ds = IndexedDataset(GOLDEN / "shakespeare_text_document")
    ours = GPTDataset(ds, "train", np.arange(7222, dtype=np.int32), 5000, 128, 1234)
    expected = np.load(GOLDEN / "case_d" / "first20_samples.npy")
    got = np.stack([ours[i] for i in range(20)])
    assert got.dtype == np.int64 and np.array_equal(got, expected)


def test_blend_equals_gpt_neox_including_wrap_around():
    c = _case("c")
    assert (
        samples_per_dataset(c["weights_in"], c["train_num_samples_requested"])
        == c["per_dataset_num_samples"]
    )
    parts = []
    for i, comp in enumerate(c["components"]):
        ds = IndexedDataset(GOLDEN / comp["data_prefix"])
        parts.append(
            GPTDataset(
                ds, f"train_{i}", np.arange(len(ds), dtype=np.int32), comp["num_samples"], 128, 1234
            )
        )
        for kind in ("doc_idx", "sample_idx", "shuffle_idx"):
            assert np.array_equal(
                np.asarray(getattr(parts[-1], kind)),
                np.load(GOLDEN / comp["subdir"] / f"{kind}.npy"),
            )
    blend = BlendedDataset(parts, c["weights_in"])
    assert len(blend) == c["blend_size"]
    assert np.array_equal(blend.dataset_index, np.load(GOLDEN / "case_c" / "dataset_index.npy"))
    assert np.array_equal(
        blend.dataset_sample_index, np.load(GOLDEN / "case_c" / "dataset_sample_index.npy")
    )
    first = np.load(GOLDEN / "case_c" / "first20_blended_samples.npy")
    assert np.array_equal(np.stack([blend[i] for i in range(20)]), first)
    positions = np.load(GOLDEN / "case_c" / "wrap_positions.npy")
    wrapped = np.load(GOLDEN / "case_c" / "wrap_blended_samples.npy")
    assert np.array_equal(np.stack([blend[int(p)] for p in positions]), wrapped)


def test_index_cache_names_match_gpt_neox():
    names = index_file_names("data/shakespeare_text_document", "train", 5000, 128, 1234)
    assert names == _case("a")["neox_index_files"]
