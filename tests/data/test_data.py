"""The data pipeline on data made here: formats, preprocessing, errors, loading, the CLI."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from torchneox.base.errors import DataError
from torchneox.cli import main
from torchneox.data import builtin
from torchneox.data.gpt_dataset import GPTDataset, build_indices, num_epochs
from torchneox.data.indexed import IndexedDataset, IndexedDatasetWriter
from torchneox.data.loader import BatchLoader
from torchneox.data.preprocess import PreprocessArgs, preprocess
from torchneox.data.tokenizers import CharLevelTokenizer


def write_dataset(prefix, docs, dtype=np.uint16):
    w = IndexedDatasetWriter(prefix, dtype)
    for d in docs:
        w.add_document(d)
    w.finish()
    return IndexedDataset(prefix)


def test_writer_and_reader_round_trip(tmp_path):
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    for dtype in (np.uint16, np.int32):
        ds = write_dataset(tmp_path / f"x{np.dtype(dtype).name}", docs, dtype)
        assert [d.tolist() for d in (ds[i] for i in range(3))] == docs
        assert ds.dtype == dtype and ds.num_tokens == 9 and ds.doc_idx.tolist() == [0, 1, 2, 3]
        assert ds.get(2, 1, 2).tolist() == [6, 7]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda idx, b: idx.write_bytes(b"NOTMAGIC!" + idx.read_bytes()[9:]), "wrong magic"),
        (
            lambda idx, b: idx.write_bytes(
                idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]
            ),
            "index version 2",
        ),
        (
            lambda idx, b: idx.write_bytes(
                idx.read_bytes()[:17] + bytes([99]) + idx.read_bytes()[18:]
            ),
            "unknown token dtype code 99",
        ),
        (
            lambda idx, b: b.write_bytes(b.read_bytes()[:-4]),
            "truncated or belongs to another dataset",
        ),
        (lambda idx, b: idx.write_bytes(idx.read_bytes()[:40]), "truncated"),
        (lambda idx, b: b.unlink(), "no such file"),
    ],
)
def test_reader_names_the_broken_file(tmp_path, damage, message):
    write_dataset(tmp_path / "d", [[1, 2, 3], [4, 5]])
    damage(tmp_path / "d.idx", tmp_path / "d.bin")
    with pytest.raises(DataError, match=message) as err:
        IndexedDataset(tmp_path / "d")
    assert str(tmp_path / "d") in str(err.value)


def test_preprocess_text_and_several_keys(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n\nworld!\n")
    (p,) = preprocess(
        PreprocessArgs(
            [str(tmp_path / "a.txt")], str(tmp_path / "t"), "CharLevelTokenizer", append_eod=True
        )
    )
    ds = IndexedDataset(p)
    assert [ds[i].tolist() for i in range(len(ds))] == [list(b"hello") + [0], list(b"world!") + [0]]
    rows = [{"text": "ab", "title": "T"}, {"text": "c", "title": ""}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text, title = preprocess(
        PreprocessArgs(
            [str(tmp_path / "b.jsonl")],
            str(tmp_path / "j"),
            "CharLevelTokenizer",
            jsonl_keys=("text", "title"),
        )
    )
    assert text.name == "j_text_document" and title.name == "j_title_document"
    assert (
        len(IndexedDataset(text)) == 2 and len(IndexedDataset(title)) == 1
    )  # empty text is skipped


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": broken}\n', "in.jsonl:2: invalid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', "in.jsonl:2: no key 'text' (keys: body)"),
        ('{"text": 5}\n', "in.jsonl:1: 'text' is not a string"),
        ("", "no documents found (empty input)"),
        ("[1, 2]\n", "in.jsonl:1: a JSON object is expected"),
        ("[" * 100_000 + "]" * 100_000 + "\n", "in.jsonl:1: the record is nested too deeply"),
    ],
    ids=lambda v: v[:20] if isinstance(v, str) else None,
)
def test_preprocess_errors_name_file_and_line_and_leave_nothing(tmp_path, capsys, content, message):
    (tmp_path / "in.jsonl").write_text(content)
    out = tmp_path / "out"
    status = main(
        [
            "preprocess",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output-prefix",
            str(out),
            "--tokenizer-type",
            "CharLevelTokenizer",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err
    assert list(tmp_path.glob("out*")) == []


def test_train_tokenizer_names_a_line_nested_too_deeply(tmp_path):
    from torchneox.data.tokenizers import _texts

    (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError) as e:
        list(_texts([str(tmp_path / "in.jsonl")], ("text",), [0]))
    assert str(e.value).startswith(f"{tmp_path / 'in.jsonl'}:2: the record is nested too deeply")


def test_preprocess_missing_input_and_tokenizer_file(tmp_path, capsys):
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "nope.jsonl"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "CharLevelTokenizer",
            ]
        )
        == 2
    )
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "a.jsonl"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "HFTokenizer",
                "--vocab-file",
                str(tmp_path / "missing.json"),
            ]
        )
        == 2
    )
    assert "missing.json: no such file" in capsys.readouterr().err


def test_an_interrupted_writer_leaves_no_pair(tmp_path):
    write_dataset(tmp_path / "d", [[1, 2]])
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_document([7, 7, 7])
    w.abort()
    assert IndexedDataset(tmp_path / "d")[0].tolist() == [1, 2]  # the old pair is untouched
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("d")) == [
        "d.bin",
        "d.idx",
    ]


def test_large_vocabularies_are_written_as_int32(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "big", np.int32)
    w.add_document([70000, 1])
    w.finish()
    assert IndexedDataset(tmp_path / "big")[0].tolist() == [70000, 1]


def test_epochs_and_indices_are_consistent():
    rng = np.random.RandomState(0)
    sizes = rng.randint(1, 50, size=300).astype(np.int32)
    docs = np.arange(300, dtype=np.int32)
    for seq, n in ((16, 10), (16, 1000), (7, 5000)):
        doc_idx, sample_idx, shuffle_idx = build_indices(sizes, docs, n, seq, 3)
        epochs = num_epochs(int(sizes.sum()), seq, n)
        assert len(doc_idx) == 300 * epochs and len(shuffle_idx) >= n
        # every sample starts seq tokens after the previous one
        starts = (
            np.concatenate([[0], np.cumsum(sizes[doc_idx])])[sample_idx[:, 0]] + sample_idx[:, 1]
        )
        assert np.all(np.diff(starts) == seq)


def test_samples_overlap_by_one_token_and_ids_are_checked(tmp_path):
    ds = write_dataset(tmp_path / "d", [list(range(i, i + 10)) for i in range(0, 200, 10)])
    g = GPTDataset(ds, "train", np.arange(20, dtype=np.int32), 10, 8, 1)
    flat = np.concatenate([ds[int(d)] for d in g.doc_idx])
    for k in range(5):
        s = int(g.shuffle_idx[k])
        assert g[k].tolist() == flat[s * 8 : s * 8 + 9].tolist()


def test_loader_gives_each_rank_its_share_and_resumes(tmp_path):
    samples = [np.full(3, i) for i in range(100)]
    ranks = [
        BatchLoader(samples, micro_batch=2, grad_accum=3, dp_rank=r, dp_size=2, prefetch=False)
        for r in range(2)
    ]
    first = [[mb[:, 0].tolist() for mb in loader.next()] for loader in ranks]
    assert first == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]
    seen = sorted(i for rank in first for mb in rank for i in mb)
    assert seen == list(range(12))  # the global batch, each sample once
    state = ranks[0].state_dict()
    again = BatchLoader(samples, 2, 3, 0, 2, prefetch=True)
    again.load_state_dict(state)
    expected = [mb.tolist() for mb in ranks[0].next()]
    assert [mb.tolist() for mb in again.next()] == expected
    assert [mb.tolist() for mb in again.next()] == [mb.tolist() for mb in ranks[0].next()]
    again.close()


def _config(tmp_path, prefix, **extra):
    cfg = {
        "num_layers": 1,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "seq_length": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "train_iters": 5,
        "tokenizer_type": "CharLevelTokenizer",
        "data_path": str(prefix),
        "split": "90,10,0",
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    } | extra
    path = tmp_path / "c.yml"
    path.write_text(json.dumps(cfg))
    return path


def test_data_batch_command(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("\n".join(f"line number {i} of the text" for i in range(200)))
    (prefix,) = preprocess(
        PreprocessArgs(
            [str(tmp_path / "a.txt")], str(tmp_path / "t"), "CharLevelTokenizer", append_eod=True
        )
    )
    cfg = _config(tmp_path, prefix)
    assert (
        main(["data", "batch", str(cfg), "--iteration", "2", "--out", str(tmp_path / "b.npy")]) == 0
    )
    batch = np.load(tmp_path / "b.npy")
    assert batch.shape == (4, 17)
    assert main(["data", "batch", str(cfg), "--iteration", "2"]) == 0
    out = capsys.readouterr().out
    assert "--- sample 4 (step 2, position 0) ---" in out and "line numbe" in out
    assert "<|endoftext|>" in out and "\x00" not in out
    assert main(["data", "batch", str(cfg), "--iteration", "9"]) == 2


def test_token_ids_beyond_the_vocabulary_are_an_error(tmp_path, capsys):
    prefix = tmp_path / "d"
    write_dataset(prefix, [[1, 2, 3] * 20, [600, 1] * 20])
    cfg = _config(tmp_path, prefix)
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{prefix}: token id 600 is outside the model's vocabulary of 512" in err


def test_builtin_corpus_and_train_tokenizer(tmp_path, capsys):
    docs = list(builtin.documents("pydocs", max_bytes=20000))
    assert len(docs) >= 2 and all(len(d) > 40 for d in docs)
    path = tmp_path / "c.jsonl"
    builtin.write_jsonl("pydocs", path, max_bytes=200000)
    assert (
        main(
            [
                "train-tokenizer",
                "--input",
                str(path),
                "--output",
                str(tmp_path / "tok.json"),
                "--vocab-size",
                "400",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(path),
                "--output-prefix",
                str(tmp_path / "p"),
                "--tokenizer-type",
                "HFTokenizer",
                "--vocab-file",
                str(tmp_path / "tok.json"),
                "--append-eod",
            ]
        )
        == 0
    )
    ds = IndexedDataset(tmp_path / "p_text_document")
    assert ds.max_token() < 400 and ds[0][-1] == 0  # <|endoftext|> is id 0 of the trained tokenizer
    assert (
        main(
            [
                "preprocess",
                "--builtin",
                "nope",
                "--output-prefix",
                "x",
                "--tokenizer-type",
                "CharLevelTokenizer",
            ]
        )
        == 2
    )
    assert CharLevelTokenizer().decode(CharLevelTokenizer().encode("héllo")) == "héllo"


def _build_in_process(args):
    prefix, cache = args
    import os

    os.environ["TORCHNEOX_INDEX_CACHE"] = cache
    from torchneox.data.gpt_dataset import GPTDataset
    from torchneox.data.indexed import IndexedDataset

    ds = IndexedDataset(prefix)
    g = GPTDataset(ds, "train", np.arange(len(ds), dtype=np.int32), 500, 16, 7)
    return np.asarray(g.shuffle_idx).tolist()


def test_concurrent_processes_build_the_index_once(tmp_path):
    import multiprocessing

    write_dataset(tmp_path / "d", [list(range(i % 50 + 1)) for i in range(300)])
    cache = tmp_path / "shared-cache"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        results = pool.map(_build_in_process, [(str(tmp_path / "d"), str(cache))] * 3)
    assert results[0] == results[1] == results[2]
    assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".lock", ".npy", ".npy", ".npy"]


def test_weights_by_num_documents():
    from torchneox.data.blend import weights_by_num_documents

    assert weights_by_num_documents([5], 0.3) == [1.0]
    w = weights_by_num_documents([900, 100], 0.3)
    # shares 0.9/0.1 tempered by alpha 0.3, times (1 - share), normalised
    t = [0.9**0.3, 0.1**0.3]
    raw = [t[0] / sum(t) * 0.1, t[1] / sum(t) * 0.9]
    assert w == pytest.approx([raw[0] / sum(raw), raw[1] / sum(raw)])
    assert w[1] > w[0]  # the small dataset is sampled more than its share


def _corpus(prefix, lengths):
    writer = IndexedDatasetWriter(prefix, np.dtype(np.uint16))
    for i, n in enumerate(lengths):
        writer.add_document((np.arange(n) + i) % 200 + 1)
    writer.finish()
    return IndexedDataset(prefix)


@pytest.mark.parametrize("second", ["same-count", "fewer-documents"])
def test_index_caches_are_rebuilt_when_the_data_under_them_changes(tmp_path, second):
    """A corpus preprocessed again to the same prefix: the cached sample index of the old one
    must not be used (it read the wrong spans, or failed with an IndexError)."""
    prefix = tmp_path / "x"
    rng = np.random.default_rng(0)
    first = _corpus(prefix, rng.integers(5, 60, 100))
    old = GPTDataset(first, "train", np.arange(100, dtype=np.int32), 50, 16, 1234)
    old_samples = [old[i].copy() for i in range(len(old))]
    lengths = rng.integers(5, 60, 100 if second == "same-count" else 40)
    changed = _corpus(prefix, lengths)
    docs = np.arange(len(lengths), dtype=np.int32)
    again = GPTDataset(changed, "train", docs, 50, 16, 1234)
    # what a fresh cache gives for the new corpus
    fresh = GPTDataset(changed, "fresh", docs, 50, 16, 1234)
    assert len(again) == len(fresh)
    for i in range(len(fresh)):
        assert np.array_equal(again[i], fresh[i])
    assert any(not np.array_equal(a, b) for a, b in zip(old_samples, again, strict=False))


def test_index_caches_without_a_source_record_are_used_when_they_fit(tmp_path):
    """GPT-NeoX's own caches (no source record beside them) stay interchangeable."""
    prefix = tmp_path / "x"
    ds = _corpus(prefix, np.random.default_rng(0).integers(5, 60, 100))
    built = GPTDataset(ds, "train", np.arange(100, dtype=np.int32), 50, 16, 1234)
    (record,) = built.index_files["doc_idx"].parent.glob("*.source.json")
    record.unlink()
    stamp = built.index_files["doc_idx"].stat().st_mtime_ns
    again = GPTDataset(ds, "train", np.arange(100, dtype=np.int32), 50, 16, 1234)
    assert again.index_files["doc_idx"].stat().st_mtime_ns == stamp  # not rebuilt


@pytest.mark.parametrize("verb", ["data", "train"])
def test_a_dataset_smaller_than_one_sample_is_refused(tmp_path, capsys, verb):
    """5 tokens cannot fill one sample of seq_length + 1 = 17: GPT-NeoX would repeat them
    within each sample, epoch after epoch; the run is refused naming the dataset and sizes."""
    write_dataset(tmp_path / "t", [[5, 6, 7], [8, 9]])
    cfg = str(_config(tmp_path, tmp_path / "t", split="100,0,0"))
    args = ["data", "batch", cfg, "--iteration", "1"] if verb == "data" else ["train", cfg]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{tmp_path / 't'}: the train split has 5 tokens (2 documents), fewer than one " in err
    assert "sample of seq_length + 1 = 17 tokens" in err


def test_an_evaluation_split_smaller_than_one_sample_is_not_evaluated_and_said(tmp_path):
    from torchneox.config.load import load_config
    from torchneox.data.datasets import build_splits

    write_dataset(tmp_path / "t", [[5 + n % 9] * 10 for n in range(20)])
    cfg = _config(tmp_path, tmp_path / "t", split="90,10,0", seq_length=32)
    splits = build_splits(load_config([str(cfg)]).config, 4)
    assert splits.train is not None and splits.valid is None
    assert splits.notes == [
        f"{tmp_path / 't'}: split '90,10,0' gives the valid split 20 tokens, fewer than one "
        "sample of seq_length + 1 = 33; valid is not evaluated"
    ]
