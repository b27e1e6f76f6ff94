"""Shared fixtures: where the read-only reference files (../shared) are, when present."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path | None:
    """../shared beside the checkout (or $TORCHNEOX_SHARED); None on a machine without it."""
    candidate = Path(os.environ.get("TORCHNEOX_SHARED", REPO.parent / "shared"))
    return candidate if candidate.is_dir() else None


@pytest.fixture
def shared() -> Path:
    path = shared_dir()
    if path is None:
        pytest.skip("the reference files in ../shared are not on this machine")
    return path


@pytest.fixture
def write(tmp_path: Path):
    """write('name.yml', text) -> path of a file in a fresh temporary folder."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return _write
