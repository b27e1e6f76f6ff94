"""Files a verb writes for the user (a plot, a batch, generated samples): the folder is made
when missing, and the file appears whole or not at all (a temporary name beside it, renamed at
the end), so a failed or interrupted write never leaves a half file or breaks an old one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torchneox.config.errors import ConfigError


@contextmanager
def atomic_output(path: str | Path, what: str = "output") -> Iterator[Path]:
    """Yields the temporary path to write; renamed to ``path`` when the block ends cleanly."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"is a folder; the {what} needs a file name", source=str(target))
    tmp = target.with_name(f".{target.stem}.partial-{os.getpid()}{target.suffix}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make its folder ({e.strerror})", source=str(target)) from None
    try:
        yield tmp
        os.replace(tmp, target)
    except OSError as e:
        raise ConfigError(f"cannot write it ({e.strerror})", source=str(target)) from None
    finally:
        tmp.unlink(missing_ok=True)


def refuse_existing(paths: list[Path], force: bool, what: str) -> None:
    """Nothing is written over without asking: an existing output is refused unless --force."""
    there = [p for p in map(Path, paths) if p.exists()]
    if there and not force:
        raise ConfigError(
            f"already exists; {what} would replace it: name another, or pass --force",
            source=str(there[0]),
        )
