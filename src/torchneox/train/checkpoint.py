"""Checkpoints: ``SAVE/global_step{N}/`` (torch distributed checkpoint + config.yml + meta.json)
and ``SAVE/latest`` naming the newest complete one.

A checkpoint is written under a temporary name and renamed only when complete, and ``latest``
is replaced atomically after that: a crash mid-save leaves the previous checkpoint as latest.
DCP files carry no parallel layout, so any layout can load them.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchneox.config.errors import ConfigError
from torchneox.config.load import LoadedConfig, load_config

FORMAT = "torchneox-checkpoint-1"
CONFIG_FILE = "config.yml"
META_FILE = "meta.json"


def step_dir_name(iteration: int) -> str:
    return f"global_step{iteration}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
) -> Path:
    """Write ``state`` (nested dicts of tensors, DTensors included) as global_step{iteration} and
    point latest at it. Collective when a process group exists: every rank writes its shards,
    rank 0 the config, the metadata and the rename."""
    root = Path(save_dir)
    final = root / step_dir_name(iteration)
    tmp = root / f".{final.name}.partial"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when no process group is initialised
        dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        (tmp / CONFIG_FILE).write_text(config_yaml)
        info = {"format": FORMAT, "iteration": iteration, **(meta or {})}
        if dist.is_initialized():
            info["world_size"] = dist.get_world_size()
        (tmp / META_FILE).write_text(json.dumps(info, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / "latest", final.name + "\n")
    _barrier()
    return final


def resolve(path: str | Path, step: int | None = None) -> Path:
    """The global_step directory meant by ``path`` (a save directory or a step directory)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError("no such checkpoint directory", source=str(p))
    if step is not None:
        target = p / step_dir_name(step)
    elif (p / META_FILE).is_file():
        return p
    elif (p / "latest").is_file():
        target = p / (p / "latest").read_text().strip()
    else:
        raise ConfigError(
            "not a torchneox checkpoint (no 'latest' and no meta.json)", source=str(p)
        )
    if not (target / META_FILE).is_file():
        raise ConfigError(f"{target.name} is missing or incomplete", source=str(p))
    return target


def read_meta(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / META_FILE).read_text())


def checkpoint_config(step_dir: Path, overrides: list[str] | None = None) -> LoadedConfig:
    return load_config([step_dir / CONFIG_FILE], overrides or [])


def load_state(step_dir: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` (same structure as saved, tensors preallocated) in place."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(step_dir))


def load_model_weights(step_dir: Path, model: torch.nn.Module) -> None:
    sd = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in sd.items()}
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    for key, shape in expected.items():
        entry = metadata.state_dict_metadata.get(f"model.{key}")
        if entry is None:
            raise ConfigError(f"the checkpoint has no tensor {key}", source=str(step_dir))
        if tuple(entry.size) != shape:
            raise ConfigError(
                f"tensor {key} has shape {tuple(entry.size)} in the checkpoint but {shape} in the "
                "model the config describes",
                source=str(step_dir),
            )
    load_state(step_dir, {"model": sd})
    model.load_state_dict(sd)
