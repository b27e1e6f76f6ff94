"""The tokenizer's vocabulary size, read from its file where that is cheap (plain JSON), so
that config explain needs no tokenizer library."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError
from torchneox.config.schema import NeoXConfig

GPT2_VOCAB = 50257
CHAR_VOCAB = 512


@dataclass(frozen=True)
class VocabInfo:
    size: int | None
    reason: str
    exact: bool
    """True when read from the tokenizer's file (or fixed by the tokenizer kind)."""


def tokenizer_vocab_size(cfg: NeoXConfig) -> VocabInfo:
    """Size of the tokenizer's vocabulary, read from its file where that is cheap."""
    tok = cfg.tokenizer
    kind, path = tok.tokenizer_type, tok.vocab_file
    if kind == "CharLevelTokenizer":
        return VocabInfo(
            CHAR_VOCAB, f"{CHAR_VOCAB}, the character-level tokenizer's vocabulary", True
        )
    readable = path is not None and Path(path).is_file()
    if kind in ("GPT2BPETokenizer", "HFGPT2Tokenizer"):
        extra = 1 if kind == "HFGPT2Tokenizer" else 0  # it adds a padding token
        if readable:
            n = len(_read_json(path, "vocab_file")) + extra
            return VocabInfo(n, f"{n}, read from vocab_file {path}", True)
        missing = f" (vocab_file {path} is not readable here)" if path else ""
        return VocabInfo(
            GPT2_VOCAB + extra, f"{GPT2_VOCAB + extra}, GPT-2's vocabulary{missing}", False
        )
    if kind == "HFTokenizer" and readable:
        data = _read_json(path, "vocab_file")
        ids = list((data.get("model") or {}).get("vocab", {}).values())
        ids += [t["id"] for t in data.get("added_tokens", [])]
        if ids:
            n = max(ids) + 1
            return VocabInfo(n, f"{n}, read from vocab_file {path}", True)
    where = f"vocab_file {path} is not readable here" if path else "no vocab_file is given"
    return VocabInfo(None, f"unknown: {where}", False)


def _read_json(path: str, key: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path} as JSON ({e})", key=key) from None
