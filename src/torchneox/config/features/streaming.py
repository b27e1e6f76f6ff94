"""Raw text streamed while training runs: which of ``data_path`` and the train/valid/test path
lists name raw text (jsonl, parquet, arrow, a folder of them, a Hugging Face ``datasets``
folder or a dataset in the local datasets cache) rather than .bin/.idx prefixes; the checks of
the keys that go with them; what ``config explain`` says of each source.

Only the standard library here: a source is told by its name and, for a folder, by the files
in it (data/stream/ reads them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchneox.config.checker import Checker

SPLIT_PATH_KEYS = ("data_path", "train_data_paths", "valid_data_paths", "test_data_paths")
"""The keys whose paths may stream (labels, rewards and pairs are .bin/.idx only)."""

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
HF_SCHEME = "hf://"
"""A dataset in the local Hugging Face datasets cache: hf://NAME or hf://OWNER/NAME, with
``@CONFIG`` after it to choose one of several configs (no network: it must be there)."""

KINDS = {
    "jsonl": "jsonl, read line by line (one JSON object a line)",
    "parquet": "parquet, read by row group",
    "arrow": "arrow, read by record batch",
}


def file_kind(name: str) -> str | None:
    """'jsonl', 'parquet' or 'arrow' by a file's name; None for anything else."""
    low = name.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(".arrow"):
        return "arrow"
    return None


def source_kind(path: str) -> str:
    """What a data path names: 'indexed' (a .bin/.idx prefix), a file kind, 'folder',
    'datasets folder' (save_to_disk) or 'datasets cache' (hf://NAME)."""
    if path.startswith(HF_SCHEME):
        return "datasets cache"
    if os.path.isfile(f"{path}.idx") or os.path.isfile(f"{path}.bin"):
        return "indexed"
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if "state.json" in names or "dataset_dict.json" in names:
            return "datasets folder"
        return "folder"
    return file_kind(path) or "indexed"


def is_stream(path: str) -> bool:
    return source_kind(path) != "indexed"


def split_paths(d: Any, split: str) -> list[str]:
    """The paths of one split ('train', 'valid', 'test'); data_path's for each of them."""
    if d.data_path:
        return [d.data_path]
    return list(getattr(d, f"{split}_data_paths") or [])


def streams(d: Any) -> bool:
    """Whether any split of a data group reads a streamed source."""
    return any(is_stream(p) for s in ("train", "valid", "test") for p in split_paths(d, s))


def check_streaming(ch: Checker) -> None:
    c = ch.c
    d = c.data
    if not streams(d):
        return
    key = "data_path" if d.data_path else "train_data_paths"
    if d.dataset_impl != "gpt2":
        ch.fail(key, f"streamed raw text is read as dataset_impl gpt2, not {d.dataset_impl}")
    if d.pack_impl != "packed":
        ch.fail(key, f"streamed raw text is packed (pack_impl packed), not {d.pack_impl}")
    if c.training.train_impl not in ("normal",):
        ch.fail(
            key,
            f"streamed raw text trains train_impl normal; {c.training.train_impl} reads "
            ".bin/.idx datasets (preprocess them)",
        )
    labels = [
        f"{s}_{kind}_data_paths"
        for s in ("train", "valid", "test")
        for kind in ("label", "reward")
        if getattr(d, f"{s}_{kind}_data_paths")
    ]
    if labels:
        ch.fail(labels[0], "goes with .bin/.idx datasets; streamed raw text has no labels")
    if c.training.train_epochs is not None:
        ch.fail(
            "train_epochs",
            "counts the documents of a .bin/.idx dataset; with streamed raw text give train_iters",
        )
    if d.weight_by_num_documents:
        ch.fail(
            "weight_by_num_documents",
            "counts documents up front, which a stream does not; give train_data_weights",
        )
    if len(d.jsonl_keys) != 1:
        ch.fail("jsonl_keys", f"a stream reads one text field, got {len(d.jsonl_keys)}")


def describe(path: str, d: Any) -> str:
    """What a source is and how it is read, in one line (config explain)."""
    kind = source_kind(path)
    field = d.jsonl_keys[0] if d.jsonl_keys else "text"
    if kind == "indexed":
        return "a .bin/.idx dataset (GPT-NeoX's sample order), mixed with the streamed ones"
    if kind in KINDS:
        what = KINDS[kind]
        if path.endswith(".gz"):
            what += ", gzip"
        elif path.endswith(".zst"):
            what += ", zstd"
    elif kind == "folder":
        counts: dict[str, int] = {}
        for f in sorted(Path(path).rglob("*")):
            k = file_kind(f.name)
            if k and f.is_file():
                counts[k] = counts.get(k, 0) + 1
        what = "a folder of " + (
            ", ".join(f"{n} {k} file{'s' * (n != 1)}" for k, n in counts.items()) or "no files"
        )
    elif kind == "datasets folder":
        what = "a Hugging Face datasets folder (save_to_disk), its arrow files read by batch"
    else:
        what = "a dataset in the local Hugging Face datasets cache (no network), its arrow files"
    order = (
        f"files and row groups shuffled by the seed each epoch, documents in a buffer of "
        f"{d.stream_shuffle_buffer}"
        if d.stream_shuffle
        else "read in order (stream_shuffle false)"
    )
    bad = "bad records skipped and counted" if d.skip_bad_records else "a bad record stops it"
    return (
        f"streamed: {what}; text field {field!r}; tokenized as it trains (num_workers "
        f"{d.num_workers}), documents + EOD packed; {order}; {bad}"
    )
