"""docs/architecture.md is true to the code: every path its tree names exists, every package
it puts on a floor is on that floor in the import rule, and every floor of the rule is drawn."""

from __future__ import annotations

import re
from pathlib import Path

from tests.house.test_floors import FLOORS

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
FILE = re.compile(r"(?<![\w/.])([\w/]+\.py|\w+/[\w/]+\.yml)\b")


def blocks() -> list[list[str]]:
    return [b.splitlines() for b in re.findall(r"```\n(.*?)```", DOC.read_text(), re.S)]


def tree_paths() -> list[tuple[str, Path]]:
    """(as written, where it should be) for every file the layout tree names."""
    tree = next(b for b in blocks() if b and b[0].startswith("src/torchneox/"))
    found, top, package = [], REPO / "src/torchneox", REPO / "src/torchneox"
    for line in tree:
        indent = len(line) - len(line.lstrip())
        first = line.split()[0] if line.split() else ""
        if indent == 0 and first.endswith("/"):
            top = package = REPO / first
        elif indent == 2 and first.endswith("/") and top == REPO / "src/torchneox":
            package = top / first
        elif indent <= 2:
            package = top
        for name in FILE.findall(line):
            found.append((name, package / name))
    return found


def test_every_path_in_the_layout_exists():
    paths = tree_paths()
    assert len(paths) > 60  # the tree is read, not skipped
    missing = [
        name
        for name, where in paths
        if not where.exists()
        and not (REPO / name).exists()
        and not (REPO / "src/torchneox" / name).exists()
    ]
    assert missing == []


def test_every_module_is_in_the_layout():
    named = {where.resolve() for _, where in tree_paths()}
    src = REPO / "src/torchneox"
    modules = [p for p in src.rglob("*.py") if p.name != "__init__.py" or p.parent == src]
    assert sorted(str(p.relative_to(src)) for p in modules if p.resolve() not in named) == []


def test_the_floors_drawn_are_the_floors_held():
    drawing = next(b for b in blocks() if any(line.startswith("floor 6") for line in b))
    drawn = {}
    for line in drawing:
        words = line.split()
        if words[:1] == ["floor"]:
            for word in words[2:]:
                if not word.endswith("/"):
                    break
                drawn[word.rstrip("/")] = int(words[1])
    assert drawn == FLOORS
