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

from torchneox.checkpoint import files as checkpoint_format
from torchneox.cli import main


def two_checkpoints(make_config, tmp_path) -> tuple[str, object]:
    folder = tmp_path / "run"
    cfg = make_config(train_iters=4, checkpoint_factor=2, save=str(folder), load=str(folder))
    assert main(["train", cfg]) == 0
    assert (folder / "latest").read_text().strip() == "global_step4"
    return cfg, folder


def _train_with_small_files(cfg: str, limit: int) -> subprocess.CompletedProcess:
    """``train cfg`` in a process whose files cannot grow past ``limit`` bytes."""
    return subprocess.run(
        [sys.executable, "-m", "torchneox", "train", cfg],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        preexec_fn=_limit_file_size(limit),
        timeout=300,
        check=False,
    )


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
    run = _train_with_small_files(cfg, shard // 2)
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


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_background_save_that_cannot_be_written_is_one_line_and_leaves_no_partial(
    make_config, tmp_path, writer
):
    """The background writer used to end in an internal error with its partial folder left."""
    folder = tmp_path / "run"
    first = make_config(train_iters=2, checkpoint_factor=2, save=str(folder), load=str(folder))
    assert main(["train", first]) == 0
    shard = max(f.stat().st_size for f in (folder / "global_step2").glob("*.distcp"))
    keys = {"async_checkpointing": True, "async_checkpoint_writer": writer}
    cfg = make_config(
        train_iters=4, checkpoint_factor=2, save=str(folder), load=str(folder), **keys
    )
    run = _train_with_small_files(cfg, shard // 2)
    assert run.returncode == 1, run.stderr[-3000:]
    lines = [x for x in run.stderr.splitlines() if x.startswith("torchneox: error:")]
    assert len(lines) == 1 and "Traceback" not in run.stderr and "internal" not in run.stderr
    assert f"saving {folder / 'global_step4'} failed on rank 0: " in lines[0]
    assert "File too large" in lines[0]
    assert f"{folder / 'global_step2'} is still the latest checkpoint" in lines[0]
    assert (folder / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in folder.iterdir() if "global_step" in p.name) == ["global_step2"]
    assert not checkpoint_format.verify(folder / "global_step2", content=True)
    assert main(["train", cfg]) == 0  # space is back: the same command resumes and finishes
    assert (folder / "latest").read_text().strip() == "global_step4"


def test_a_full_disk_under_the_background_writer_process_is_one_line(
    make_config, tmp_path, capsys, monkeypatch
):
    folder = tmp_path / "run"
    cfg = make_config(train_iters=4, checkpoint_factor=2, save=str(folder), load=str(folder))
    assert main(["train", cfg]) == 0
    monkeypatch.setenv("TORCHNEOX_FAULT", "full@writer.write")  # the writer's next write
    capsys.readouterr()
    more = ["--set", "train_iters=6", "--set", "async_checkpointing=true"]
    assert main(["train", cfg, *more]) == 1
    err = capsys.readouterr().err
    assert err.count("torchneox: error:") == 1 and "internal" not in err, err
    assert f"saving {folder / 'global_step6'} failed on rank 0: No space left on device" in err
    assert f"{folder / 'global_step4'} is still the latest checkpoint" in err
    assert (folder / "latest").read_text().strip() == "global_step4"
    assert sorted(p.name for p in folder.iterdir() if "global_step" in p.name) == [
        "global_step2",
        "global_step4",
    ]


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


def _export_fixture(tmp_path):
    """A run with one checkpoint and an earlier export of it in ``hf`` (what --force would
    replace)."""
    from tests.reliability.test_paths import save_run, snapshot

    run = save_run(tmp_path / "run", steps=(2,))
    out = tmp_path / "hf"
    assert main(["convert", "to-hf", str(run), str(out)]) == 0
    return run, out, snapshot(run), snapshot(out)


def _assert_nothing_half_written(tmp_path, run, out, before_run, before_out, err):
    from tests.reliability.test_paths import snapshot

    assert err.count("\n") == 1 and err.startswith("torchneox: error: "), err
    assert "internal error" not in err
    assert f"{out}: writing it failed" in err and "MiB free there" in err
    assert "nothing was written" in err
    assert snapshot(run) == before_run and snapshot(out) == before_out  # both untouched
    assert not [p.name for p in tmp_path.iterdir() if "partial" in p.name or ".old-" in p.name]


def _main_with_small_files(argv: list[str], limit: int) -> int:
    """``main(argv)`` in this process with files limited to ``limit`` bytes (EFBIG past it:
    Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        return main(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_to_hf_past_a_file_size_limit_is_one_line(tmp_path, capsys):
    """A file-size limit (EFBIG; Python ignores SIGXFSZ) used to be an internal error."""
    run, out, before_run, before_out = _export_fixture(tmp_path)
    capsys.readouterr()
    status = _main_with_small_files(
        ["convert", "to-hf", str(run), str(out), "--force"], 100_000
    )  # the weights are ~500 kB
    err = capsys.readouterr().err
    assert status == 2
    assert "File too large" in err
    _assert_nothing_half_written(tmp_path, run, out, before_run, before_out, err)


def test_to_hf_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    run, out, before_run, before_out = _export_fixture(tmp_path)

    def full(*args, **kwargs):  # what safetensors raises when the disk fills
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    capsys.readouterr()
    assert main(["convert", "to-hf", str(run), str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err
    _assert_nothing_half_written(tmp_path, run, out, before_run, before_out, err)


def test_to_hf_fp16_refuses_weights_fp16_cannot_hold(tmp_path, capsys):
    """--dtype fp16 used to turn weights beyond 65504 into inf without a word."""
    import torch
    from safetensors.torch import load_file

    from tests.reliability.test_paths import save_run
    from torchneox.checkpoint.weights import load_model

    run = save_run(tmp_path / "run", steps=(2,))
    _, model = load_model(run)
    state = model.state_dict()
    state["layers.1.mlp.down.weight"][0, 0] = -1.5e5
    yaml_text = (run / "global_step2" / "config.yml").read_text()
    checkpoint_format.save_checkpoint(run, 4, {"model": state}, yaml_text)
    capsys.readouterr()
    out = tmp_path / "hf16"
    assert main(["convert", "to-hf", str(run), str(out), "--dtype", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err, err
    assert "layers.1.mlp.dense_4h_to_h.weight" in err and "150000" in err, err
    assert "65504" in err and "--dtype bf16" in err and str(run / "global_step4") in err
    assert not out.exists() and not list(tmp_path.glob(".hf16*"))
    assert main(["convert", "to-hf", str(run), str(out), "--dtype", "bf16"]) == 0
    weights = load_file(out / "model.safetensors")
    assert all(torch.isfinite(t.float()).all() for t in weights.values())
    assert main(["convert", "to-hf", str(run / "global_step2"), str(tmp_path / "ok16"),
                 "--dtype", "fp16"]) == 0  # fmt: skip


def test_from_hf_past_a_file_size_limit_is_one_line(tmp_path, capsys):
    """from-hf writes a checkpoint; its failed save used to escape as an internal error."""
    from tests.reliability.test_paths import snapshot

    _, hf, _, before_hf = _export_fixture(tmp_path)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "kept.txt").write_text("what --force would replace")
    capsys.readouterr()
    status = _main_with_small_files(
        ["convert", "from-hf", str(hf), str(out), "--force"], 100_000
    )  # the weights are ~500 kB
    err = capsys.readouterr().err
    assert status == 2, err
    assert "File too large" in err
    _assert_nothing_half_written(
        tmp_path, hf, out, before_hf, {"kept.txt": b"what --force would replace"}, err
    )
    assert snapshot(hf) == before_hf


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


def test_a_folder_that_is_no_checkpoint_is_said_to_be_none(tmp_path, capsys):
    """verify, and every verb reading a checkpoint, on a folder with nothing of a checkpoint:
    one line saying it is not one (not that a save never finished), exit 2."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("hello")
    for argv in (
        ["checkpoint", "verify", str(folder)],
        ["generate", "--checkpoint", str(folder), "--prompt", "a"],
        ["convert", "to-hf", str(folder), str(tmp_path / "hf")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a torchneox checkpoint" in err, err
        assert "never finished" not in err


def test_a_damaged_checkpoint_offers_what_generate_takes(make_config, tmp_path, capsys):
    """generate has no --load-step: the offer names the complete directory to give it."""
    _, folder = two_checkpoints(make_config, tmp_path)
    damage_no_manifest(folder / "global_step4")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert f"the newest complete checkpoint before it is {folder / 'global_step2'}: give " in err
    assert "train resumes from it with --load-step 2" in err


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00junk", b""])
def test_latest_holding_bytes_or_nothing_is_one_line(make_config, tmp_path, capsys, pointer):
    """A damaged `latest` (not text, or empty) is named, and the complete checkpoint offered:
    it was an internal error decoding it."""
    cfg, folder = two_checkpoints(make_config, tmp_path)
    (folder / "latest").write_bytes(pointer)
    capsys.readouterr()
    assert main(["train", cfg, "--set", "train_iters=6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err, err
    assert str(folder / "latest") in err and "--load-step 4" in err
    assert main(["checkpoint", "verify", str(folder)]) == 1
    assert "(missing or damaged)" in capsys.readouterr().out


def test_a_file_given_as_a_checkpoint_is_said_to_be_a_file(tmp_path, capsys):
    path = tmp_path / "reward.py"
    path.write_text("def f(): ...\n")
    assert main(["generate", "--checkpoint", str(path), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: is a file; a checkpoint is a folder" in err and err.count("\n") == 1
