"""The house rules, read from the source: every module on a floor, every import (lazy ones
inside functions too) pointing to its own floor or one below, nothing importing the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchneox

SRC = Path(torchneox.__file__).parent
FLOORS = {
    "base": 0,
    "config": 1,
    "models": 2,
    "data": 2,
    "parallel": 3,
    "inference": 3,
    "train": 4,
    "interop": 5,
    "estimate": 5,
    "cli": 6,
}
ROOT_MODULES = {"__init__.py", "__main__.py"}


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def package_of(path: Path) -> str:
    return path.relative_to(SRC).parts[0]


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, first package below torchneox) for every torchneox import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            names = [node.module]
            if node.module == "torchneox":  # a package, or a name of the root (__version__)
                names = [f"torchneox.{a.name}" for a in node.names if a.name in FLOORS]
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("torchneox.")]
    return found


def test_no_module_at_the_package_root():
    loose = sorted(p.name for p in SRC.glob("*.py") if p.name not in ROOT_MODULES)
    assert loose == [], f"modules at the package root, on no floor: {loose}"


def test_every_package_has_a_floor():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(FLOORS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path):
    if path.parent == SRC:
        return  # __init__ / __main__ sit outside the floors
    own = package_of(path)
    wrong = [
        f"line {line}: {own} (floor {FLOORS[own]}) imports {pkg} (floor {FLOORS[pkg]})"
        for line, pkg in imported_packages(path)
        if FLOORS[pkg] > FLOORS[own] or (pkg == "cli" and own != "cli")
    ]
    assert wrong == []


def test_the_rule_catches_an_upward_import(tmp_path: Path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from torchneox.parallel.expert_parallel import dispatch\n")
    assert imported_packages(bad) == [(2, "parallel")]


MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def long_functions(path: Path) -> list[str]:
    """Functions longer than MAX_FUNCTION_LINES, except the argparse tables (functions that
    only add parsers and arguments)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES and not _argparse_table(node):
            found.append(f"{node.name} ({length} lines)")
    return found


def _argparse_table(node: ast.FunctionDef) -> bool:
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    names = {c.func.attr for c in calls if isinstance(c.func, ast.Attribute)}
    return bool(names) and names <= {
        "add_parser",
        "add_argument",
        "add_subparsers",
        "add_mutually_exclusive_group",
        "add_argument_group",
    }


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_modules_and_functions_read_in_one_sitting(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{lines} lines"
    assert long_functions(path) == []


def test_the_length_rule_catches_a_long_function(tmp_path: Path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}")
    (tmp_path / "table.py").write_text(
        "def verbs(p):\n" + "".join(f"    p.add_argument('--a{i}')\n" for i in range(70))
    )
    assert long_functions(tmp_path / "long.py") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(tmp_path / "table.py") == []
