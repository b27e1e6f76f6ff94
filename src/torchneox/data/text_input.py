"""The text inputs that preprocess tokenises and tokenizer training reads: .jsonl (one JSON
object per line), .jsonl.zst and .txt (one document per line), line by line, with the file and
line number each came from; a file that cannot be read as that is one line naming it."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchneox.base.errors import DataError

TOO_DEEP = (
    "the record is nested too deeply to read (thousands of levels); a record is a JSON object "
    "of a few levels"
)
"""What a JSON line json cannot parse without running out of recursion is told (a
RecursionError, not a JSONDecodeError)."""


@dataclass(frozen=True)
class Line:
    source: str
    number: int
    text: str
    is_json: bool


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(
                f"{path}: reading .zst needs the zstandard package (pip install zstandard)"
            ) from None
        stream = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))  # noqa: SIM115
        return io.TextIOWrapper(stream, encoding="utf-8")
    return open(path, encoding="utf-8")


def read_lines(inputs: list[str]) -> Iterator[Line]:
    for name in inputs:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"{name}: no such file")
        is_json = ".json" in path.name
        if not is_json and not path.name.endswith((".txt", ".txt.zst")):
            raise DataError(
                f"{name}: preprocess reads .jsonl (one JSON object per line), .jsonl.zst and .txt "
                f"(one document per line); '{''.join(path.suffixes) or 'no suffix'}' is none of "
                "them: convert it, or rename a plain-text file to .txt"
            )
        try:
            with _open_text(path) as f:
                for number, line in enumerate(f, start=1):
                    text = line.rstrip("\n")
                    if text.strip():
                        yield Line(name, number, text, is_json)
        except UnicodeDecodeError as e:
            raise DataError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise DataError(f"{name}: cannot read ({e.strerror or e})") from None
        except Exception as e:  # zstandard's own errors: a file that is not zstd at all
            if type(e).__module__.startswith("zstandard"):
                raise DataError(f"{name}: not a readable .zst file ({e})") from None
            raise
