"""Tokenizers as GPT-NeoX names them (`tokenizer_type`), with its end-of-text and pad ids."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torchneox.base.errors import ConfigError, did_you_mean, first_line
from torchneox.config.keys.io import TokenizerConfig
from torchneox.data.text_input import TOO_DEEP, read_lines

END_OF_TEXT = "<|endoftext|>"
PADDING = "<|padding|>"


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def decode_documents(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The text of each document in ``ids``, split at the end-of-text token."""
    pieces, current = [], []
    for token in ids:
        if token == tokenizer.eod_id:
            pieces.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return [*pieces, tokenizer.decode(current)]


@dataclass
class CharLevelTokenizer:
    """UTF-8 bytes as tokens; 512 ids, end-of-text 0 and pad 1 as in GPT-NeoX."""

    vocab_size: int = 512
    eod_id: int = 0
    pad_id: int | None = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer: a tokenizer.json, or GPT-2's vocab.json + merges.txt."""

    def __init__(self, backend, name: str):
        self._tok = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        specials = _configured_specials(Path(name))
        eod = backend.token_to_id(END_OF_TEXT)
        if eod is None and "eos_token" in specials:  # Llama 3's <|end_of_text|>, Mistral's </s>
            eod = backend.token_to_id(specials["eos_token"])
        if eod is None:
            raise ConfigError(
                f"{name} has no {END_OF_TEXT} token and no tokenizer_config.json beside it "
                "names an eos_token it has",
                key="vocab_file",
            )
        self.eod_id = eod
        self.pad_id = backend.token_to_id(PADDING)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _configured_specials(tokenizer_file: Path) -> dict[str, str]:
    """eos_token (and pad_token) of the Hugging Face tokenizer_config.json beside a tokenizer
    file (a string or {"content": ...}); empty when there is none or it is unreadable."""
    import json

    try:
        config = json.loads(tokenizer_file.with_name("tokenizer_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for name in ("eos_token", "pad_token"):
        value = config.get(name) if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def _need_file(path: str | None, key: str, kind: str) -> Path:
    if not path:
        raise ConfigError(f"{kind} needs {key}", key=key)
    if not Path(path).is_file():
        raise ConfigError(f"{path}: no such file", key=key)
    return Path(path)


def build_tokenizer(tok: TokenizerConfig) -> Tokenizer:
    """The tokenizer the ``tokenizer`` config group describes."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    kind = tok.tokenizer_type
    if kind == "CharLevelTokenizer":
        return CharLevelTokenizer()
    if kind == "HFTokenizer":
        path = _need_file(tok.vocab_file, "vocab_file", kind)
        with _reading(path, "a tokenizer.json (the `tokenizers` library's format)"):
            backend = Backend.from_file(str(path))
        return HFTokenizer(backend, str(path))
    if kind in ("GPT2BPETokenizer", "HFGPT2Tokenizer"):
        vocab = _need_file(tok.vocab_file, "vocab_file", kind)
        merges = _need_file(tok.merge_file, "merge_file", kind)
        with _reading(vocab, f"GPT-2's vocab.json with {merges.name} as its merges"):
            backend = Backend(models.BPE.from_file(str(vocab), str(merges)))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        return HFTokenizer(backend, str(vocab))
    if kind == "SPMTokenizer":
        path = _need_file(tok.vocab_file, "vocab_file", kind)
        with _reading(path, "a sentencepiece model"):
            return SentencePieceTokenizer(path)
    if kind == "TiktokenTokenizer":
        path = _need_file(tok.vocab_file, "vocab_file", kind)
        with _reading(path, "a tiktoken rank file"):
            return TiktokenTokenizer(path)
    raise ConfigError(
        f"unknown tokenizer type {kind!r}{did_you_mean(str(kind), TOKENIZER_TYPES)}; one of "
        + ", ".join(TOKENIZER_TYPES),
        key="tokenizer_type",
    )


def model_tokenizer(tok: TokenizerConfig, where: str) -> Tokenizer:
    """The tokenizer a model's own config names (a checkpoint's config.yml, a Hugging Face
    folder): one that names no file, or a file that is not here (a training cluster's path),
    is said as such, with the option that passes the right one."""
    kind = tok.tokenizer_type
    if kind in (None, "CharLevelTokenizer") or kind not in TOKENIZER_TYPES:
        return build_tokenizer(tok)
    files = [("vocab_file", tok.vocab_file)]
    if kind in ("GPT2BPETokenizer", "HFGPT2Tokenizer"):
        files.append(("merge_file", tok.merge_file))
    if not tok.vocab_file:
        raise ConfigError(
            "no tokenizer file is named or found (vocab_file is unset): pass the model's "
            "tokenizer with "
            "--set tokenizer_type=HFTokenizer --set vocab_file=PATH/tokenizer.json (or the "
            "tokenizer_type and files it was trained with)",
            source=where,
        )
    for key, path in files:
        if not path or not Path(path).is_file():
            raise ConfigError(
                f"names the {kind} tokenizer's {key} {path or '(none)'}, which is not here: "
                f"pass it with --set {key}=PATH",
                source=where,
            )
    return build_tokenizer(tok)


TOKENIZER_TYPES = (
    "HFTokenizer",
    "GPT2BPETokenizer",
    "HFGPT2Tokenizer",
    "SPMTokenizer",
    "CharLevelTokenizer",
    "TiktokenTokenizer",
)


@contextmanager
def _reading(path: Path, what: str) -> Iterator[None]:
    """A tokenizer file the library cannot read is one line naming it, not a traceback."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        first = first_line(e)
        raise ConfigError(
            f"cannot be read as {what} ({first}); is it the right file for this tokenizer_type?",
            source=str(path),
            key="vocab_file",
        ) from None


class SentencePieceTokenizer:
    """A sentencepiece model file; end-of-text is its <|endoftext|> piece, as in GPT-NeoX."""

    def __init__(self, path: Path):
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError(
                "SPMTokenizer needs sentencepiece (pip install 'torchneox[sentencepiece]')",
                key="tokenizer_type",
            ) from None
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        eod = self._sp.piece_to_id(END_OF_TEXT)
        if eod == self._sp.unk_id():
            raise ConfigError(f"{path} has no {END_OF_TEXT} piece", key="vocab_file")
        self.eod_id = eod
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


class TiktokenTokenizer:
    """A local tiktoken rank file named after its encoding (r50k_base.tiktoken, cl100k_base.tiktoken,
    ...): the file gives the merges, tiktoken's definition of that encoding its split pattern and
    special tokens. Nothing is downloaded."""

    def __init__(self, path: Path):
        try:
            import tiktoken
            import tiktoken_ext.openai_public as public
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise ConfigError(
                "TiktokenTokenizer needs tiktoken (pip install 'torchneox[tiktoken]')",
                key="tokenizer_type",
            ) from None
        name = path.name.split(".")[0]
        if name not in public.ENCODING_CONSTRUCTORS:
            known = ", ".join(sorted(public.ENCODING_CONSTRUCTORS))
            raise ConfigError(
                f"{path}: name the file after its encoding ({known})", key="vocab_file"
            )
        ranks = load_tiktoken_bpe(str(path))
        original = public.load_tiktoken_bpe
        public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
        try:
            spec = public.ENCODING_CONSTRUCTORS[name]()
        finally:
            public.load_tiktoken_bpe = original
        self._enc = tiktoken.Encoding(**spec)
        self.vocab_size = self._enc.n_vocab
        self.eod_id = self._enc.eot_token
        self.pad_id = None

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def _texts(paths: list[str], keys: tuple[str, ...], seen: list[int]):
    """The texts under ``keys`` of each input, read as preprocess reads them; counts them in
    ``seen``. A record that is not what preprocess takes is one line naming it."""
    import json

    from torchneox.base.errors import DataError

    for line in read_lines(paths):
        if not line.is_json:
            seen[0] += 1
            yield line.text
            continue
        try:
            record = json.loads(line.text)
        except json.JSONDecodeError as e:
            raise DataError(f"{line.source}:{line.number}: invalid JSON ({e.msg})") from None
        except RecursionError:
            raise DataError(f"{line.source}:{line.number}: {TOO_DEEP}") from None
        for key in keys:
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise DataError(f"{line.source}:{line.number}: no text under key {key!r}")
            if record[key]:
                seen[0] += 1
                yield record[key]


def train_bpe(
    inputs: list[str], output: str, vocab_size: int, keys: tuple[str, ...] = ("text",)
) -> int:
    """Train a byte-level BPE tokenizer.json (GPT-2 style, with <|endoftext|> and <|padding|>)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    for name in inputs:
        if not Path(name).is_file():
            raise ConfigError(f"{name}: no such file", key="--input")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, PADDING],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = [0]
    backend.train_from_iterator(_texts(inputs, keys, seen), trainer=trainer)
    if seen[0] == 0:
        from torchneox.base.errors import DataError

        raise DataError(f"{', '.join(inputs)}: no text to learn a tokenizer from (empty input)")
    from torchneox.config.paths import atomic_output

    with atomic_output(output, "train-tokenizer", inputs=inputs) as tmp:
        backend.save(str(tmp))
    return backend.get_vocab_size()
