"""The checkpoint's files: ``SAVE/global_step{N}/`` (torch distributed checkpoint + config.yml +
meta.json + manifest.json) and ``SAVE/latest`` naming the newest complete one.

A checkpoint is written under a temporary name, its manifest (every file with its size, and a
checksum of the small metadata files) last, then renamed; ``latest`` is replaced atomically
after that. A crash mid-save leaves the previous checkpoint as latest, and a checkpoint damaged
later (a missing or truncated file) is found by comparing with the manifest before loading.
DCP files carry no parallel layout, so any layout can load them. What a run saves and resumes
is ``manager.py``'s; how a model is read from them, ``weights.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchneox.base.errors import CheckpointWriteError, ConfigError
from torchneox.base.faults import fault_point
from torchneox.config.load import LoadedConfig, load_config
from torchneox.config.paths import free_space

FORMAT = "torchneox-checkpoint-2"  # 2: with manifest.json
CONFIG_FILE = "config.yml"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
NOT_A_CHECKPOINT = (
    "not a torchneox checkpoint (no meta.json, manifest or shards): give a save folder or one "
    "of its global_stepN folders"
)
CHECKSUMMED_BELOW = 1 << 20  # files smaller than this (metadata, config) get a sha256


def step_dir_name(iteration: int) -> str:
    return f"global_step{iteration}"


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_synced(tmp, text)
    os.replace(tmp, path)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _crc32(path: Path) -> int:
    """A content checksum of a (large) file, read in 8 MiB blocks: a flipped byte anywhere
    changes it, at a fraction of sha256's cost."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            value = zlib.crc32(block, value)
    return value


def write_manifest(step_dir: Path) -> None:
    """List every file of ``step_dir`` with its size and a content checksum (sha256 for small
    files, crc32 for large ones); written last."""
    files = {}
    for f in sorted(step_dir.rglob("*")):
        if f.is_file() and f.name != MANIFEST_FILE:
            entry: dict[str, Any] = {"size": f.stat().st_size}
            if entry["size"] < CHECKSUMMED_BELOW:
                entry["sha256"] = _sha256(f)
            else:
                entry["crc32"] = _crc32(f)
            files[str(f.relative_to(step_dir))] = entry
    _write_synced(step_dir / MANIFEST_FILE, json.dumps({"files": files}, indent=1))


def verify(step_dir: Path, content: bool = False) -> list[str]:
    """What is wrong with ``step_dir`` compared with its manifest, one line per file; [] if it
    is complete. Sizes and the checksums of small files are always checked (cheap: what loading
    does); ``content`` also reads every large file against its checksum (checkpoint verify).
    Checkpoints written before manifests existed are checked for their metadata."""
    step_dir = Path(step_dir)
    if not (step_dir / META_FILE).is_file():
        if not _holds_checkpoint_files(step_dir):
            return [f"{step_dir} is {NOT_A_CHECKPOINT}"]
        return [f"{step_dir / META_FILE} is missing: the save never finished"]
    try:
        fmt = read_meta(step_dir).get("format")
    except (OSError, ValueError):
        return [f"{step_dir / META_FILE} is unreadable or not JSON"]
    manifest = step_dir / MANIFEST_FILE
    if not manifest.is_file():
        if fmt == "torchneox-checkpoint-1":
            return (
                []
                if (step_dir / ".metadata").is_file()
                else [f"{step_dir / '.metadata'} is missing"]
            )
        return [f"{manifest} is missing: the save never finished"]
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return [f"{manifest} is unreadable or not a manifest"]
    problems = []
    for name, entry in files.items():
        f = step_dir / name
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != entry["size"]:
            problems.append(
                f"{f} has {f.stat().st_size} bytes, the manifest says {entry['size']} (truncated or replaced)"
            )
        elif ("sha256" in entry and _sha256(f) != entry["sha256"]) or (
            content and "crc32" in entry and _crc32(f) != entry["crc32"]
        ):
            problems.append(
                f"{f} does not match its checksum in the manifest (modified or corrupt)"
            )
    return problems


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The global_step directories under ``root``, oldest first."""
    found = []
    for p in Path(root).glob("global_step*"):
        number = p.name.removeprefix("global_step")
        if number.isdigit() and p.is_dir():
            found.append((int(number), p))
    return sorted(found)


def newest_complete(root: Path, before: int | None = None) -> Path | None:
    """The newest step directory under ``root`` (older than ``before``) that verifies."""
    for number, p in reversed(step_dirs(root)):
        if (before is None or number < before) and not verify(p):
            return p
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    save_dir: str | Path,
    iteration: int,
    state: dict[str, Any],
    config_yaml: str,
    meta: dict[str, Any] | None = None,
    writer: Any = None,
) -> Path:
    """Write ``state`` (nested dicts of tensors, DTensors included) as global_step{iteration} and
    point latest at it. Collective when a process group exists: every rank writes its shards,
    rank 0 the config, the metadata and the rename. ``writer(state, tmp)``: what writes the
    shards (``dcp.save`` by default; the asynchronous path hands its finished write here)."""
    root = Path(save_dir)
    final = root / step_dir_name(iteration)
    tmp = root / f".{final.name}.partial"
    try:
        _save(root, final, tmp, iteration, state, config_yaml, meta, writer)
    except (OSError, CheckpointException) as e:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        error = CheckpointWriteError(write_failure(root, final, e))
        error.reason = os_reason(_first_failure(e))
        raise error from None
    return final


def _dcp_save(state: dict[str, Any], tmp: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when no process group is initialised
        dcp.save(state, checkpoint_id=str(tmp))


def os_reason(error: BaseException) -> str:
    """Why a write failed, in a few words: the operating system's reason (and file) where the
    error or one it was raised from carries one, else the error's last line."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror + (f" ({seen.filename})" if seen.filename else "")
        seen = seen.__cause__ or seen.__context__
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


def _first_failure(error: BaseException) -> BaseException:
    """DCP's error gathers each rank's: the first of them; any other error, itself."""
    if not isinstance(error, CheckpointException):
        return error
    first = next(iter(error.failures.values()))
    return first[0] if isinstance(first, tuple) else first


def write_failure(root: Path, final: Path, error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        ranks = sorted(error.failures)
        what = f"on rank {', '.join(map(str, ranks))}: {os_reason(_first_failure(error))}"
    else:
        what = os_reason(error)
    free = free_space(root)
    kept = read_latest(root)
    last = (
        f"{root / kept} is still the latest checkpoint" if kept else "no earlier checkpoint exists"
    )
    return (
        f"saving {final} failed {what} ({free}); {last}. Free space or fix the directory's "
        "permissions, then rerun the same command to resume"
    )


def _save(
    root: Path,
    final: Path,
    tmp: Path,
    iteration: int,
    state: dict[str, Any],
    config_yaml: str,
    meta: dict[str, Any] | None,
    writer: Any = None,
) -> None:
    fault_point("save.start", iteration)
    if writer is None:  # the asynchronous path made the directory when its write began
        prepare_partial(root, tmp)
    (writer or _dcp_save)(state, tmp)
    fault_point("save.shards", iteration)
    if _rank() == 0:
        _write_synced(tmp / CONFIG_FILE, config_yaml)
        info = {"format": FORMAT, "iteration": iteration, **(meta or {})}
        if dist.is_initialized():
            info["world_size"] = dist.get_world_size()
        _write_synced(tmp / META_FILE, json.dumps(info, indent=2))
        fault_point("save.meta", iteration)
        write_manifest(tmp)
        _sync_dir(tmp)
        fault_point("save.manifest", iteration)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _sync_dir(root)
        fault_point("save.renamed", iteration)
        _write_atomic(root / "latest", final.name + "\n")
        _sync_dir(root)
    _barrier()


def prepare_partial(root: Path, tmp: Path) -> None:
    """The empty directory a save writes into before its rename (collective)."""
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()


def read_latest(root: Path) -> str | None:
    """The step directory ``root/latest`` names (None: there is no such file); bytes that are
    not text read as replacement characters, so a damaged pointer names no directory (and is
    said to) instead of failing to decode."""
    latest = Path(root) / "latest"
    if not latest.is_file():
        return None
    return latest.read_bytes().decode("utf-8", errors="replace").strip()


def ensure_writable(root: Path) -> None:
    """Fail at start-up, not at the first save, when checkpoints cannot be written to ``root``."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{root} is not a writable directory ({e.strerror or e}); choose another or fix its "
            "permissions",
            key="save",
        ) from None


def _holds_checkpoint_files(step_dir: Path) -> bool:
    """Whether anything of a checkpoint is there: a save cut short leaves some of these."""
    names = (MANIFEST_FILE, CONFIG_FILE, ".metadata")
    return any((step_dir / n).exists() for n in names) or any(step_dir.glob("*.distcp"))


def resolve(path: str | Path, step: int | None = None) -> Path:
    """The global_step directory meant by ``path`` (a save directory or a step directory),
    checked against its manifest. When it is incomplete or damaged, the error names the file
    and, where one exists, the newest older checkpoint that is complete."""
    p = Path(path)
    if p.is_file():
        raise ConfigError(
            "is a file; a checkpoint is a folder (a save folder or one of its global_stepN)",
            source=str(p),
        )
    if not p.is_dir():
        raise ConfigError("no such checkpoint directory", source=str(p))
    root = p
    if step is not None:
        target = p / step_dir_name(step)
    elif (p / META_FILE).is_file() or p.name.startswith("global_step"):
        target, root = p, p.parent
    elif (p / "latest").is_file():
        name = read_latest(p) or ""
        if not name:
            raise ConfigError(f"{p / 'latest'} is empty{_older_offer(p, None)}", source=str(p))
        target = p / name
        if not target.is_dir():
            raise ConfigError(
                f"{p / 'latest'} names {name!r}, which does not exist{_older_offer(p, None)}",
                source=str(p),
            )
    else:
        raise ConfigError(
            "not a torchneox checkpoint (no 'latest' and no meta.json)", source=str(p)
        )
    if not target.is_dir():
        raise ConfigError(f"{target.name} does not exist{_older_offer(root, step)}", source=str(p))
    problems = verify(target)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        number = target.name.removeprefix("global_step")
        before = int(number) if number.isdigit() else None
        raise ConfigError(f"{problems[0]}{more}{_older_offer(root, before)}", source=str(target))
    return target


def _older_offer(root: Path, before: int | None) -> str:
    older = newest_complete(root, before)
    if older is None:
        return "; no older complete checkpoint is there"
    number = older.name.removeprefix("global_step")
    return (
        f"; the newest complete checkpoint before it is {older}: give that directory instead "
        f"(train resumes from it with --load-step {number})"
    )


def read_meta(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / META_FILE).read_text())


def checkpoint_config(step_dir: Path, overrides: list[str] | None = None) -> LoadedConfig:
    return load_config([step_dir / CONFIG_FILE], overrides or [])


def load_state(step_dir: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` (same structure as saved, tensors preallocated) in place."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(step_dir))


MODEL_GROUPS = ("model", "moe")
"""The key groups that shape the model's tensors."""


def changed_model_keys(step_dir: Path, config_yaml: str) -> list[str]:
    """The model keys whose values differ between ``step_dir``'s config and ``config_yaml``
    (both resolved, as a run writes them), each shown as ``key (then -> now)``; empty when
    either cannot be read."""
    import yaml

    from torchneox.config.schema import KEYS

    try:
        saved = yaml.safe_load((step_dir / CONFIG_FILE).read_text())
        current = yaml.safe_load(config_yaml)
    except (OSError, ValueError, yaml.YAMLError):
        return []
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return []
    changed = []
    for name, spec in KEYS.items():
        if spec.group not in MODEL_GROUPS:
            continue
        then, now = saved.get(name, spec.default), current.get(name, spec.default)
        if then != now:
            changed.append(f"{name} ({_shown(then)} -> {_shown(now)})")
    return changed


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


BASE_SHAPES = "mup_base_shapes"
"""meta.json's record of muP's base_shapes_file: its path and sha256."""


def base_shapes_record(config_yaml: str) -> dict[str, str] | None:
    """The path and sha256 of the base_shapes_file a muP run (``config_yaml``, resolved) reads;
    None without muP, or while the file does not exist yet (save_base_shapes writes it)."""
    import yaml

    try:
        cfg = yaml.safe_load(config_yaml)
        path = Path(cfg["base_shapes_file"]) if cfg.get("use_mup") else None
        shapes = yaml.safe_load(path.read_text()) if path is not None else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError):
        return None
    if shapes is None:
        return None
    text = json.dumps(shapes, sort_keys=True, default=str)  # its content, not its layout
    return {"path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def numbered_optimizer_groups(step_dir: Path) -> bool:
    """Whether ``step_dir`` holds its optimizer state in torch's nested form (groups numbered),
    not keyed by parameter names (a pipeline run's: ``optim.builder.optimizer_state``)."""
    keys = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return "optimizer.param_groups.0.params" in keys  # (the flat form has no "params")
