"""Outputs a verb writes for the user (a plot, a batch, generated samples, a converted model
folder): never over an existing one without --force, the folder made when missing, and the
output appearing whole or not at all (a temporary name beside it, renamed at the end), so a
failed or interrupted write never leaves a half file or breaks an old one."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torchneox.base.errors import ConfigError


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


def refuse_non_empty(out: Path, force: bool, verb: str) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"is a file; {verb} writes a folder there", source=str(out))
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"is not empty; {verb} writes a new folder: name another, or pass --force to "
            "replace it",
            source=str(out),
        )


@contextmanager
def new_output_dir(out: Path, force: bool, verb: str) -> Iterator[Path]:
    """A folder a verb writes whole: refused when ``out`` holds anything (unless ``force``),
    written under a temporary name beside it and renamed into place at the end, so a failed or
    interrupted write leaves what was there before and nothing half-written."""
    out = Path(out)
    refuse_non_empty(out, force, verb)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise ConfigError(f"cannot write here ({e.strerror})", source=str(out)) from None
    try:
        yield tmp
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # a full disk, a folder made read-only meanwhile
        raise ConfigError(
            f"writing it failed ({e.strerror or e}); nothing was written and what was there "
            "is unchanged",
            source=str(out),
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
