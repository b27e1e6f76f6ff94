"""Every error type a user can cause, and the helpers that keep their messages one line.

The CLI catches these (and only these) as user mistakes: exit 2, one line, no traceback.
``TrainingStopped`` is the one fault of a run itself (exit 1)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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
    """The first line of a foreign exception's message (its type when it has none), for a
    one-line error that names what failed."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
