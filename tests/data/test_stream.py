"""Streamed raw text (data/stream/): the token stream of every source kind equals what preprocess
writes, the order (shuffled, held out, per rank, mixed) is deterministic, a position resumes
exactly, bad records stop with one line or are counted."""

from __future__ import annotations

import gzip
import itertools
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import WORDS, shared_dir
from torchneox.base.errors import ConfigError, DataError
from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.data.indexed import IndexedDataset
from torchneox.data.preprocess import PreprocessArgs, preprocess
from torchneox.data.stream.build import stream_split
from torchneox.data.stream.encode import Encoder, Tokenize

SHARED = shared_dir()
TOKENIZER_20B = str(SHARED / "data/tokenizers/gpt_neox_20b/20B_tokenizer.json") if SHARED else None
SEQ = 16


def documents(n: int = 90, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(n)]
    out[3] = ""  # tokenizes to nothing: left out, as preprocess leaves it out
    out[7] = "naïve café — ünïcödé ✓ 日本語"
    return out


def write_jsonl(path: Path, docs: list[str], opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
            if i == 10:
                f.write("\n")  # a blank line: skipped, as preprocess skips it
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as jsonl (plain, gz, zst), parquet (3 row groups), arrow, a
    datasets folder and a folder of two files; and preprocess's .bin of the jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    folder = tmp_path_factory.mktemp("stream")
    docs = documents()
    out = {"docs": docs, "jsonl": write_jsonl(folder / "c.jsonl", docs)}
    out["gz"] = write_jsonl(folder / "c.jsonl.gz", docs, gzip.open)
    out["zst"] = folder / "c.jsonl.zst"
    out["zst"].write_bytes(zstandard.ZstdCompressor().compress(out["jsonl"].read_bytes()))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    out["parquet"] = folder / "c.parquet"
    pq.write_table(table, out["parquet"], row_group_size=40)
    out["arrow"] = folder / "c.arrow"
    with pa.OSFile(str(out["arrow"]), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=25)
    (folder / "parts").mkdir()
    write_jsonl(folder / "parts" / "a.jsonl", docs[:50])
    pq.write_table(table.slice(50), folder / "parts" / "b.parquet")
    out["folder"] = folder / "parts"
    return out


def make_config(tmp_path: Path, **keys) -> object:
    cfg = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": SEQ,
        "train_micro_batch_size_per_gpu": 2,
        "train_iters": 10,
        "tokenizer_type": "CharLevelTokenizer",
        "stream_shuffle": False,
        "num_workers": 0,
    } | keys
    path = tmp_path / f"c{len(list(tmp_path.glob('c*.json')))}.json"
    path.write_text(json.dumps(cfg))
    return load_config([str(path)]).config


def split_of(cfg, name="train", rank=0, ranks=1, workers=0):
    split = stream_split(cfg, name, 1000, rank, ranks)
    assert split is not None
    split.set_tokenize(Tokenize(Encoder(cfg.tokenizer, cfg.data.jsonl_keys[0]), workers))
    return split


def token_stream(split, tokens: int) -> np.ndarray:
    """The packed stream: each sample's first SEQ tokens, concatenated (samples share one)."""
    out = [split.next() for _ in range(-(-tokens // SEQ))]
    assert all(len(s) == SEQ + 1 for s in out)
    assert all(a[-1] == b[0] for a, b in itertools.pairwise(out))
    return np.concatenate([s[:SEQ] for s in out])[:tokens]


def preprocessed(tmp_path: Path, jsonl: Path, tokenizer: str, vocab: str | None) -> np.ndarray:
    (prefix,) = preprocess(
        PreprocessArgs([str(jsonl)], str(tmp_path / "ref"), tokenizer, vocab, append_eod=True)
    )
    data = IndexedDataset(str(prefix))
    return np.concatenate([data[i] for i in range(len(data))]).astype(np.int64)


def documents_of(stream: np.ndarray, eod: int) -> list[tuple[int, ...]]:
    cuts = np.flatnonzero(stream == eod)
    return [tuple(x) for x in np.split(stream, cuts + 1)[:-1]]


def test_every_source_kind_streams_what_preprocess_writes(corpus, tmp_path, monkeypatch):
    """Shuffle off: one epoch of each source equals, token for token, the .bin preprocess
    writes from the jsonl with --append-eod (the 20B tokenizer), then the next epoch begins."""
    if TOKENIZER_20B is None:
        pytest.skip("the 20B tokenizer in ../shared is not on this machine")
    import datasets

    from torchneox.data.stream.sources import resolve

    ref = preprocessed(tmp_path, corpus["jsonl"], "HFTokenizer", TOKENIZER_20B)
    disk, splits = tmp_path / "saved", tmp_path / "splits"
    whole = datasets.Dataset.from_dict({"text": corpus["docs"]})
    whole.save_to_disk(str(disk))
    datasets.DatasetDict({"train": whole, "validation": whole.select(range(5))}).save_to_disk(
        str(splits)
    )
    assert "validation" in resolve(str(splits), "valid").units[0].file
    cache = tmp_path / "hf-cache"
    prepared = cache / "someone___corpus" / "default" / "0.0.0" / "abc123"
    prepared.mkdir(parents=True)
    shutil.copy(next(disk.glob("*.arrow")), prepared / "corpus-train.arrow")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    kinds = [
        "jsonl",
        "gz",
        "zst",
        "parquet",
        "arrow",
        "folder",
        disk,
        splits,
        "hf://someone/corpus",
    ]
    for kind in kinds:
        path = str(corpus[kind]) if kind in corpus else str(kind)
        cfg = make_config(
            tmp_path,
            tokenizer_type="HFTokenizer",
            vocab_file=TOKENIZER_20B,
            train_data_paths=[path],
        )
        got = token_stream(split_of(cfg), len(ref) + 40)
        assert np.array_equal(got[: len(ref)], ref), kind
        assert np.array_equal(got[len(ref) :], ref[:40]), kind  # the next epoch


def test_order_is_the_seeds_shuffled_held_out_and_shared_by_ranks(corpus, tmp_path):
    eod = 0  # CharLevelTokenizer's
    ref = preprocessed(tmp_path, corpus["jsonl"], "CharLevelTokenizer", None)
    every = sorted(documents_of(ref, eod))
    path = str(corpus["parquet"])
    shuffled = make_config(
        tmp_path, train_data_paths=[path], stream_shuffle=True, stream_shuffle_buffer=16, seed=7
    )
    one = token_stream(split_of(shuffled), len(ref))
    assert np.array_equal(one, token_stream(split_of(shuffled), len(ref)))  # deterministic
    assert not np.array_equal(one, ref)
    assert sorted(documents_of(one, eod)) == every  # each document once an epoch
    other = make_config(tmp_path, train_data_paths=[path], stream_shuffle=True, seed=8)
    assert not np.array_equal(one, token_stream(split_of(other), len(ref)))
    # two data-parallel ranks read disjoint halves of every epoch
    halves = [
        documents_of(token_stream(split_of(shuffled, rank=r, ranks=2), len(ref) // 2 - 60), eod)
        for r in (0, 1)
    ]
    assert not set(halves[0]) & set(halves[1]) - {(eod,)}
    # data_path: documents held out by a hash of their place, the same for every seed
    held = {}
    for name in ("train", "valid", "test"):
        cfg = make_config(tmp_path, data_path=path, split="70,20,10", stream_shuffle=True)
        held[name] = set(documents_of(token_stream(split_of(cfg, name), 2 * len(ref)), eod))
    assert not held["train"] & held["valid"] and not held["valid"] & held["test"]
    assert held["train"] | held["valid"] | held["test"] == set(every)
    assert 0 < len(held["test"]) < len(held["valid"]) < len(held["train"])


def test_a_weighted_mix_with_a_bin_dataset_resumes_anywhere(corpus, tmp_path):
    """jsonl + parquet + .bin weighted 3:1:1: GPT-NeoX's blend order; a position taken after
    any sample (mid-document, mid-window) and loaded into a fresh split, with another worker
    count, continues the same stream."""
    from torchneox.data.blend import blending_indices

    preprocessed(tmp_path, corpus["jsonl"], "CharLevelTokenizer", None)
    paths = [str(corpus["zst"]), str(corpus["parquet"]), str(tmp_path / "ref_text_document")]
    cfg = make_config(
        tmp_path,
        train_data_paths=paths,
        train_data_weights=[3, 1, 1],
        stream_shuffle=True,
        stream_shuffle_buffer=8,
    )
    whole = split_of(cfg)
    want = [whole.next() for _ in range(120)]
    which, _ = blending_indices([0.6, 0.2, 0.2], 120)
    assert whole.taken == [int((which == d).sum()) for d in range(3)]
    resumed = split_of(cfg)
    for stop in (1, 37, 90):
        first = split_of(cfg)
        for _ in range(stop):
            first.next()
        state = json.loads(json.dumps(first.state()))  # as the checkpoint's metadata holds it
        resumed = split_of(cfg, workers=2 if stop == 37 else 0)
        resumed.load(state)
        got = [resumed.next() for _ in range(120 - stop)]
        assert all(np.array_equal(a, b) for a, b in zip(got, want[stop:], strict=True)), stop


BAD = {
    "not JSON": b'{"text": "half\n',
    "missing key": b'{"body": "no text field"}\n',
    "not UTF-8": b'{"text": "caf\xe9"}\n',
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_record_stops_with_its_file_and_line_or_is_counted(corpus, tmp_path, case):
    good = corpus["jsonl"].read_bytes().splitlines(keepends=True)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(good[:20]) + BAD[case] + b"".join(good[20:]))
    cfg = make_config(tmp_path, train_data_paths=[str(path)])
    with pytest.raises(DataError) as e:
        token_stream(split_of(cfg), 3000)
    message = str(e.value)
    assert message.startswith(f"{path}:21: ") and "\n" not in message
    assert "skip_bad_records" in message
    skipping = split_of(make_config(tmp_path, train_data_paths=[str(path)], skip_bad_records=True))
    ref = token_stream(
        split_of(make_config(tmp_path, train_data_paths=[str(corpus["jsonl"])])), 2500
    )
    assert np.array_equal(token_stream(skipping, 2500), ref)
    assert skipping.bad_records == 1


def test_data_batch_and_explain_show_a_stream(corpus, tmp_path, capsys):
    cfg = tmp_path / "run.json"
    keys = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": SEQ,
        "train_micro_batch_size_per_gpu": 2,
        "train_iters": 4,
        "tokenizer_type": "CharLevelTokenizer",
        "num_workers": 0,
        "train_data_paths": [str(corpus["jsonl"]), str(corpus["parquet"])],
    }
    cfg.write_text(json.dumps(keys))
    assert main(["data", "batch", str(cfg), "--iteration", "2"]) == 0
    assert "--- sample 2 (step 2, position 0) ---" in capsys.readouterr().out
    assert main(["config", "explain", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "jsonl, read line by line" in out and "parquet, read by row group" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": 1}\n')
    cfg.write_text(json.dumps(keys | {"train_data_paths": [str(bad)]}))
    assert main(["data", "batch", str(cfg), "--iteration", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:2: no key 'text'" in err


def test_another_data_parallel_size_or_other_data_is_refused_on_resume(corpus, tmp_path):
    from torchneox.data.stream.build import build_loaders

    cfg = make_config(tmp_path, train_data_paths=[str(corpus["jsonl"])])
    counts = {"train": 100, "valid": 0, "test": 0}
    two = build_loaders(cfg, counts, 2, 1, dp_rank=0, dp_size=2, gather=lambda x: [x, (1, x[1])])
    two["train"].next()
    saved = json.loads(json.dumps(two["train"].state_dict()))
    one = build_loaders(cfg, counts, 2, 1)["train"]
    with pytest.raises(ConfigError, match="read by 2 data-parallel ranks, this run has 1: "):
        one.load_state_dict(saved)
    other = make_config(tmp_path, train_data_paths=[str(corpus["jsonl"])], seed=5)
    moved = build_loaders(other, counts, 2, 1, dp_rank=1, dp_size=2)["train"]
    with pytest.raises(ConfigError, match="the streamed data changed since"):
        moved.load_state_dict(saved)
    with pytest.raises(ConfigError, match=r"from \.bin/\.idx datasets"):
        moved.load_state_dict({"consumed_samples": 4})


def test_a_held_out_split_without_documents_is_not_evaluated(corpus, tmp_path):
    from torchneox.data.stream.build import build_loaders

    cfg = make_config(tmp_path, data_path=str(corpus["jsonl"]), split="969,30,1")
    counts = {"train": 100, "valid": 8, "test": 8}
    loaders = build_loaders(cfg, counts, 2, 1)
    assert loaders["valid"].has_full_batch()  # 3% of 90 documents
    assert loaders["valid"].next()[0].shape == (2, SEQ + 1)
    assert not loaders["test"].has_full_batch()  # 0.1%: none of them
    with pytest.raises(DataError, match="no documents for this split"):
        loaders["test"].next()
