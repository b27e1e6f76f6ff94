"""Faults while training: non-finite losses and gradients, a rank that hangs, bad data, and an
interrupted preprocess."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.helpers import metric_rows
from tests.helpers import poison as _poison
from torchneox.base.errors import TrainingStopped
from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.data.indexed import IndexedDataset, IndexedDatasetWriter, paths
from torchneox.train.trainer import Trainer


def params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_skip_nonfinite_steps_skips_and_counts_then_stops(make_config, tmp_path):
    cfg = make_config(train_iters=6, skip_nonfinite_steps=2, save=str(tmp_path / "s"))
    trainer = Trainer(load_config([cfg]), device="cpu")
    _poison(trainer, 2, float("nan"))  # a NaN loss
    trainer.train_step()
    before = params(trainer)
    out = trainer.train_step()
    assert out["skipped"] == 1.0 and trainer.scaler.skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(params(trainer), before, strict=True))
    # an Inf gradient at step 4 (the loss is finite)
    weight = trainer.model.layers["0"].mlp.up.weight
    hook = weight.register_hook(lambda g: g * float("inf") if trainer.iteration == 3 else g)
    trainer.train_step()
    out = trainer.train_step()
    hook.remove()
    assert out["skipped"] == 1.0 and trainer.scaler.skipped == 2
    assert trainer.iteration == 4
    _poison(trainer, 5, float("inf"))  # a third: the allowance is used up
    with pytest.raises(TrainingStopped, match=r"step 5: .*skips allowed by skip_nonfinite_steps"):
        trainer.train_step()


def test_skipped_steps_reach_the_metrics(make_config, tmp_path):
    cfg = make_config(train_iters=3, skip_nonfinite_steps=1, save=str(tmp_path / "m"), load=None)
    trainer = Trainer(load_config([cfg]), device="cpu")
    _poison(trainer, 2, float("nan"))
    trainer.run()
    rows = metric_rows(tmp_path / "m")
    skipped = {r["iteration"]: r["skipped_steps"] for r in rows if "skipped_steps" in r}
    assert skipped == {1: 0, 2: 1, 3: 1}


def test_a_rank_that_hangs_ends_the_run_within_the_timeout(make_config, tmp_path):
    cfg = make_config(
        train_iters=6,
        train_micro_batch_size_per_gpu=2,
        distributed_timeout_minutes=0.1,  # 6 seconds
        save=str(tmp_path / "h"),
        load=str(tmp_path / "h"),
        checkpoint_factor=2,
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHNEOX_FAULT="stop@step.start:3:1")
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "torchneox", "train", cfg, "--nproc", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    seconds = time.perf_counter() - start
    assert run.returncode != 0
    assert "rank 0: a collective did not complete at step 3" in run.stderr
    assert "distributed_timeout_minutes is 0.1" in run.stderr
    assert f"the last good checkpoint is {tmp_path / 'h' / 'global_step2'}" in run.stderr
    # the launcher names the rank that failed first, and stops the frozen one without waiting
    # out its grace period (SIGCONT after SIGTERM)
    assert "torchneox: error: rank 0 exited with 1; its output is above" in run.stderr
    assert seconds < 200
    # what rank 0 was waiting in, from torch's flight recorder, kept beside the checkpoints
    record = tmp_path / "h" / "flight_recorder" / "rank0.json"
    assert f"(flight record: {record})" in run.stderr
    last = json.loads(record.read_text())["entries"][-1]
    assert last["profiling_name"].startswith("gloo:")
    said = f"the last collective it entered: {last['profiling_name']} #{last['collective_seq_id']} "
    assert said + f"of process group {last['process_group'][1]}" in run.stderr


# ------------------------------------------------------------------------------- bad data


def _truncate_bin(prefix) -> str:
    bin_path, _ = paths(prefix)
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 10)
    return f"{bin_path}"


def _idx_from_another_dataset(prefix, other) -> str:
    _, idx = paths(prefix)
    idx.write_bytes(paths(other)[1].read_bytes())
    return str(paths(prefix)[0])


@pytest.fixture
def corpus(tmp_path, tiny_data):
    """A private copy of the tiny dataset, to damage."""
    prefix = tmp_path / "corpus"
    for src, dst in zip(paths(tiny_data), paths(prefix), strict=True):
        dst.write_bytes(src.read_bytes())
    return prefix


@pytest.mark.parametrize("fault", ["truncated-bin", "idx-of-another-dataset", "empty-split"])
def test_bad_data_is_refused_before_the_first_step(make_config, tmp_path, capsys, corpus, fault):
    extra = {}
    if fault == "truncated-bin":
        named = _truncate_bin(corpus)
    elif fault == "idx-of-another-dataset":
        other = IndexedDatasetWriter(tmp_path / "other", np.dtype(np.uint16))
        for n in range(50):
            other.add_document(np.arange(n + 5) % 200)
        other.finish()
        named = _idx_from_another_dataset(corpus, tmp_path / "other")
    else:
        extra = {"split": "0,50,50"}  # nothing to train on
        named = str(corpus)
    capsys.readouterr()
    cfg = make_config(data_path=str(corpus), save=str(tmp_path / "r"), load=None, **extra)
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
    assert (
        not (tmp_path / "r" / "metrics.jsonl").exists()
        or not (tmp_path / "r" / "metrics.jsonl").read_text()
    )


def test_an_evaluation_split_without_documents_is_skipped_as_gpt_neox_skips_it(
    make_config, tmp_path, capsys
):
    few = IndexedDatasetWriter(tmp_path / "few", np.dtype(np.uint16))
    for n in range(3):
        few.add_document(np.arange(200) % 90 + n)
    few.finish()  # 3 documents: the 8% validation split and the 2% test split get none
    cfg = make_config(
        data_path=str(tmp_path / "few"), save=str(tmp_path / "r"), load=None, split="90,8,2"
    )
    capsys.readouterr()
    assert main(["train", cfg]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "none of the 3 documents" in line]
    assert notes == [
        f"{tmp_path / 'few'}: split '90,8,2' gives the {name} split none of the 3 documents; "
        f"{name} is not evaluated (as in GPT-NeoX)"
        for name in ("valid", "test")
    ]
    rows = metric_rows(tmp_path / "r")
    assert rows[-1]["iteration"] == 6 and "lm_loss" in rows[-1]
    assert not any("valid_lm_loss" in r or "test_lm_loss" in r for r in rows)


# ------------------------------------------------------------------------ preprocess killed


def test_killed_preprocess_never_leaves_a_pair_that_loads(tmp_path):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(tmp_path / "big.jsonl", "w") as f:
        for _ in range(60000):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=60))}) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "torchneox",
        "preprocess",
        "--input",
        str(tmp_path / "big.jsonl"),
        "--tokenizer-type",
        "CharLevelTokenizer",
        "--append-eod",
    ]
    start = time.perf_counter()
    subprocess.run([*cmd, "--output-prefix", str(tmp_path / "whole")], check=True, timeout=300)
    seconds = time.perf_counter() - start
    (whole,) = [p for p in tmp_path.glob("whole*.idx")]
    reference = IndexedDataset(str(whole)[:-4])
    for i, fraction in enumerate([0.3, 0.6, 0.8, 0.95]):
        out = tmp_path / f"k{i}"
        out.mkdir()
        proc = subprocess.Popen(
            [*cmd, "--output-prefix", str(out / "data")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(fraction * seconds)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for idx in out.glob("*.idx"):  # only a finished pair may be there, and it is whole
            ds = IndexedDataset(str(idx)[:-4])
            assert len(ds) == len(reference)
            assert np.array_equal(ds.sizes, reference.sizes)


def test_a_run_whose_stdout_goes_away_saves_and_fails(make_config, tmp_path):
    """`torchneox train c.yml | head -1`: the pipe closes after the first line. The run must not
    end as a success with nothing saved: it saves at the end of the step and exits non-zero."""
    cfg = make_config(train_iters=200, save=str(tmp_path / "r"), load=str(tmp_path / "r"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchneox", "train", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    while b"step 2/" not in proc.stdout.readline():
        pass
    proc.stdout.close()  # as `| head` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1, err
    lines = [x for x in err.splitlines() if x.startswith("torchneox: error:")]
    assert len(lines) == 1 and "standard output went away" in lines[0], err
    assert "Traceback" not in err
    latest = (tmp_path / "r" / "latest").read_text().strip()
    step = int(latest.removeprefix("global_step"))
    assert 2 <= step < 200 and f"step {step} is saved" in lines[0]
    # and the run resumes from there
    resumed = Trainer(load_config([cfg]), device="cpu")
    assert resumed.iteration == step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_preprocess_removes_its_partial_files(tmp_path, monkeypatch, capsys, sig):
    """Stopped halfway (Ctrl-C, `kill`, a scheduler's SIGTERM): no dataset, no *.partial-PID."""
    from torchneox.data import preprocess as module

    lines = "".join(json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(400))
    (tmp_path / "in.jsonl").write_text(lines)
    read_lines = module.read_lines

    def signalled_halfway(inputs):
        for number, line in enumerate(read_lines(inputs)):
            if number == 200:
                os.kill(os.getpid(), sig)  # delivered to this (the main) thread
            yield line

    monkeypatch.setattr(module, "read_lines", signalled_halfway)
    seen = []  # were SIGTERM not handled, record it rather than end the test process
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append(a))
    # Ctrl-C as in a terminal's process (an xdist worker ignores SIGINT)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status = main(
            ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
             str(tmp_path / "out" / "d"), "--tokenizer-type", "CharLevelTokenizer"]
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    assert status == 130 and "torchneox: interrupted" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_a_later_preprocess_removes_what_a_killed_one_left(tmp_path):
    """kill -9 cannot be caught: the next preprocess to the same output removes the partial
    files of writers no longer running (and leaves those of one still running)."""
    out = tmp_path / "out"
    prefix = out / "d_text_document"
    script = (
        "import os, numpy as np\n"
        "from torchneox.data.indexed import IndexedDatasetWriter\n"
        f"w = IndexedDatasetWriter({str(prefix)!r}, np.uint16)\n"
        "w.add_document([1, 2, 3])\n"
        "w._bin.flush()\n"
        "os.kill(os.getpid(), 9)\n"
    )
    killed = subprocess.run([sys.executable, "-c", script], check=False, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    (left,) = [p.name for p in out.iterdir()]  # what the killed writer left
    assert left.startswith("d_text_document.bin.partial-")
    alive = out / f"d_text_document.bin.partial-{os.getppid()}"  # a writer still running
    alive.write_bytes(b"")
    (tmp_path / "in.txt").write_text("one document\nand another\n")
    argv = ["preprocess", "--input", str(tmp_path / "in.txt"), "--output-prefix", str(out / "d")]
    assert main([*argv, "--tokenizer-type", "CharLevelTokenizer"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "d_text_document.bin",
        f"d_text_document.bin.partial-{os.getppid()}",
        "d_text_document.idx",
    ]
