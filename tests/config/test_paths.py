"""config/paths.py's helpers where several ranks of one run call them at once."""

from pathlib import Path

from torchneox.config.paths import remove_if_empty


def test_an_empty_folder_another_rank_removes_first_is_not_an_error(tmp_path, monkeypatch):
    """Two ranks of a refused run both remove the save folder they made: the one that finds
    it gone while it looks inside says it was removed, and raises nothing."""
    folder = tmp_path / "r"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "empty").touch()
    walk = Path.rglob

    def racing(self, pattern):
        for path in walk(self, pattern):
            if folder.exists():
                import shutil

                shutil.rmtree(folder)  # the other rank, between two steps of the walk
            yield path

    monkeypatch.setattr(Path, "rglob", racing)
    assert remove_if_empty(folder) is True
    assert not folder.exists()


def test_a_folder_holding_bytes_is_kept(tmp_path):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "f").write_bytes(b"x")
    assert remove_if_empty(folder) is False and (folder / "f").exists()
    assert remove_if_empty(tmp_path / "absent") is False
