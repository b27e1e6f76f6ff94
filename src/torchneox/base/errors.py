"""Every error type a user can cause, and the helpers that keep their messages one line.

The CLI catches these (and only these) as user mistakes: exit 2, one line, no traceback.
``TrainingStopped`` is the one fault of a run itself (exit 1)."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A user mistake in a config: where it is, which key, what is wrong, what to do.

    ``str(error)`` is one line, ready to print: ``SOURCE: KEY: message``.
    """

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        self.message = message
        self.source = source
        self.key = key
        parts = [p for p in (source, key) if p]
        super().__init__(": ".join([*parts, message]))


class DataError(ValueError):
    """A dataset that cannot be read or written; the message names the file."""


class HFError(ConfigError):
    """A Hugging Face folder or an export that cannot be done."""


class NeoXCheckpointError(ConfigError):
    """A GPT-NeoX checkpoint folder that cannot be imported."""


class CheckpointWriteError(RuntimeError):
    """A save failed (disk full, unwritable directory); the previous checkpoint is untouched.
    ``reason``: why, in a few words (the operating system's reason and file, where known)."""

    reason: str = ""


class TrainingStopped(RuntimeError):
    """A run that cannot go on (a non-finite loss, say); the message says why and what is kept."""


USER_ERRORS = (ConfigError, DataError)


def closest(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice most like ``word``, if any is close enough to be a likely typo."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:
        return lowered[word.lower()]
    match = difflib.get_close_matches(word, choices, n=1, cutoff=cutoff)
    return match[0] if match else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'; did you mean X?' when a close choice exists, else ''."""
    match = closest(word, choices)
    return f"; did you mean {match}?" if match else ""


def first_line(error: BaseException) -> str:
    """The first line of a foreign exception's message (its type when it has none, or when its
    message cannot be made: a ``__str__`` that raises, a value nested too deep to show), for a
    one-line error that names what failed."""
    try:
        text = str(error)
    except Exception:
        text = ""
    return (text.strip().splitlines() or [type(error).__name__])[0]


class _Bounded(reprlib.Repr):
    """reprlib's bounded repr (a few levels, items and characters), whose every failure -- a
    ``__repr__`` that raises, a ``__len__`` that lies -- shows the type instead."""

    def repr1(self, x: Any, level: int) -> str:
        try:
            return super().repr1(x, level)
        except Exception:
            return f"<{_type_name(x)}>"

    def repr_instance(self, x: Any, level: int) -> str:
        try:
            text = repr(x)
        except Exception:
            return f"<{_type_name(x)}>"
        return text if len(text) <= self.maxother else text[: self.maxother - 3] + "..."


_BOUNDED = _Bounded()
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother = 3, 200, 200


def _type_name(x: Any) -> str:
    try:
        return type(x).__name__
    except Exception:  # pragma: no cover - a type's name is a str
        return "object"


def shown(value: Any, limit: int = 40) -> str:
    """A user's value (a data server's answer, a reward, a JSON record) as a message shows it:
    its repr, depth-limited (``[[[...]]]``, never a RecursionError), at most ``limit``
    characters and one line, whatever its ``__repr__`` does."""
    try:
        text = _BOUNDED.repr(value)
    except Exception:
        text = f"<{_type_name(value)}>"
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii", "replace")
    return text if len(text) <= limit else text[: limit - 3] + "..."
