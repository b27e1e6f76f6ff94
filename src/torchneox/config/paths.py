"""Outputs a verb writes for the user (a plot, a batch, generated samples, a converted model
folder): never over an existing one without --force, never into, over or around the verb's own
inputs (even with --force), the folder made when missing, and the output appearing whole or not
at all (a temporary name beside it, renamed at the end), so a failed or interrupted write never
leaves a half file or breaks an old one. Every helper takes the verb's ``inputs`` and checks
them first (``refuse_overlap``), so the path rule lives here and only here."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from torchneox.base.errors import CheckpointWriteError, ConfigError, first_line

Paths = Iterable[str | Path]


def _resolved(path: str | Path) -> Path:
    """``path`` as the file system reaches it: absolute, symlinks and '..' resolved."""
    return Path(os.path.realpath(os.path.expanduser(path)))


def _shown(path: str | Path) -> str:
    """``path`` as given, and where a symlink leads when one is on the way."""
    target = _resolved(path)
    plain = os.path.abspath(os.path.expanduser(path))
    return str(path) if Path(plain) == target else f"{path} (a link to {target})"


def refuse_overlap(outputs: Paths, inputs: Paths, verb: str) -> None:
    """The path rule: an output that is one of the verb's inputs, holds one (the input lies
    inside the output folder) or lies inside an input folder is refused, with or without
    --force; paths are compared resolved (symlinks, '..', relative paths)."""
    given = [(p, _resolved(p)) for p in inputs if p is not None and str(p) != ""]
    for out in outputs:
        target = _resolved(out)
        for name, source in given:
            if target == source:
                how = "is"
            elif target in source.parents:
                how = "holds"
            elif source in target.parents:
                how = "lies inside"
            else:
                continue
            raise ConfigError(
                f"{verb} would write its output {_shown(out)}, which {how} its input "
                f"{_shown(name)}; "
                "--force replaces an output, never an input: name an output that neither is, "
                "holds nor lies inside an input"
            )


@contextmanager
def atomic_output(path: str | Path, what: str = "output", *, inputs: Paths) -> Iterator[Path]:
    """Yields the temporary path to write; renamed to ``path`` when the block ends cleanly."""
    target = Path(path)
    refuse_overlap([target], inputs, what)
    if target.is_dir():
        raise ConfigError(f"is a folder; the {what} needs a file name", source=str(target))
    tmp = target.with_name(f".{target.stem}.partial-{os.getpid()}{target.suffix}")
    remove_stale_partials(target.parent, f".{target.stem}.partial-")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make its folder ({e.strerror})", source=str(target)) from None
    try:
        yield tmp
        os.replace(tmp, target)
    except OSError as e:  # a full disk, a file-size limit, a folder made read-only meanwhile
        raise ConfigError(
            f"writing it failed ({_why(e, target.parent)}); nothing was written and what was "
            "there is unchanged",
            source=str(target),
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


def refuse_existing(paths: list[Path], force: bool, what: str, *, inputs: Paths) -> None:
    """Nothing is written over without asking: an existing output is refused unless --force,
    an output that is (or holds, or lies inside) an input always."""
    refuse_overlap(paths, inputs, what)
    there = [p for p in map(Path, paths) if p.exists()]
    if there and not force:
        raise ConfigError(
            f"already exists; {what} would replace it: name another, or pass --force",
            source=str(there[0]),
        )


def refuse_non_empty(out: Path, force: bool, verb: str, *, inputs: Paths) -> None:
    refuse_overlap([out], inputs, verb)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"is a file; {verb} writes a folder there", source=str(out))
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(
            f"is not empty; {verb} writes a new folder: name another, or pass --force to "
            "replace it",
            source=str(out),
        )


@contextmanager
def new_output_dir(out: Path, force: bool, verb: str, *, inputs: Paths) -> Iterator[Path]:
    """A folder a verb writes whole: refused when ``out`` holds anything (unless ``force``),
    written under a temporary name beside it and renamed into place at the end, so a failed or
    interrupted write leaves what was there before and nothing half-written."""
    out = Path(out)
    inputs = list(inputs)
    refuse_overlap([out], inputs, verb)
    with suppress(OSError):
        _recover(out)  # first: an old output it puts back is then asked about like any other
    refuse_non_empty(out, force, verb, inputs=inputs)
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
    except (OSError, CheckpointWriteError) as e:  # a full disk, a file-size limit, a folder
        # made read-only meanwhile; a checkpoint written into it (convert from-*) names why
        raise ConfigError(
            f"writing it failed ({_why(e, out.parent)}); nothing was written (the partial "
            "folder is removed) and what was there is unchanged",
            source=str(out),
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def free_space(folder: Path) -> str:
    """'N MiB free there': the room left where a write failed, for its one line."""
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


def _why(error: BaseException, folder: Path) -> str:
    """The reason a write failed, and the room left where it was written."""
    why = getattr(error, "strerror", None) or getattr(error, "reason", None)
    return f"{why or first_line(error)}; {free_space(folder)}"


def _recover(out: Path) -> None:
    """Clean up after a writer of ``out`` killed with SIGKILL: its partial folder removed and,
    had it moved the old output aside but not yet put the new one in place, the old one back."""
    remove_stale_partials(out.parent, f".{out.name}.partial-")
    for old in out.parent.glob(glob.escape(f".{out.name}.old-") + "*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            if out.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, out)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_partials(folder: Path, prefix: str) -> None:
    """What writers killed with SIGKILL (which nothing can catch) left under temporary names,
    ``folder/{prefix}{PID}...``: removed when that process is no longer running."""
    if not folder.is_dir():
        return
    for path in folder.glob(glob.escape(prefix) + "*"):
        digits = re.match(r"\d+", path.name[len(prefix) :])
        if digits is None or int(digits[0]) == os.getpid() or _running(int(digits[0])):
            continue
        with suppress(OSError):  # a folder we may not write to: left as it is
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def dataset_files(data: Any) -> list[str]:
    """Every .bin and .idx file a config's data group names (``data``: its DataConfig): what a
    verb reading that data must not write over."""
    prefixes: list[str] = []
    for field in dataclasses.fields(data):
        value = getattr(data, field.name)
        if field.name == "data_path" and value:
            prefixes.append(value)
        elif field.name.endswith("data_paths") and value:
            prefixes += list(value)
    from torchneox.config.features.streaming import is_stream

    return [p for p in prefixes if is_stream(p)] + [
        f"{p}{ext}" for p in prefixes if not is_stream(p) for ext in (".bin", ".idx")
    ]


def remove_if_empty(folder: Path) -> bool:
    """``folder`` removed when nothing in it holds a byte (a folder a refused command made
    for its outputs); whether it was. Every rank of a refused run may call it at once."""
    try:
        if not folder.is_dir():
            return False
        for path in folder.rglob("*"):
            if path.is_symlink() or (path.is_file() and path.stat().st_size > 0):
                return False
    except FileNotFoundError:  # another rank of the same refused run removed it first
        return not folder.exists()
    shutil.rmtree(folder, ignore_errors=True)
    return True


def read_json_object(path: Path, remedy: str, error: type[ConfigError] = ConfigError) -> dict:
    """The JSON object in the file ``path``; one line naming the file, with ``remedy``, when it
    is not valid JSON (cut short, not text, nested past reading) or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"is not valid JSON ({first_line(e)}){remedy}", source=str(path)) from None
    if not isinstance(value, dict):
        raise error(f"is not a JSON object{remedy}", source=str(path))
    return value
