"""GPT-NeoX's own post-training runs (golden/neox_runs/post_training): SFT with label masks,
DPO and KTO against a frozen reference, and a reward model, each started in torchneox from the
same initial weights and data as GPT-NeoX's run and compared iteration by iteration: the loss
and every metric GPT-NeoX logged, and the evaluations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import shared_dir
from tests.helpers import metric_rows
from torchneox.cli import main

SHARED = shared_dir()
pytestmark = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
RUNS = SHARED / "golden" / "neox_runs" if SHARED else None
POST = RUNS / "post_training" if SHARED else None
NOT_METRICS = {
    "iteration",
    "elapsed_ms",
    "learning_rate",
    "lr_used_in_step",
    "lm_loss",
    "step",
    "where",
}
NOT_METRICS |= {"lm_loss_ppl"}


def golden(run: str) -> dict:
    return json.loads((POST / "losses.json").read_text())[run]


def config_for(run: str, tmp_path: Path) -> Path:
    """The run's config as GPT-NeoX ran it, its save, load and logs pointed into tmp_path."""
    values = _jsonish(POST / "configs" / f"{run}.yml", tmp_path)
    values |= {"save": str(tmp_path / "ckpt"), "load": str(tmp_path / "ckpt")}
    values |= {"log_dir": str(tmp_path / "log"), "tensorboard_dir": None}
    path = tmp_path / f"{run}.yml"
    path.write_text(json.dumps(values, indent=1))
    return path


def _jsonish(path: Path, tmp_path: Path) -> dict:
    """GPT-NeoX's config files are JSON with # comments."""
    text = path.read_text().replace("<runs>", str(RUNS)).replace("<work>", str(tmp_path))
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return json.loads("\n".join(lines))


def start_from(tmp_path: Path, source: str, step: int, config: Path) -> None:
    """GPT-NeoX's checkpoint converted as the run's ``load`` (weights; finetune starts at 0)."""
    ckpt = str(POST / source / "ckpt")
    args = ["convert", "from-gpt-neox", ckpt, str(tmp_path / "ckpt"), "--step", str(step)]
    assert main([*args, "--config", str(config)]) == 0


def assert_metrics_equal(ours: dict, theirs: dict, prefix: str = "", rel: float = 2e-5) -> None:
    keys = [k for k in theirs if k not in NOT_METRICS and not k.endswith("_printed")]
    assert keys, "the golden row has metrics"
    for key in keys:
        assert ours[prefix + key] == pytest.approx(theirs[key], rel=rel, abs=2e-6), key


def run_and_compare(
    run: str, tmp_path: Path, source: str = "init", step: int = 20, *extra: str
) -> None:
    cfg = config_for(run, tmp_path)
    init = cfg
    if source == "init":  # the initial checkpoint is converted with its own (pretraining) config
        init = tmp_path / "init.yml"
        values = _jsonish(POST / "configs" / "init_pretrain.yml", tmp_path)
        init.write_text(json.dumps(values | {"save": None, "load": None}))
    start_from(tmp_path, source, step, init)
    assert main(["train", str(cfg), *extra]) == 0
    rows = metric_rows(tmp_path / "log")
    train = {r["iteration"]: r for r in rows if "lm_loss" in r}
    expected = golden(run)
    assert sorted(train) == [r["iteration"] for r in expected["train"]]
    for theirs in expected["train"]:
        ours = train[theirs["iteration"]]
        assert ours["lm_loss"] == pytest.approx(theirs["lm_loss"], rel=2e-6), theirs["iteration"]
        if run != "sft":
            assert_metrics_equal(ours, theirs)
    evals = [r for r in rows if "valid_lm_loss" in r or "test_lm_loss" in r]
    assert len(evals) == len(expected["eval"]) == 3
    for ours, theirs in zip(evals, expected["eval"], strict=True):
        prefix = "test_" if theirs["where"].startswith("test") else "valid_"
        assert ours[prefix + "lm_loss"] == pytest.approx(theirs["lm_loss"], rel=2e-6)
        if run != "sft":
            assert_metrics_equal(ours, theirs, prefix)


def test_sft_with_label_masks_gives_gpt_neox_losses(tmp_path):
    run_and_compare("sft", tmp_path)


def test_dpo_gives_gpt_neox_losses_and_rewards(tmp_path):
    """Iteration 1: policy = reference, so the loss is ln 2 and every reward 0. The rewards
    reach TensorBoard as lm_loss does."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_and_compare("dpo", tmp_path, "init", 20, "--set", f"tensorboard_dir={tmp_path / 'tb'}")
    first = next(r for r in metric_rows(tmp_path / "log") if r.get("iteration") == 1)
    assert first["lm_loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert first["chosen_rewards"] == first["rejected_rewards"] == 0.0
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm_loss", "chosen_rewards", "reward_acc", "valid_margins"} <= tags
    margins = [e.value for e in events.Scalars("margins")]
    assert margins[-1] == pytest.approx(golden("dpo")["train"][-1]["margins"], rel=1e-4)


def test_kto_gives_gpt_neox_losses_and_metrics(tmp_path):
    run_and_compare("kto", tmp_path)


def test_reward_model_gives_gpt_neox_losses_from_its_iteration_0(tmp_path):
    """GPT-NeoX's global_step0 holds the trunk and its freshly initialised rm_linear head."""
    run_and_compare("rm", tmp_path, source="rm", step=0)
