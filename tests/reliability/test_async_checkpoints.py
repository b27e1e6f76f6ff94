"""async_checkpointing: a run that writes its checkpoints in the background (by the writer
process, the default, and by the writer thread) trains, saves and resumes bit for bit like one
that writes them in the step, on one process and on two; kill -9 while a write is in flight,
or while it is being finished, leaves the last finished checkpoint to resume from, as the
synchronous path does; the writer process writes the bytes ``dcp.save`` writes and dies with
its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.reliability.test_kills import (
    assert_bitwise_equal,
    config_for,
    env,
    run,
    run_with_kills,
)
from torchneox.checkpoint import files as checkpoint_format

ASYNC = {"async_checkpointing": True}
THREAD = ASYNC | {"async_checkpoint_writer": "thread"}


@pytest.mark.parametrize("keys", [ASYNC, THREAD], ids=["process", "thread"])
def test_background_saves_equal_saves_in_the_step(make_config, tmp_path, keys):
    for name, extra in (("whole", {}), ("background", keys)):
        cfg = config_for(make_config, tmp_path, name, **extra)
        assert run(cfg, 1, env()).returncode == 0
    assert_bitwise_equal(tmp_path / "background", tmp_path / "whole")
    for step in (2, 4, 6, 8, 10, 12):  # every save finished, each the state of its own step
        saved = tmp_path / "background" / f"global_step{step}"
        assert not checkpoint_format.verify(saved)
        assert checkpoint_format.read_meta(saved)["iteration"] == step
    assert not list((tmp_path / "background").glob(".*partial"))


@pytest.mark.parametrize("keys", [ASYNC, THREAD], ids=["process", "thread"])
def test_kill_9_while_a_background_save_is_in_flight(make_config, tmp_path, keys):
    whole = config_for(make_config, tmp_path, "whole")
    assert run(whole, 1, env()).returncode == 0
    killed = config_for(make_config, tmp_path, "killed", **keys)
    faults = [
        "kill@save.staged:2",  # the first save's files being written: nothing to resume
        "kill@step.start:3",  # the write may be done, but it was never finished
        "kill@save.shards:4",  # every file written, no metadata yet
        "kill@save.renamed:6",  # renamed, 'latest' not moved
        "kill@save.staged:8",  # global_step6 stays the latest
    ]
    kills = run_with_kills(killed, 1, faults, [])
    assert kills == len(faults)
    assert_bitwise_equal(tmp_path / "killed", tmp_path / "whole")


@pytest.mark.parametrize("keys", [ASYNC, THREAD], ids=["process", "thread"])
def test_two_processes_save_in_the_background(make_config, tmp_path, keys):
    zero3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}
    for name, extra in (("whole", zero3), ("background", zero3 | keys)):
        cfg = config_for(make_config, tmp_path, name, **extra)
        assert run(cfg, 2, env()).returncode == 0
    assert_bitwise_equal(tmp_path / "background", tmp_path / "whole")


def test_the_writer_process_writes_the_files_dcp_save_writes(tmp_path):
    from torchneox.checkpoint.writer import WriterProcess

    state = {
        "model": {"w": torch.randn(64, 32), "b": torch.randn(7).bfloat16()},
        "rng": {"torch": torch.get_rng_state()},
        "extra": {"step": 3, "name": "x"},  # objects are pickled, as dcp.save does
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    writer = WriterProcess()
    try:
        for attempt in ("first", "second"):  # the second reuses the staged buffers
            writer.start(state, str(tmp_path / attempt), None)
            writer.finish(None)
            shard = (tmp_path / attempt / "__0_0.distcp").read_bytes()
            assert shard == (tmp_path / "dcp" / "__0_0.distcp").read_bytes()
            written = state["model"]["w"].clone()
            state["model"]["w"] += 1  # a later step: the second write stages the new values
            back = {"model": {"w": torch.empty(64, 32), "b": torch.empty(7).bfloat16()}}
            dcp.load(back, checkpoint_id=str(tmp_path / attempt))
            assert torch.equal(back["model"]["w"], written)
            dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
            if attempt == "first":
                flat = writer.flat
        assert writer.flat is flat  # the same shapes: the same shared buffer
        assert len(writer.layout) == 3  # w, b and the RNG state; the objects go as bytes
    finally:
        writer.close()
    assert not writer.proc.is_alive()


def test_thousands_of_tensors_stage_in_one_shared_buffer(tmp_path):
    # a large model's optimizer has thousands of tensors; each in shared memory of its own
    # would hold a file descriptor, past the usual limit of 1024
    script = (
        "import resource, sys, torch\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torchneox.checkpoint.writer import WriterProcess\n"
        "if __name__ == '__main__':\n"
        "    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "    state = {'opt': {str(i): torch.full((3, i % 5), float(i)) for i in range(3000)}}\n"
        "    w = WriterProcess()\n"
        "    w.start(state, sys.argv[1], None)\n"
        "    w.finish(None)\n"
        "    w.close()\n"
        "    back = {'opt': {str(i): torch.zeros(3, i % 5) for i in range(3000)}}\n"
        "    dcp.load(back, checkpoint_id=sys.argv[1])\n"
        "    assert all(torch.equal(back['opt'][k], state['opt'][k]) for k in state['opt'])\n"
        "    print('ok')\n"
    )
    path = tmp_path / "many.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_writer_process_dies_with_its_parent(tmp_path):
    script = (
        "import time, sys\n"
        "from torchneox.checkpoint.writer import WriterProcess\n"
        "if __name__ == '__main__':\n"
        "    w = WriterProcess()\n"
        "    print(w.proc.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.time() + 30
    while time.time() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the writer outlived its killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_without_room_in_shared_memory_the_thread_writes(tmp_path, monkeypatch):
    from torchneox.checkpoint import background as async_checkpoint

    said = []
    saves = async_checkpoint.BackgroundSaves(tmp_path, "x: 1\n", said.append, "process")
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(
        async_checkpoint.os, "statvfs", lambda p: Full if p == "/dev/shm" else real(p)
    )
    state = {"model": {"w": torch.randn(256, 256)}}
    saves.start(2, state, {})
    assert saves.process is None and saves.finish(wait=True)
    assert "needs 0.00 GiB of shared memory (/dev/shm)" in said[0]
    assert "writing checkpoints with the writer thread instead" in said[0]
    assert (tmp_path / "latest").read_text() == "global_step2\n"
    saves.close()
