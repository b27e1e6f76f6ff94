"""The built-in demo corpus: English prose that every Python installation carries.

``pydocs`` is the docstrings of the standard library's pure-Python modules, one document per
module (its docstring and those of its classes and functions, in source order). It needs no
download, so ``make demo`` can train on real text on a fresh machine. It is a demo corpus:
its content depends on the Python version, and it is small (a few MB).
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from torchneox.data.indexed import DataError

SKIP = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
}
CORPORA = {"pydocs": "docstrings of the Python standard library, one document per module"}


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return ""
    parts = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                parts.append(doc.strip())
    return "\n\n".join(dict.fromkeys(parts))


def documents(name: str, max_bytes: int | None = None) -> Iterator[str]:
    if name not in CORPORA:
        raise DataError(f"no built-in corpus {name!r}; there is: {', '.join(CORPORA)}")
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if SKIP & set(path.relative_to(root).parts):
            continue
        text = _docstrings(path)
        if not text:
            continue
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
