"""Checkpoints: ``SAVE/global_step{N}/`` (torch distributed checkpoint + config.yml + meta.json
+ manifest.json) and ``SAVE/latest`` naming the newest complete one.

A checkpoint is written under a temporary name, its manifest (every file with its size, and a
checksum of the small metadata files) last, then renamed; ``latest`` is replaced atomically
after that. A crash mid-save leaves the previous checkpoint as latest, and a checkpoint damaged
later (a missing or truncated file) is found by comparing with the manifest before loading.
DCP files carry no parallel layout, so any layout can load them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from torchneox.base.errors import CheckpointWriteError, ConfigError, TrainingStopped
from torchneox.base.faults import fault_point
from torchneox.config.load import LoadedConfig, load_config
from torchneox.models.args import model_args
from torchneox.models.transformer import Transformer
from torchneox.train.optim import load_optimizer_state

FORMAT = "torchneox-checkpoint-2"  # 2: with manifest.json
CONFIG_FILE = "config.yml"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
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
        raise CheckpointWriteError(write_failure(root, final, e)) from None
    return final


def _dcp_save(state: dict[str, Any], tmp: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when no process group is initialised
        dcp.save(state, checkpoint_id=str(tmp))


def write_failure(root: Path, final: Path, error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        ranks = sorted(error.failures)
        first = next(iter(error.failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        what = f"on rank {', '.join(map(str, ranks))}: {str(first).strip().splitlines()[-1]}"
    else:
        what = f"{error.strerror or error}" + (f" ({error.filename})" if error.filename else "")
    try:
        free = f"{shutil.disk_usage(root).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = "free space unknown"
    kept = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
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


def resolve(path: str | Path, step: int | None = None) -> Path:
    """The global_step directory meant by ``path`` (a save directory or a step directory),
    checked against its manifest. When it is incomplete or damaged, the error names the file
    and, where one exists, the newest older checkpoint that is complete."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError("no such checkpoint directory", source=str(p))
    root = p
    if step is not None:
        target = p / step_dir_name(step)
    elif (p / META_FILE).is_file() or p.name.startswith("global_step"):
        target, root = p, p.parent
    elif (p / "latest").is_file():
        name = (p / "latest").read_text().strip()
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
        f"; the newest complete checkpoint before it is {older}: resume from it with "
        f"--load-step {number} (or give that directory)"
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


FRESH_HEADS = ("value_head.weight",)
"""Weights a model may start without: a reward model's head, from a language model's
checkpoint (GPT-NeoX loads it non-strictly: rm_linear keeps its initialisation)."""


def missing_heads(step_dir: Path, prefix: str = "model") -> frozenset[str]:
    """The fresh heads ``step_dir`` does not hold: what a model loading it must initialise."""
    held = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return frozenset(k for k in FRESH_HEADS if f"{prefix}.{k}" not in held)


def load_model_weights(step_dir: Path, model: torch.nn.Module, prefix: str = "model") -> list[str]:
    """Load the checkpoint's ``prefix`` weights into ``model``; returns the fresh heads the
    checkpoint did not have (they keep their initialisation)."""
    sd = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in sd.items()}
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    fresh = []
    for key, shape in expected.items():
        entry = metadata.state_dict_metadata.get(f"{prefix}.{key}")
        if entry is None and key in FRESH_HEADS:
            fresh.append(key)
            continue
        if entry is None:
            raise ConfigError(f"the checkpoint has no tensor {key}", source=str(step_dir))
        if tuple(entry.size) != shape:
            raise ConfigError(
                f"tensor {key} has shape {tuple(entry.size)} in the checkpoint but {shape} in the "
                "model the config describes",
                source=str(step_dir),
            )
    wanted = {k: v for k, v in sd.items() if k not in fresh}
    load_state(step_dir, {prefix: wanted})
    model.load_state_dict(wanted, strict=not fresh)
    return fresh


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``source``'s parameters into ``target``, a model of the same shape split the same way
    (either may be wrapped for activation checkpointing or compiled)."""

    def plain_name(name: str) -> str:
        return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")

    theirs = {plain_name(n): p for n, p in target.named_parameters()}
    for name, param in source.named_parameters():
        theirs[plain_name(name)].copy_(param)


def load_model(
    ckpt: str | Path,
    overrides: list[str] | None = None,
    device: str = "cpu",
    step: int | None = None,
    stored_dtype: bool = False,
) -> tuple[LoadedConfig, Transformer]:
    """The model a checkpoint holds (its step, or the latest), on ``device``, with its config
    (``overrides`` applied): the one way every verb turns a checkpoint into a model. Its
    parameters are fp32, or with ``stored_dtype`` the dtype the checkpoint keeps them in (a
    bf16 model converted from the hub is then one bf16 copy in memory, not an fp32 one)."""
    step_dir = resolve(ckpt, step)
    loaded = checkpoint_config(step_dir, overrides)
    dtype = _stored_dtype(step_dir) if stored_dtype else torch.float32
    # nothing drawn but the heads the checkpoint lacks: every other weight is read from it
    with torch.device("meta"):
        model = Transformer(model_args(loaded)).to(dtype)
    model.to_empty(device=device)
    model.init_weights(device, only=missing_heads(step_dir))
    load_model_weights(step_dir, model)
    return loaded, model


def _stored_dtype(step_dir: Path) -> torch.dtype:
    """The one floating dtype of the checkpoint's model tensors (fp32 when they mix)."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    dtypes = {
        getattr(entry, "properties", None) and entry.properties.dtype
        for name, entry in metadata.state_dict_metadata.items()
        if name.startswith("model.")
    }
    return dtypes.pop() if len(dtypes) == 1 and None not in dtypes else torch.float32


# ------------------------------------------------------------------------- the manager


def save_iterations(ck: Any, train_iters: int) -> set[int]:
    """GPT-NeoX's checkpoint steps: multiples (linear) or powers (log) of checkpoint_factor,
    extra_save_iters, and the last step (``ck``: the checkpoint config group)."""
    steps = {train_iters}
    factor = ck.checkpoint_factor
    if factor:
        if ck.checkpoint_scale == "linear":
            steps |= set(range(factor, train_iters + 1, factor))
        else:
            power = 1
            while power <= train_iters:
                steps.add(power)
                power *= factor
    steps |= set(ck.extra_save_iters or [])
    return steps


@dataclass
class TrainingState:
    """What a checkpoint saves and a resume restores, besides the config."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any  # LossScaler: state_dict / load_state_dict
    loaders: dict[str, Any]  # name -> BatchLoader (train, and valid when there is one)
    reference: torch.nn.Module | None = None  # DPO's and KTO's frozen reference model


@dataclass
class Resumed:
    """Where a resume left the run."""

    step_dir: Path
    iteration: int
    training_state: bool  # False: weights only (finetune, or a converted checkpoint)
    reference: bool = False  # the reference model's weights were loaded


class CheckpointManager:
    """Saves, rotates and resumes one run's checkpoints (built from the checkpoint config
    group): GPT-NeoX's save steps, keep_last_n_checkpoints, no_save/no_load of optimizer and
    RNG, finetune, and the last good checkpoint that failure messages name."""

    def __init__(
        self, ck: Any, train_iters: int, config_yaml: str, is_rank0: bool, line: Any
    ) -> None:
        self.ck, self.config_yaml, self.is_rank0, self.line = ck, config_yaml, is_rank0, line
        self.save_dir = Path(ck.save) if ck.save else None
        if self.save_dir is not None:
            ensure_writable(self.save_dir)
        self.save_at = save_iterations(ck, train_iters)
        self.background = None
        if self.save_dir is not None and ck.async_checkpointing:
            from torchneox.train.async_checkpoint import BackgroundSaves

            self.background = BackgroundSaves(
                self.save_dir, config_yaml, line, ck.async_checkpoint_writer
            )

    def last_good(self) -> str:
        latest = self.save_dir / "latest" if self.save_dir is not None else None
        if latest is not None and latest.is_file():
            return f"the last good checkpoint is {self.save_dir / latest.read_text().strip()}"
        return "no checkpoint was saved yet"

    def save(self, iteration: int, state: TrainingState) -> Path | None:
        """Save ``state`` at ``iteration`` (a failed write stops the run, the previous
        checkpoint kept), then drop what keep_last_n_checkpoints no longer keeps."""
        if self.save_dir is None:
            return None
        ck = self.ck
        tensors: dict[str, Any] = {"model": get_model_state_dict(state.model)}
        # an optimizer that never stepped has no state to save; asking torch for its state
        # dict would create it with a zero-rate step counted (Adam's bias correction would
        # then be one step off for the rest of the run), so saving never changes training
        if not ck.no_save_optim and state.optimizer.state:
            tensors["optimizer"] = get_optimizer_state_dict(state.model, state.optimizer)
        if not ck.no_save_rng:
            tensors["rng"] = {"torch": torch.get_rng_state()}
        if state.reference is not None:
            tensors["reference"] = get_model_state_dict(state.reference)
        meta = {
            "loaders": {name: loader.state_dict() for name, loader in state.loaders.items()},
            "loss_scaler": state.scaler.state_dict(),
            "has_optimizer": "optimizer" in tensors,
            "has_rng": "rng" in tensors,
            "has_reference": "reference" in tensors,
        }
        if self.background is not None:  # async_checkpointing: finished at a later step
            self.background.start(iteration, tensors, meta)
            return None
        try:
            path = save_checkpoint(self.save_dir, iteration, tensors, self.config_yaml, meta)
        except CheckpointWriteError as e:
            raise TrainingStopped(str(e)) from None
        self._rotate()
        return path

    def poll(self) -> None:
        """Finish a background save whose files every rank has written (at a step boundary)."""
        if self.background is not None and self.background.finish(wait=False):
            self._rotate()

    def finish(self) -> None:
        """Wait for a background save and finish it (before the run ends)."""
        if self.background is not None:
            if self.background.finish(wait=True):
                self._rotate()
            self.background.close()

    def _rotate(self) -> None:
        keep = self.ck.keep_last_n_checkpoints
        if not keep or self.save_dir is None or not self.is_rank0:
            return
        for _, path in step_dirs(self.save_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def find(self, load_dir: Path, step: int | None) -> Path | None:
        """The checkpoint a resume from ``load_dir`` loads (its ``step``, or the newest
        complete one); None when there is none yet (the run starts from scratch)."""
        if step is None and not (load_dir / "latest").is_file():
            # a save killed between its rename and moving 'latest' leaves a complete directory
            newest = newest_complete(load_dir) if load_dir.is_dir() else None
            if newest is None:
                self.line(f"no checkpoint in {load_dir}: starting from scratch")
                return None
            step = int(newest.name.removeprefix("global_step"))
        return resolve(load_dir, step)

    def resume(self, step_dir: Path, state: TrainingState) -> Resumed:
        """Load the checkpoint ``step_dir`` into ``state``: the weights always; the optimizer,
        RNG, data position and loss scale unless finetune (or a weights-only checkpoint) or
        the no_load keys say otherwise."""
        ck = self.ck
        meta = read_meta(step_dir)
        for key in load_model_weights(step_dir, state.model):
            self.line(f"{step_dir} has no {key}: it starts from its initialisation")
        if ck.finetune or "loaders" not in meta:
            why = (
                "finetune is set"
                if ck.finetune
                else f"it holds weights only ({meta.get('converted_from') or 'no training state'})"
            )
            self.line(
                f"starting at step 0 from the weights of {step_dir}, with a fresh optimizer: {why}"
            )
            return Resumed(step_dir, 0, training_state=False)
        reference = self._load_training_state(step_dir, meta, state)
        return Resumed(step_dir, int(meta["iteration"]), True, reference)

    def _load_training_state(self, step_dir: Path, meta: dict, state: TrainingState) -> bool:
        """Whether the reference model's weights were loaded too."""
        ck, loaded_reference = self.ck, False
        tensors: dict[str, Any] = {}
        if not ck.no_load_optim and meta.get("has_optimizer", False):
            tensors["optimizer"] = get_optimizer_state_dict(state.model, state.optimizer)
        if not ck.no_load_rng and meta.get("has_rng", False):
            tensors["rng"] = {"torch": torch.get_rng_state()}
        if tensors:
            load_state(step_dir, tensors)
        if "optimizer" in tensors:
            load_optimizer_state(state.model, state.optimizer, tensors["optimizer"])
        if "rng" in tensors:
            torch.set_rng_state(tensors["rng"]["torch"])
        if state.reference is not None and meta.get("has_reference", False):
            load_model_weights(step_dir, state.reference, prefix="reference")
            loaded_reference = True
        for name, loader in state.loaders.items():
            if name in meta["loaders"]:
                loader.load_state_dict(meta["loaders"][name])
        if "loss_scaler" in meta:
            state.scaler.load_state_dict(meta["loss_scaler"])
        return loaded_reference
