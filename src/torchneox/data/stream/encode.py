"""Raw records -> token ids, as preprocess tokenizes a document with ``--append-eod``: a jsonl
line decoded as UTF-8 and parsed, its text field taken (a column's value is the text), the
tokenizer's ids, then EOD; a document that tokenizes to nothing is left out (as preprocess
leaves it out). A bad record is its one-line message naming the file and line instead.

``Tokenize`` runs in the loader's thread (num_workers 0) or in a pool of worker processes
(spawned; each builds the tokenizer once); either gives the same ids in the same order.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from torchneox.config.keys.io import TokenizerConfig
from torchneox.data.stream.readers import Record
from torchneox.data.text_input import TOO_DEEP
from torchneox.data.tokenizers import Tokenizer, build_tokenizer

Encoded = tuple[np.ndarray | None, str]
"""(token ids int32, '') or (None, why the record is bad)."""


def text_of(record: Record, key: str) -> tuple[str | None, str]:
    """(the record's text, '') or (None, its one-line fault)."""
    where, is_line, raw = record
    if not is_line:
        if raw is None:
            return None, f"{where}: {key!r} is null"
        if not isinstance(raw, str):
            return None, f"{where}: {key!r} is not a string ({type(raw).__name__})"
        return raw, ""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"{where}: not UTF-8 text ({e.reason} at byte {e.start})"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"{where}: invalid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return None, f"{where}: {TOO_DEEP}"
    if not isinstance(value, dict):
        return None, f"{where}: a JSON object is expected, got {type(value).__name__}"
    if key not in value:
        return None, f"{where}: no key {key!r} (keys: {', '.join(value)[:200]})"
    if not isinstance(value[key], str):
        return None, f"{where}: {key!r} is not a string"
    return value[key], ""


class Encoder:
    def __init__(self, tokenizer: TokenizerConfig, key: str):
        self.tokenizer_config, self.key = tokenizer, key
        self._tok: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer_config": self.tokenizer_config, "key": self.key, "_tok": None}

    @property
    def tok(self) -> Tokenizer:
        if self._tok is None:
            self._tok = build_tokenizer(self.tokenizer_config)
        return self._tok

    def __call__(self, record: Record) -> Encoded:
        text, fault = text_of(record, self.key)
        if text is None:
            return None, fault
        ids = self.tok.encode(text) if text else []
        if ids:
            ids.append(self.tok.eod_id)
        return np.asarray(ids, dtype=np.int32), ""


_WORKER: Encoder | None = None


def _start(encoder: Encoder) -> None:
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    _WORKER = encoder
    encoder.tok  # noqa: B018 (built once, before the first task)


def _encode(record: Record) -> Encoded:
    assert _WORKER is not None
    return _WORKER(record)


class Tokenize:
    """Records -> Encoded, in order: in this process, or in ``workers`` processes."""

    def __init__(self, encoder: Encoder, workers: int):
        self.encoder, self.workers = encoder, workers
        self._pool: Any = None

    def __call__(self, records: Iterable[Record]) -> Iterator[Encoded]:
        if self.workers == 0:
            return map(self.encoder, records)
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(self.workers, initializer=_start, initargs=(self.encoder,))
        return self._pool.imap(_encode, records, chunksize=16)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
