"""The built-in demo corpus, shipped with the package.

``pydocs`` is the docstrings of Python 3.11's pure-Python standard-library modules (PSF
licence), cut into 754 documents of at most 4 KiB; ``tools/make_pydocs_corpus.py`` made it
once. It is frozen: every machine reads the same bytes whatever Python it runs, so ``make demo``
trains on the same tokens everywhere and needs no download.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from collections.abc import Iterator
from pathlib import Path

from torchneox.base.errors import DataError

FOLDER = Path(__file__).resolve().parent / "corpora"
CORPORA = {
    "pydocs": (
        "docstrings of Python 3.11's standard library, 754 documents (frozen)",
        "pydocs.jsonl.xz",
        "79be29d24f8f3ca1404a49ff91c9eac22c0367473f3307ebcf15c55fec379804",
    )
}


def _lines(name: str) -> list[str]:
    if name not in CORPORA:
        raise DataError(f"no built-in corpus {name!r}; there is: {', '.join(CORPORA)}")
    _, file, sha256 = CORPORA[name]
    path = FOLDER / file
    try:
        packed = path.read_bytes()
    except OSError as e:
        raise DataError(
            f"{path}: the built-in corpus is missing ({e.strerror}); reinstall torchneox"
        ) from None
    if hashlib.sha256(packed).hexdigest() != sha256:
        raise DataError(
            f"{path}: the built-in corpus is damaged (checksum differs); reinstall torchneox"
        )
    return lzma.decompress(packed).decode("utf-8").splitlines()


def documents(name: str, max_bytes: int | None = None) -> Iterator[str]:
    """The corpus's documents in their fixed order; stops once ``max_bytes`` of text is out."""
    total = 0
    for line in _lines(name):
        text = json.loads(line)["text"]
        yield text
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            return


def write_jsonl(name: str, path: Path, max_bytes: int | None = None) -> int:
    """The corpus as jsonl ({"text": ...} per line), for preprocess; returns the document count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents(name, max_bytes):
            f.write(json.dumps({"text": doc}) + "\n")
            count += 1
    return count
