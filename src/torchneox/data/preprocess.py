"""``torchneox preprocess``: jsonl / text -> GPT-NeoX .bin/.idx, byte for byte what GPT-NeoX's
tools/datasets/preprocess_data.py writes for the same documents and tokenizer.

Per document and key: the tokenizer's ids, then end-of-text with ``--append-eod``; documents
that tokenize to nothing are skipped. With ``chat`` each key holds a record's messages, written
as GPT-NeoX's preprocess_data_with_chat_template.py writes them (int32 token, label and reward
datasets; a fractional reward makes the reward dataset float32; see data/chat.py). Tokenisation runs in worker processes; output order is input order.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchneox.base.errors import DataError
from torchneox.config.keys.io import TokenizerConfig
from torchneox.data.chat import (
    ROLES,
    ChatOptions,
    ChatTokenizer,
    chat_document,
    check_messages,
    reward_value,
)
from torchneox.data.indexed import IndexedDatasetWriter, best_dtype
from torchneox.data.text_input import TOO_DEEP, Line, read_lines
from torchneox.data.tokenizers import Tokenizer, build_tokenizer


@dataclass(frozen=True)
class PreprocessArgs:
    inputs: list[str]
    output_prefix: str
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    append_eod: bool = False
    jsonl_keys: tuple[str, ...] = ("text",)
    workers: int = 1
    log_interval: int = 10000
    chat: ChatOptions | None = None  # messages rendered with the tokenizer's chat template
    reward_key: str | None = None  # chat: each record's reward, one per document (int32/float32)
    binary_reward: bool = False  # chat: the reward's truth as +1 / -1

    def output_prefixes(self) -> list[Path]:
        """Every dataset written: per key the tokens, and in chat mode the labels (unless
        ``--no-mask``) and the rewards (with a reward key), under GPT-NeoX's names."""
        return [prefix for prefix, _ in self.outputs()]

    def outputs(self) -> list[tuple[Path, str]]:
        """Each dataset written with its kind ("", "_label" or "_reward")."""
        kinds = [""]
        if self.chat is not None and self.chat.mask:
            kinds.append("_label")
        if self.chat is not None and self.reward_key:
            kinds.append("_reward")
        return [
            (Path(f"{self.output_prefix}_{key}{kind}_document"), kind)
            for key in self.jsonl_keys
            for kind in kinds
        ]


def tokenizer_config(args: PreprocessArgs) -> TokenizerConfig:
    tok = TokenizerConfig()
    tok.tokenizer_type = args.tokenizer_type  # type: ignore[assignment]
    tok.vocab_file = args.vocab_file
    tok.merge_file = args.merge_file
    return tok


_TOKENIZERS: dict[tuple[str, str | None, str | None], Tokenizer | ChatTokenizer] = {}


class _Encoder:
    """Runs in each worker: parse one line, tokenise each key. The tokenizer is built once per
    process (module-level cache), since the encoder itself is pickled with every task batch."""

    def __init__(self, args: PreprocessArgs):
        self.args = args
        self.key = (args.tokenizer_type, args.vocab_file, args.merge_file)

    def initialise(self) -> None:
        if self.key not in _TOKENIZERS:
            _TOKENIZERS[self.key] = (
                build_tokenizer(tokenizer_config(self.args))
                if self.args.chat is None
                else ChatTokenizer.from_file(str(self.args.vocab_file))
            )

    def encode(self, line: Line) -> tuple[list[list[int]] | str, int]:
        """(ids per output dataset, bytes) or (error message, bytes)."""
        self.initialise()
        tok = _TOKENIZERS[self.key]
        size = len(line.text.encode("utf-8"))
        if line.is_json:
            try:
                record = json.loads(line.text)
            except json.JSONDecodeError as e:
                return (
                    f"{line.source}:{line.number}: invalid JSON ({e.msg} at column {e.colno})",
                    size,
                )
            except RecursionError:
                return f"{line.source}:{line.number}: {TOO_DEEP}", size
            if not isinstance(record, dict):
                return (
                    f"{line.source}:{line.number}: a JSON object is expected, got {type(record).__name__}",
                    size,
                )
            if self.args.chat is not None:
                assert isinstance(tok, ChatTokenizer)
                try:
                    return self._chat(tok, record, f"{line.source}:{line.number}"), size
                except DataError as e:
                    return str(e), size
            texts = []
            for key in self.args.jsonl_keys:
                if key not in record:
                    return (
                        f"{line.source}:{line.number}: no key {key!r} (keys: {', '.join(record)})",
                        size,
                    )
                if not isinstance(record[key], str):
                    return f"{line.source}:{line.number}: {key!r} is not a string", size
                texts.append(record[key])
        elif self.args.chat is not None:
            return f"{line.source}: chat preprocessing reads .jsonl records of messages", size
        else:
            texts = [line.text]
        out = []
        assert not isinstance(tok, ChatTokenizer)
        for text in texts:
            ids = tok.encode(text) if text else []
            if ids and self.args.append_eod:
                ids.append(tok.eod_id)
            out.append(ids)
        return out, size

    def _chat(self, tok: ChatTokenizer, record: dict, where: str) -> list[list[int]]:
        opts, out = self.args.chat, []
        assert opts is not None
        roles = tuple(dict.fromkeys((*ROLES, opts.generation_role)))
        for key in self.args.jsonl_keys:
            if key not in record:
                raise DataError(f"{where}: no key {key!r} (keys: {', '.join(record)})")
            messages = check_messages(record[key], where, key, roles)
            tokens, labels = chat_document(tok, messages, opts, f"{where}: {key!r}")
            out.append(tokens)
            if opts.mask:
                out.append(labels)
            if self.args.reward_key:
                out.append(
                    [reward_value(record, self.args.reward_key, self.args.binary_reward, where)]
                )
        return out


class RewardWriter:
    """A reward dataset, one value per document, written at the end: int32 when every reward
    is whole (GPT-NeoX's dtype, byte for byte), float32 when one is not (GPT-NeoX truncates
    them to int32; its reader and torchneox's read either as float32)."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        self.sizes: list[float] = []  # the rewards (one per document)
        self.bin_path = Path(self.prefix + ".bin")

    def add_document(self, values: list[float]) -> None:
        self.sizes.append(values[0])

    def finish(self) -> None:
        whole = all(float(v).is_integer() for v in self.sizes)
        writer = IndexedDatasetWriter(self.prefix, np.dtype(np.int32 if whole else np.float32))
        try:
            for v in self.sizes:
                writer.add_document([v])
            writer.finish()
        except BaseException:
            writer.abort()
            raise

    def abort(self) -> None:
        pass


class Progress:
    """Documents, tokens/s and ETA on stderr: a live line on a terminal, plain lines in logs."""

    def __init__(self, total_bytes: int, every: int):
        self.total, self.every = total_bytes, every
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.docs = self.tokens = self.bytes = 0

    def update(self, tokens: int, size: int) -> None:
        self.docs += 1
        self.tokens += tokens
        self.bytes += size
        if self.docs % self.every == 0:
            self.show()

    def show(self, final: bool = False) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = self.tokens / elapsed
        eta = (
            (self.total - self.bytes) / (self.bytes / elapsed) if self.bytes and not final else 0.0
        )
        line = (
            f"{self.docs:,} documents, {self.tokens:,} tokens, {rate:,.0f} tokens/s, "
            f"{self.bytes / 1e6 / elapsed:.2f} MB/s" + ("" if final else f", ETA {eta:.0f}s")
        )
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def _write(args: PreprocessArgs, results: Any, writers: list[Any], progress: Any) -> None:
    """Every encoded document into its key's writer; the files finished when each key has one."""
    for encoded, size in results:
        if isinstance(encoded, str):
            raise DataError(encoded)
        for writer, ids in zip(writers, encoded, strict=True):
            if ids:
                writer.add_document(ids)
        progress.update(sum(len(ids) for ids in encoded), size)
    if progress.docs == 0:
        raise DataError(f"{', '.join(args.inputs)}: no documents found (empty input)")
    empty = [w for w in writers if not w.sizes]
    if empty:
        raise DataError(
            f"{', '.join(args.inputs)}: every document is empty"
            + (f" under {Path(empty[0].prefix).name}" if len(writers) > 1 else "")
            + "; there is nothing to train on"
        )
    for writer in writers:
        writer.finish()


@contextlib.contextmanager
def _terminated_as_interrupted() -> Iterator[None]:
    """SIGTERM (``kill``, a scheduler's stop) unwinds as Ctrl-C does, so that the partial
    files are removed on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _worker_start(encoder: _Encoder) -> None:
    """A worker leaves Ctrl-C to the main process, which stops the pool and cleans up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    encoder.initialise()


def preprocess(args: PreprocessArgs) -> list[Path]:
    """Tokenise ``args.inputs`` into one .bin/.idx pair per jsonl key; returns their prefixes."""
    if not args.inputs:
        raise DataError("no input files given")
    if args.chat is not None:
        if args.tokenizer_type != "HFTokenizer":
            raise DataError(
                f"chat preprocessing needs a Hugging Face tokenizer.json (HFTokenizer), not "
                f"{args.tokenizer_type}"
            )
        ChatTokenizer.from_file(str(args.vocab_file))  # its template checked before any reading
        dtype = np.dtype(np.int32)  # as GPT-NeoX's chat tool writes every dataset (labels: -100)
    else:
        dtype = best_dtype(build_tokenizer(tokenizer_config(args)).vocab_size)
    total = 0
    for name in args.inputs:
        if not Path(name).is_file():
            raise DataError(f"{name}: no such file")
        total += Path(name).stat().st_size
    with _terminated_as_interrupted():
        prefixes = _tokenise(args, dtype, total)
    return prefixes


def _tokenise(args: PreprocessArgs, dtype: np.dtype, total: int) -> list[Path]:
    """The datasets written whole, or (an error, Ctrl-C, SIGTERM) their partial files removed."""
    prefixes = args.output_prefixes()
    writers: list[IndexedDatasetWriter] = []
    progress = Progress(total, args.log_interval)
    encoder = _Encoder(args)
    pool = None
    try:
        writers += [
            RewardWriter(p) if kind == "_reward" else IndexedDatasetWriter(p, dtype)
            for p, kind in args.outputs()
        ]
        if args.workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(
                args.workers, initializer=_worker_start, initargs=(encoder,)
            )
        results = (
            pool.imap(encoder.encode, read_lines(args.inputs), chunksize=64)
            if pool
            else map(encoder.encode, read_lines(args.inputs))
        )
        try:
            _write(args, results, writers, progress)
        except OSError as e:
            what = "the disk is full" if e.errno == errno.ENOSPC else e.strerror or str(e)
            raise DataError(
                f"{writers[0].bin_path.parent}: writing the dataset failed ({what}); nothing was "
                "written and the partial files are removed"
            ) from None
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    progress.show(final=True)
    return prefixes
