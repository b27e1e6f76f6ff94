"""The run's guards: a loss spike rewound past its batches, silent data corruption caught by
running a step twice, and a straggler named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import losses
from torchneox.base import faults
from torchneox.base.errors import ConfigError, TrainingStopped
from torchneox.config.keys.guards import GuardConfig
from torchneox.config.load import load_config
from torchneox.train.guards import SpikeGuard
from torchneox.train.trainer import Trainer


def test_a_spike_is_rewound_and_its_batches_skipped(make_config, tmp_path, monkeypatch, capsys):
    """A spike at step 6 (the loss and gradients x 1000) rewinds to step 4's checkpoint and
    skips the batches of steps 5 and 6: the later steps equal those of a run whose data lacked
    those two batches, bit for bit; the corruption check (at steps 4 and 8) changes nothing."""
    monkeypatch.setattr(faults, "_fired", set())
    monkeypatch.setenv(faults.ENV, "spike@step.backward:6")
    keys = {"train_iters": 8, "checkpoint_factor": 4}
    guarded = make_config(
        "guarded.yml",
        **keys,
        spike_action="rewind",
        spike_window=3,
        spike_threshold=10.0,
        sdc_check_interval=4,
    )
    trainer = Trainer(load_config([guarded]), device="cpu")
    trainer.run()
    said = capsys.readouterr().out
    assert "step 6: the loss " in said and "is a spike: above the mean" in said
    assert "skipping the 2 batch(es) of steps 5-6 (rewind 1 of 3; 2 batch(es) skipped" in said
    run = tmp_path / "run"
    got = losses(run), losses(run, "grad_norm")
    assert losses(run, "skipped_batches")[8] == 2 and losses(run, "rewinds")[8] == 1

    monkeypatch.delenv(faults.ENV)
    plain = make_config("plain.yml", **keys, save=None, load=None)
    reference = Trainer(load_config([plain]), device="cpu")
    want: tuple[dict, dict] = ({}, {})
    for step in range(1, 9):
        if step == 5:  # the data simply lacks the batches of steps 5 and 6
            consumed = reference.train_loader.consumed + 2 * reference.train_loader.global_batch
            reference.train_loader.load_state_dict({"consumed_samples": consumed})
        out = reference.train_step()
        want[0][step], want[1][step] = out["lm_loss"], out["grad_norm"]
    assert got == want
    for a, b in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert trainer.train_loader.consumed == reference.train_loader.consumed


def _stub_trainer(tmp_path: Path, latest: bool) -> SimpleNamespace:
    if latest:
        (tmp_path / "latest").write_text("global_step4")
    checkpoints = SimpleNamespace(
        save_dir=tmp_path, wait=lambda: None, last_good=lambda: "the last good checkpoint is X"
    )
    return SimpleNamespace(
        iteration=9, checkpoints=checkpoints, step=SimpleNamespace(settle=lambda: None)
    )


@pytest.mark.parametrize(
    ("latest", "bound", "said"),
    [
        (
            True,
            0,
            r"step 9: the gradient norm 50 is a spike: .* the 0 rewind\(s\) spike_max_rewinds",
        ),
        (False, 3, r"step 9: .*; no checkpoint to rewind to was saved yet"),
    ],
)
def test_a_rewind_past_its_bound_or_with_nothing_saved_stops(tmp_path, latest, bound, said):
    g = GuardConfig(
        spike_action="rewind", spike_signal="either", spike_window=3, spike_max_rewinds=bound
    )
    guard = SpikeGuard(g, print)
    for loss, norm in [(3.0, 1.0), (2.9, 1.2), (2.8, 0.9)]:
        assert not guard.check(None, {"lm_loss": loss, "grad_norm": norm})
    assert guard.spike({"lm_loss": 2.8, "grad_norm": 1.1}) is None  # no spike: joins the window
    with pytest.raises(TrainingStopped, match=said):
        guard.check(_stub_trainer(tmp_path, latest), {"lm_loss": 2.7, "grad_norm": 50.0})


def test_guard_keys_that_cannot_work_are_refused(make_config):
    with pytest.raises(ConfigError, match=r"spike_action.*rewind reloads the last checkpoint"):
        load_config([make_config(spike_action="rewind", save=None, load=None)])
    with pytest.raises(ConfigError, match="straggler_factor"):
        load_config([make_config(straggler_factor=1.0)])


def test_a_flipped_bit_is_caught_naming_its_rank_and_a_straggler_is_named(make_config, tmp_path):
    """Two processes under ZeRO-3: rank 1 sleeps a second at step 2's start (named at the
    step-2 log row), and one bit of its gradient flips at step 4, a checked step: the run stops
    there in one line naming rank 1, and nothing of step 4 is saved."""
    cfg = make_config(
        train_iters=6,
        train_micro_batch_size_per_gpu=2,
        zero_optimization={"stage": 3},
        checkpoint_factor=2,
        log_interval=2,
        sdc_check_interval=2,
        straggler_factor=1.2,
    )
    faults_spec = "slow@step.start:2:1,flip@step.backward:4:1"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHNEOX_FAULT=faults_spec)
    run = subprocess.run(
        [sys.executable, "-m", "torchneox", "train", cfg, "--nproc", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    line = (
        "torchneox: error: step 4: silent data corruption: rank 1 computed other gradients when "
        "the step's forward and backward ran again on the same batch"
    )
    assert run.stderr.count(line) == 1, run.stderr
    assert "nothing of step 4 saved (the last good checkpoint is" in run.stderr
    assert "step 2: straggler: rank 1 took" in run.stdout
    assert "straggler: rank 0" not in run.stdout
    save = tmp_path / "run"
    assert (save / "latest").read_text().strip() == "global_step2"
    assert not any("step4" in p.name for p in save.iterdir())
