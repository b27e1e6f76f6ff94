"""GPT-NeoX's own runs (golden/neox_runs), started in torchneox from their iteration-0
checkpoints: the loss of every iteration, warmup and the save at iteration 0 included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import shared_dir
from torchneox.cli import main

SHARED = shared_dir()
pytestmark = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
RUNS = SHARED / "golden" / "neox_runs" if SHARED else None


def golden(run: str, name: str) -> dict:
    return json.loads((RUNS / run / "losses.json").read_text())[name]


def config_for(run: str, config: str, tmp_path: Path) -> Path:
    """The run's config as GPT-NeoX ran it, with its folders pointed here."""
    text = (RUNS / run / "configs" / config).read_text()
    for placeholder, path in {
        "<work>/data": RUNS / "data",
        f"<runs>/{run}/ckpt": tmp_path / "ckpt",
        "<work>/gelu_erf_control/ckpt": tmp_path / "ckpt",
        f"<work>/{run}/logs": tmp_path / "log",
        "<work>/gelu_erf_control/logs": tmp_path / "log",
    }.items():
        text = text.replace(placeholder, str(path))
    path = tmp_path / config
    path.write_text(text)
    return path


def train_from_iteration_0(run: str, config: str, tmp_path: Path) -> tuple[dict, list]:
    """Convert the run's global_step0 (weights, a never-stepped optimizer, data position, RNG)
    and train its config to the end; returns {iteration: lm_loss} and the evaluation losses."""
    cfg = config_for(run, config, tmp_path)
    args = ["convert", "from-gpt-neox", str(RUNS / run / "ckpt"), str(tmp_path / "ckpt")]
    assert main([*args, "--step", "0", "--with-optimizer", "--config", str(cfg)]) == 0
    assert main(["train", str(cfg), "--set", "tensorboard_dir=null"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}
    evals = [r[k] for r in rows for k in ("valid_lm_loss", "test_lm_loss") if k in r]
    return losses, evals


def assert_losses_equal(ours: dict, theirs: list, rel: float) -> None:
    assert sorted(ours) == [r["iteration"] for r in theirs] == list(range(1, 21))
    for r in theirs:
        assert ours[r["iteration"]] == pytest.approx(r["lm_loss"], rel=rel), r["iteration"]


def test_tanh_gelu_run_gives_gpt_neox_losses_from_iteration_0(tmp_path):
    """bias_gelu_fusion: true (every Pythia config): GPT-NeoX computed the tanh gelu; warmup's
    first update uses peak / warmup (GPT-NeoX #1379); the checkpoint at iteration 0
    (extra_save_iters [0]) leaves the training unchanged."""
    ours, evals = train_from_iteration_0("gelu_tanh_pp1", "gelu_tanh_pp1.yml", tmp_path)
    run = golden("gelu_tanh_pp1", "gelu_tanh_pp1")
    assert_losses_equal(ours, run["train"], rel=1e-6)
    assert evals == pytest.approx([e["lm_loss"] for e in run["eval"]], rel=1e-6)
    # the exact gelu's run is further away than the tolerance: the test can tell them apart
    control = golden("gelu_tanh_pp1", "control_erf_gelu")["train"]
    assert max(abs(ours[r["iteration"]] / r["lm_loss"] - 1) for r in control) > 1e-6


def test_exact_gelu_control_run_gives_gpt_neox_losses(tmp_path):
    ours, _ = train_from_iteration_0("gelu_tanh_pp1", "control_erf_gelu.yml", tmp_path)
    assert_losses_equal(ours, golden("gelu_tanh_pp1", "control_erf_gelu")["train"], rel=1e-6)
