"""Post-training samples: whole documents with their labels and rewards (pack_impl unpacked and
pack_until_overflow, pairwise data), in GPT-NeoX's sample order: the index arrays GPT-NeoX
cached during its runs and the batches it trained on are reproduced exactly; bad data is one
line naming the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_dir
from torchneox.base.errors import DataError
from torchneox.config.load import load_mapping
from torchneox.data.datasets import build_splits
from torchneox.data.documents import Column, document_samples
from torchneox.data.indexed import IndexedDataset, IndexedDatasetWriter

SHARED = shared_dir()
RUNS = SHARED / "golden" / "neox_runs" if SHARED else None
POST = RUNS / "post_training" if SHARED else None
needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
INDEX = re.compile(r"(.+)_(train|valid|test)_0_indexmap_(\d+)ns_64sl_1234s_unpackedpi(_ac)?$")


def golden_config(run: str, tmp_path: Path):
    text = (POST / "configs" / f"{run}.yml").read_text().replace("<runs>", str(RUNS))
    text = text.replace("<work>", str(tmp_path))
    values = json.loads("\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#")))
    return load_mapping(values | {"save": None, "load": None}, f"{run}.yml")


@needs_shared
@pytest.mark.parametrize("run", ["sft", "dpo", "kto", "rm"])
def test_training_batches_are_gpt_neox_s(tmp_path, run):
    """The 10 x 4 samples GPT-NeoX's own dataset classes gave its run (input/*.npz)."""
    splits = build_splits(golden_config(run, tmp_path).config, 4, 128)
    expected = np.load(POST / "input" / f"{run}_train_batches_iter1-10.npz")
    for key in expected.files:
        ours = np.stack([splits.train[i][key] for i in range(40)]).reshape(10, 4, 65)
        assert ours.dtype == expected[key].dtype, key
        assert np.array_equal(ours, expected[key]), key


@needs_shared
def test_index_arrays_equal_the_ones_gpt_neox_cached():
    """Every doc/sample/shuffle index GPT-NeoX wrote in its runs (every split and size)."""
    from torchneox.data.documents import unpacked_order, usable_documents

    stems = {p.name.rsplit("_", 2)[0] for p in (POST / "data").glob("*_indexmap_*_doc_idx.npy")}
    assert len(stems) == 15
    for stem in sorted(stems):
        prefix, _, count, chopped = INDEX.match(stem).groups()
        pairwise = prefix.endswith("_chosen_document")
        texts = [IndexedDataset(POST / "data" / prefix)]
        if pairwise:
            texts.append(IndexedDataset(POST / "data" / prefix.replace("_chosen_", "_rejected_")))
        labels = [
            IndexedDataset(str(t.prefix).replace("_document", "_label_document")) for t in texts
        ]
        keep = usable_documents(
            [t.sizes for t in texts], labels, len(texts[0]), 64, bool(chopped), 64
        )
        ours = unpacked_order(keep, int(count), 1234, pairwise)
        for kind, array in zip(("doc_idx", "sample_idx", "shuffle_idx"), ours, strict=True):
            theirs = np.load(POST / "data" / f"{stem}_{kind}.npy")
            assert np.array_equal(array, theirs), (stem, kind)


def write(prefix: Path, docs: list[list[int]]) -> IndexedDataset:
    w = IndexedDatasetWriter(prefix, np.int32)
    for d in docs:
        w.add_document(d)
    w.finish()
    return IndexedDataset(prefix)


def chat_docs(rng: np.random.RandomState, n: int) -> tuple[list, list]:
    """Documents of 3-20 tokens whose second half is learnt."""
    texts, labels = [], []
    for _ in range(n):
        doc = list(rng.randint(2, 60, size=rng.randint(3, 21)))
        texts.append(doc)
        labels.append([-100] * (len(doc) // 2) + doc[len(doc) // 2 :])
    return texts, labels


def test_pack_until_overflow_packs_whole_documents_and_keeps_rewards_aligned(tmp_path):
    rng = np.random.RandomState(0)
    texts, labels = chat_docs(rng, 50)
    text, label = write(tmp_path / "t", texts), write(tmp_path / "l", labels)
    columns = [Column("text", text), Column("label", label, pad=-100)]
    samples = document_samples(columns, "pack_until_overflow", 30, 32, 1234, True, False)
    seen = set()
    for i in range(len(samples)):
        s = samples[i]
        assert s["text"].shape == s["label"].shape == (33,)
        pos = 0  # the sample is whole documents, one after another, then padding
        real = s["text"][s["text"] != 0]
        while pos < len(real) - 1:
            match = [d for d, doc in enumerate(texts) if list(real[pos : pos + len(doc)]) == doc]
            assert match, (i, pos)
            seen.add(match[0])
            pos += len(texts[match[0]])
        assert pos <= 33
    assert len(seen) > 20  # the shuffled order goes through the documents


def test_unpacked_rewards_spread_over_each_document(tmp_path):
    texts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    text = write(tmp_path / "t", texts)
    label = write(tmp_path / "l", texts)
    reward = write(tmp_path / "r", [[1], [-1], [1]])
    columns = [Column("text", text), Column("label", label, pad=-100)]
    columns.append(Column("reward", reward, per_document=True, dtype=np.float32))
    samples = document_samples(columns, "unpacked", 6, 8, 1234, True, False)
    by_first = {int(samples[i]["text"][0]): samples[i] for i in range(len(samples))}
    s = by_first[8]  # [8, 9] then the next document's first token, then padding
    assert list(s["text"]) == [8, 9, 10, 0, 0, 0, 0, 0, 0]
    assert list(s["label"]) == [8, 9, 10, -100, -100, -100, -100, -100, -100]
    assert list(s["reward"]) == [-1, -1, 1, 0, 0, 0, 0, 0, 0]


def bad_pairs(tmp_path: Path, pos: list, neg: list, pos_label=None, neg_label=None) -> dict:
    values = {
        "num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "seq_length": 16,
        "train_iters": 2, "train_micro_batch_size_per_gpu": 2, "tokenizer_type": "CharLevelTokenizer",
        "train_impl": "dpo", "dataset_impl": "pairwise", "pack_impl": "unpacked",
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    }  # fmt: skip
    for side, docs in (("pos", pos), ("neg", neg)):
        write(tmp_path / side, docs)
        values[f"{side}_train_data_paths"] = [str(tmp_path / side)]
    for side, docs in (("pos", pos_label), ("neg", neg_label)):
        if docs is not None:
            write(tmp_path / f"{side}_label", docs)
            values[f"{side}_train_label_data_paths"] = [str(tmp_path / f"{side}_label")]
    return values


@pytest.mark.parametrize(
    "case, message",
    [
        ("lengths", "neg: 1 rejected documents but"),
        ("labels", "pos_label: document 0 has 2 labels but"),
        ("masked", "pos_label: document 1 has no label within its first 16 tokens"),
    ],
)
def test_bad_post_training_data_is_one_line_naming_the_file(tmp_path, case, message):
    docs = [[5, 6, 7], [8, 9, 10]]
    masked = [[-100, 6, 7], [-100, -100, -100]]
    values = {
        "lengths": lambda: bad_pairs(tmp_path, docs, docs[:1]),
        "labels": lambda: bad_pairs(tmp_path, docs, docs, [[5, 6], [8, 9, 10]], docs),
        "masked": lambda: bad_pairs(tmp_path, docs, docs, masked, docs),
    }[case]()
    loaded = load_mapping(values, "bad.yml")
    with pytest.raises(DataError) as e:
        build_splits(loaded.config, 2, 512)
    assert message in str(e.value) and "\n" not in str(e.value)


@needs_shared
def test_the_documents_longer_than_a_sample_are_left_out_without_allow_chopped(tmp_path):
    cfg = golden_config("kto", tmp_path).config
    cfg.set("seq_length", 40)
    text = IndexedDataset(cfg.data.train_data_paths[0])
    splits = build_splits(cfg, 4, 128)
    used = {int(d) for d in splits.train.datasets[0].doc_idx}
    assert used and all(text.sizes[d] <= 41 for d in used)
    assert any(s > 41 for s in text.sizes)  # some were left out


def test_dpo_without_label_data_leaves_the_padding_out(tmp_path):
    """Without label datasets the chosen and rejected tokens are learnt, the padding after
    them is not: DPO's summed log-probabilities cover each sample's real tokens only."""
    import torch

    from torchneox.train.objectives import DPO

    docs = [[5, 6, 7], [8, 9, 10, 11]]
    loaded = load_mapping(bad_pairs(tmp_path, docs, docs[::-1]), "dpo.yml")
    samples = build_splits(loaded.config, 2, 512).train
    rows = [samples[i] for i in range(2)]
    batch = {k: torch.as_tensor(np.stack([r[k] for r in rows])) for k in ("pos", "neg")}
    batch |= {k: torch.as_tensor(np.stack([r[k] for r in rows])) for k in rows[0] if "label" in k}
    prep = DPO().prepare(batch)
    # a sample is its document and the next document's first token: len(doc) predictions count
    counted = {5: 3, 8: 4}
    real = [counted[int(t)] for t in torch.cat([batch["pos"][:, 0], batch["neg"][:, 0]])]
    assert prep.mask.sum(-1).tolist() == real
    logits = torch.randn(4, 16, 512, generator=torch.Generator().manual_seed(0))
    terms = DPO(reference_free=True).terms(logits, prep)
    logp = torch.log_softmax(logits, -1).gather(-1, prep.labels[..., None])[..., 0]
    sums = torch.stack([logp[i, :n].sum() for i, n in enumerate(real)])
    assert torch.allclose(terms.metrics["chosen_pos"], sums[:2].mean(), atol=1e-5)
    assert torch.allclose(terms.metrics["chosen_neg"], sums[2:].mean(), atol=1e-5)
