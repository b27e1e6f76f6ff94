"""Saves that fail (a full disk, an unwritable directory) and checkpoints damaged afterwards
(a missing shard, a truncated file, changed metadata, 'latest' pointing nowhere): a clear error
naming the file, the previous checkpoint kept, and an older complete one offered."""

from __future__ import annotations

import io
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

from torchneox.cli import main
from torchneox.train import checkpoint_format


def two_checkpoints(make_config, tmp_path) -> tuple[str, object]:
    folder = tmp_path / "run"
    cfg = make_config(train_iters=4, checkpoint_factor=2, save=str(folder), load=str(folder))
    assert main(["train", cfg]) == 0
    assert (folder / "latest").read_text().strip() == "global_step4"
    return cfg, folder


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_save_that_cannot_be_written_keeps_the_previous_checkpoint(make_config, tmp_path):
    folder = tmp_path / "run"
    first = make_config(train_iters=2, checkpoint_factor=2, save=str(folder), load=str(folder))
    assert main(["train", first]) == 0
    shard = max(f.stat().st_size for f in (folder / "global_step2").glob("*.distcp"))
    # resume to step 4 with files limited to a fraction of a shard: the real save code fails
    # writing its shards as it would on a full disk
    cfg = make_config(train_iters=4, checkpoint_factor=2, save=str(folder), load=str(folder))
    run = subprocess.run(
        [sys.executable, "-m", "torchneox", "train", cfg],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        preexec_fn=_limit_file_size(shard // 2),
        timeout=300,
        check=False,
    )
    assert run.returncode == 1
    lines = [x for x in run.stderr.splitlines() if x.startswith("torchneox: error:")]
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert f"saving {folder / 'global_step4'} failed" in lines[0]
    assert f"{folder / 'global_step2'} is still the latest checkpoint" in lines[0]
    assert "MiB free there" in lines[0]
    assert (folder / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in folder.iterdir() if "global_step" in p.name) == ["global_step2"]
    assert not checkpoint_format.verify(folder / "global_step2")
    assert main(["train", cfg]) == 0  # space is back: the same command resumes and finishes
    assert (folder / "latest").read_text().strip() == "global_step4"


def test_an_unwritable_save_directory_is_refused_before_training(make_config, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = make_config(save=str(blocker / "run"), load=None)
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err
    assert f"save: {blocker / 'run'} is not a writable directory" in err
    assert err.count("\n") == 1


def damage_missing_shard(step):
    next(iter(step.glob("*.distcp"))).unlink()
    return "is missing"


def damage_truncated_shard(step):
    shard = next(iter(step.glob("*.distcp")))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 3)
    return "the manifest says"


def damage_metadata(step):
    data = bytearray((step / ".metadata").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step / ".metadata").write_bytes(bytes(data))
    return "does not match its checksum"


def damage_no_manifest(step):
    (step / "manifest.json").unlink()
    return "manifest.json is missing"


@pytest.mark.parametrize(
    "damage", [damage_missing_shard, damage_truncated_shard, damage_metadata, damage_no_manifest]
)
def test_a_damaged_checkpoint_is_named_and_the_older_one_offered(
    make_config, tmp_path, capsys, damage
):
    cfg, folder = two_checkpoints(make_config, tmp_path)
    what = damage(folder / "global_step4")
    capsys.readouterr()
    assert main(["train", cfg, "--set", "train_iters=6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and what in err
    assert str(folder / "global_step4") in err
    assert f"the newest complete checkpoint before it is {folder / 'global_step2'}" in err
    assert "--load-step 2" in err
    # `checkpoint verify` says the same, and fails
    assert main(["checkpoint", "verify", str(folder)]) == 1
    out = capsys.readouterr().out
    assert f"{folder / 'global_step2'}: complete" in out and what in out
    # and the offered step resumes
    assert main(["train", cfg, "--set", "train_iters=6", "--load-step", "2"]) == 0


def test_latest_pointing_nowhere(make_config, tmp_path, capsys):
    cfg, folder = two_checkpoints(make_config, tmp_path)
    (folder / "latest").write_text("global_step9\n")
    capsys.readouterr()
    assert main(["train", cfg, "--set", "train_iters=6"]) == 2
    err = capsys.readouterr().err
    assert "names 'global_step9', which does not exist" in err
    assert "--load-step 4" in err  # the newest complete one
    assert main(["convert", "to-hf", str(folder), str(tmp_path / "hf")]) == 2  # same check


def test_verify_passes_complete_checkpoints(make_config, tmp_path, capsys):
    _, folder = two_checkpoints(make_config, tmp_path)
    assert main(["checkpoint", "verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.count(": complete") == 2 and "latest: global_step4" in out
    assert main(["checkpoint", "verify", str(folder / "global_step2")]) == 0


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_checkpoint_verify_finds_a_byte_flipped_anywhere(
    make_config, tmp_path, capsys, monkeypatch, where
):
    """Large shards are checksummed by content (crc32) too: a shard damaged in place, same size,
    used to pass verify and load NaN weights."""
    monkeypatch.setattr(
        checkpoint_format, "CHECKSUMMED_BELOW", 0
    )  # every file counts as large here
    _, folder = two_checkpoints(make_config, tmp_path)
    shard = max((folder / "global_step4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[min(int(where * len(data)), len(data) - 1)] ^= 0x01
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(folder)]) == 1
    out = capsys.readouterr().out
    assert f"{shard} does not match its checksum" in out
    assert f"{folder / 'global_step2'}: complete" in out


def _nan_over(step, name: str) -> None:
    """NaN float32 bytes over one model tensor's bytes in its shard, the file's size kept."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(step)).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == name]
    shard = step / info.relative_path
    data = bytearray(shard.read_bytes())
    record = bytes(data[info.offset : info.offset + info.length])
    raw = torch.load(io.BytesIO(record), weights_only=True).numpy().tobytes()
    at = info.offset + record.index(raw)  # the tensor's raw bytes inside its record
    data[at : at + len(raw)] = bytes.fromhex("0000c07f") * (len(raw) // 4)  # float32 NaN
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("verb", ["generate", "to-hf", "resume"])
def test_nan_bytes_over_a_weight_are_refused_on_load(
    make_config, tmp_path, capsys, monkeypatch, verb
):
    """A shard damaged in place with its size kept (too large for its checksum to be read on
    load) used to generate garbage with exit 0: every weight loaded is checked to be finite."""
    monkeypatch.setattr(checkpoint_format, "CHECKSUMMED_BELOW", 0)  # every shard counts as large
    folder = tmp_path / "run"
    cfg = make_config(train_iters=2, checkpoint_factor=2, save=str(folder), load=str(folder))
    assert main(["train", cfg]) == 0
    _nan_over(folder / "global_step2", "model.layers.1.mlp.up.weight")
    capsys.readouterr()
    argv = {
        "generate": ["generate", "--checkpoint", str(folder), "--prompt", "the", "--device", "cpu"],
        "to-hf": ["convert", "to-hf", str(folder), str(tmp_path / "hf")],
        "resume": ["train", cfg, "--set", "train_iters=4"],
    }[verb]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{folder / 'global_step2'}: tensor layers.1.mlp.up.weight holds NaN" in err, err
    assert not (tmp_path / "hf").exists()
