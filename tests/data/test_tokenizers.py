"""Every tokenizer_type, from local files only."""

from __future__ import annotations

import base64
import json

import pytest

from tests.conftest import shared_dir
from torchneox.config.schema import NeoXConfig, TokenizerConfig
from torchneox.data.indexed import IndexedDataset
from torchneox.data.preprocess import PreprocessArgs, preprocess
from torchneox.data.tokenizers import build_tokenizer

SHARED = shared_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
TEXT = "Hello world! The quick brown fox jumps over the lazy dog.\n\tNumbers: 12345, émigré, 東京."


def config(kind: str, vocab: str | None = None, merges: str | None = None) -> TokenizerConfig:
    tok = NeoXConfig().tokenizer
    tok.tokenizer_type = kind  # type: ignore[assignment]
    tok.vocab_file, tok.merge_file = vocab, merges
    return tok


@needs_shared
def test_gpt2_bpe_from_vocab_and_merges_equals_the_tokenizer_json():
    gpt2 = SHARED / "data/tokenizers/gpt2"
    bpe = build_tokenizer(
        config("GPT2BPETokenizer", str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt"))
    )
    hf = build_tokenizer(config("HFTokenizer", str(gpt2 / "tokenizer.json")))
    assert bpe.encode(TEXT) == hf.encode(TEXT)
    assert bpe.decode(bpe.encode(TEXT)) == TEXT
    assert bpe.eod_id == 50256 and bpe.vocab_size == 50257


@needs_shared
def test_20b_tokenizer_ids():
    tok = build_tokenizer(
        config("HFTokenizer", str(SHARED / "data/tokenizers/gpt_neox_20b/20B_tokenizer.json"))
    )
    assert tok.eod_id == 0 and tok.pad_id == 1 and tok.vocab_size == 50277
    assert tok.decode(tok.encode(TEXT)) == TEXT


def _bytes_to_unicode() -> dict[int, str]:
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


@needs_shared
def test_tiktoken_from_a_local_rank_file_equals_gpt2(tmp_path):
    gpt2 = SHARED / "data/tokenizers/gpt2"
    decode = {v: k for k, v in _bytes_to_unicode().items()}
    vocab = json.loads((gpt2 / "vocab.json").read_text())
    lines = [
        base64.b64encode(bytes(decode[c] for c in token)).decode() + f" {rank}"
        for token, rank in vocab.items()
        if token != "<|endoftext|>"
    ]
    rank_file = tmp_path / "r50k_base.tiktoken"
    rank_file.write_text("\n".join(lines) + "\n")
    tik = build_tokenizer(config("TiktokenTokenizer", str(rank_file)))
    bpe = build_tokenizer(
        config("GPT2BPETokenizer", str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt"))
    )
    assert tik.encode(TEXT) == bpe.encode(TEXT)
    assert tik.eod_id == 50256 and tik.encode("a<|endoftext|>b") == [64, 50256, 65]
    wrong = tmp_path / "mine.tiktoken"
    wrong.write_text(rank_file.read_text())
    with pytest.raises(ValueError, match="name the file after its encoding"):
        build_tokenizer(config("TiktokenTokenizer", str(wrong)))


def test_sentencepiece_model_trained_here(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"sentence number {i} says hello to the world" for i in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=60,
        user_defined_symbols=["<|endoftext|>"],
        minloglevel=2,
    )
    tok = build_tokenizer(config("SPMTokenizer", str(tmp_path / "sp.model")))
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world" and tok.vocab_size == 60
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    (prefix,) = preprocess(
        PreprocessArgs(
            [str(tmp_path / "d.jsonl")],
            str(tmp_path / "o"),
            "SPMTokenizer",
            str(tmp_path / "sp.model"),
            append_eod=True,
        )
    )
    assert IndexedDataset(prefix)[0].tolist() == [*ids, tok.eod_id]


def test_zstd_compressed_jsonl(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    raw = "\n".join(json.dumps({"text": f"doc {i}"}) for i in range(5)).encode()
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (prefix,) = preprocess(
        PreprocessArgs([str(tmp_path / "d.jsonl.zst")], str(tmp_path / "o"), "CharLevelTokenizer")
    )
    ds = IndexedDataset(prefix)
    assert len(ds) == 5 and bytes(ds[4].tolist()) == b"doc 4"
