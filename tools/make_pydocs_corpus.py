"""Writes src/torchneox/data/corpora/pydocs.jsonl.xz, the frozen built-in demo corpus.

The corpus is the docstrings of the standard library's pure-Python modules (PSF licence), one
module's docstrings cut into documents of at most MAX_CHARS at paragraph breaks. It was made
once, with Python 3.11, and is shipped as it is, so that every machine trains the demo on the
same tokens whatever its own standard library holds. Rerunning this on another Python gives
another corpus: do so only to replace the shipped one on purpose.
"""

from __future__ import annotations

import ast
import json
import lzma
import sys
import sysconfig
from pathlib import Path

SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}
MAX_CHARS = 4096
OUT = Path(__file__).resolve().parents[1] / "src/torchneox/data/corpora/pydocs.jsonl.xz"


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    found = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                found.append(doc.strip())
    return list(dict.fromkeys(found))


def chunks(paragraphs: list[str]) -> list[str]:
    out, current = [], ""
    for p in paragraphs:
        if current and len(current) + len(p) + 2 > MAX_CHARS:
            out.append(current)
            current = ""
        current = f"{current}\n\n{p}" if current else p
    return [*out, current] if current else out


def main() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for path in sorted(root.rglob("*.py")):
        if SKIP & set(path.relative_to(root).parts) or "__pycache__" in path.parts:
            continue
        for text in chunks(docstrings(path)):
            lines.append(json.dumps({"text": text}))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    OUT.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    print(f"{len(lines)} documents, {len(data):,} bytes (Python {sys.version.split()[0]}) -> {OUT}")


if __name__ == "__main__":
    main()
