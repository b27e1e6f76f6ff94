"""The house rules, read from the source: every module on a floor, every import (lazy ones
inside functions too) pointing to its own floor or one below, nothing importing the CLI; no
import circle between files; no folder of more than MAX_MODULES modules of its own; and a
model that knows nothing of process groups, meshes or DTensors."""

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
    "reporting": 3,
    "checkpoint": 4,
    "optim": 4,
    "train": 5,
    "interop": 6,
    "estimate": 6,
    "cli": 7,
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


MAX_MODULES = 20


def module_name(path: Path, root: Path) -> str:
    """a.b for ROOT/a/b.py (a package's __init__.py is the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The torchneox modules ``path`` imports (lazy and type-checking imports too): for
    ``from P import N``, P.N where that is a module, else P."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in known else node.module)
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Each module of the package ``src`` and the modules of it that it imports."""
    paths = {module_name(p, src.parent): p for p in sorted(src.rglob("*.py"))}
    return {m: imported_modules(p, set(paths)) - {m} for m, p in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other round a circle (Tarjan's strongly
    connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_the_circle_rule_catches_a_lazy_circle(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.a import g\n")
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]


def crowded_folders(src: Path = SRC) -> list[str]:
    """Folders holding more than MAX_MODULES modules of their own (subfolders not counted)."""
    folders = {p.parent for p in src.rglob("*.py")}
    return sorted(
        f"{f.relative_to(src.parent)}: {n}"
        for f in folders
        if (n := len(list(f.glob("*.py")))) > MAX_MODULES
    )


def test_no_folder_over_the_module_limit(tmp_path: Path):
    assert crowded_folders() == []
    for i in range(MAX_MODULES + 1):
        (tmp_path / f"m{i}.py").write_text("")
    assert crowded_folders(tmp_path) == [f"{tmp_path.name}: {MAX_MODULES + 1}"]


def distributed_imports(path: Path) -> list[str]:
    """Every import of torch.distributed in the file (``from torch import distributed`` too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            found.append(f"line {node.lineno}")
    return found


def test_models_know_nothing_of_distribution(tmp_path: Path):
    wrong = {
        str(p.relative_to(SRC)): lines
        for p in sorted((SRC / "models").rglob("*.py"))
        if (lines := distributed_imports(p))
    }
    assert wrong == {}
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from torch import distributed\n    import torch.nn\n")
    assert distributed_imports(bad) == ["line 2"]
