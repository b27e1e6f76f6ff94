"""A streamed source resolved into its units: the pieces read whole and shuffled as one (a jsonl
or arrow file, a parquet row group), in a fixed order from which each epoch's order is drawn.

- a jsonl (plain, .gz, .zst), parquet or arrow file;
- a folder: every such file under it, by path;
- a Hugging Face ``datasets`` folder (save_to_disk): the arrow files its state.json lists; a
  DatasetDict folder: the split's own folder (train; validation or valid; test);
- ``hf://NAME[@CONFIG]``: the arrow files of a dataset in the local datasets cache
  ($HF_DATASETS_CACHE, else $HF_HOME/datasets, else ~/.cache/huggingface/datasets).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from torchneox.base.errors import DataError
from torchneox.config.features.streaming import HF_SCHEME, file_kind, source_kind

SPLIT_NAMES = {"train": ("train",), "valid": ("validation", "valid"), "test": ("test",)}


@dataclass(frozen=True)
class Unit:
    file: str
    kind: str  # jsonl | parquet | arrow
    group: int = 0  # a parquet row group
    first_row: int = 0  # a parquet row group's first row in its file (for messages)


@dataclass(frozen=True)
class Source:
    path: str  # as the config names it
    kind: str
    units: tuple[Unit, ...]


def need(module: str, path: str, what: str):
    """An optional dependency of a source, or one line saying which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise DataError(
            f"{path}: reading {what} needs {package} (pip install 'torchneox[stream]')"
        ) from None


def _file_units(path: str, kind: str) -> list[Unit]:
    if kind != "parquet":
        return [Unit(path, kind)]
    pq = need("pyarrow.parquet", path, "parquet")
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow's own errors: not a parquet file
        raise DataError(f"{path}: not a readable parquet file ({str(e)[:160]})") from None
    units, first = [], 0
    for g in range(meta.num_row_groups):
        units.append(Unit(path, kind, g, first))
        first += meta.row_group(g).num_rows
    return units


def _folder_files(path: str) -> list[str]:
    files = [
        str(f)
        for f in sorted(Path(path).rglob("*"))
        if f.is_file()
        and file_kind(f.name)
        and not any(p.startswith(".") for p in f.relative_to(path).parts)
    ]
    if not files:
        raise DataError(
            f"{path}: no .jsonl(.gz/.zst), .parquet or .arrow files in this folder to stream"
        )
    return files


def _split_folder(path: Path, split: str) -> Path:
    names = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
    for name in SPLIT_NAMES[split]:
        if name in names:
            return path / name
    raise DataError(
        f"{path}: this DatasetDict has the splits {', '.join(names)}, none of them "
        f"{' or '.join(SPLIT_NAMES[split])}; name a split's folder instead"
    )


def _datasets_folder(path: str, split: str) -> list[str]:
    folder = Path(path)
    if (folder / "dataset_dict.json").is_file():
        folder = _split_folder(folder, split)
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [str(folder / f["filename"]) for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"{folder}: not a datasets folder written by save_to_disk (no readable state.json)"
        ) from None
    return files


def cache_root() -> Path:
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"])
    home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    return Path(home) / "datasets"


def _cached(path: str, split: str) -> list[str]:
    """The arrow files of a dataset prepared in the local cache: NAME's folder (OWNER___NAME
    for OWNER/NAME), its config (the one given, else 'default', else the only one), its newest
    version and preparation."""
    name, _, config = path.removeprefix(HF_SCHEME).partition("@")
    root = cache_root() / name.replace("/", "___")
    if not root.is_dir():
        raise DataError(
            f"{path}: not in the local datasets cache ({root}); there is no network: prepare "
            "it once with datasets.load_dataset, or save_to_disk and name that folder"
        )
    configs = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    chosen = config or ("default" if "default" in configs else configs[0] if configs else "")
    if chosen not in configs or (not config and len(configs) > 1 and chosen != "default"):
        raise DataError(f"{path}: choose a config with {path}@CONFIG, one of {', '.join(configs)}")
    prepared = [p for p in (root / chosen).glob("*/*") if p.is_dir()]
    for folder in sorted(prepared, key=lambda p: p.stat().st_mtime, reverse=True):
        for want in SPLIT_NAMES[split]:
            files = sorted(folder.glob(f"*-{want}.arrow")) + sorted(
                folder.glob(f"*-{want}-*-of-*.arrow")
            )
            if files:
                return [str(f) for f in files]
    raise DataError(f"{path}: no {' or '.join(SPLIT_NAMES[split])} split in the cache ({root})")


def resolve(path: str, split: str) -> Source:
    """A streamed source's units in their fixed order; ``split`` chooses a DatasetDict's or a
    cached dataset's split."""
    kind = source_kind(path)
    if kind in ("jsonl", "parquet", "arrow"):
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file (nor {path}.bin/.idx)")
        files = [path]
    elif kind == "folder":
        files = _folder_files(path)
    elif kind == "datasets folder":
        files = _datasets_folder(path, split)
    else:
        files = _cached(path, split)
    units: list[Unit] = []
    for f in files:
        units += _file_units(f, file_kind(f) or "arrow")
    if not units:
        raise DataError(f"{path}: holds no data to stream")
    return Source(path, kind, tuple(units))
