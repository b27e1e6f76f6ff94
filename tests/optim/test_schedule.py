"""The learning-rate schedule against GPT-NeoX's formulas and its logged rates."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import shared_dir
from torchneox.optim.lr import Schedule


def test_formulas_at_chosen_steps():
    peak, low = 1e-3, 1e-4
    cos = Schedule(peak, low, warmup_iters=10, decay_iters=110, style="cosine")
    assert cos.lr_at(0) == pytest.approx(1e-4)  # GPT-NeoX #1379: max(1, step) / warmup
    assert cos.lr_at(5) == pytest.approx(5e-4)
    assert cos.lr_at(10) == pytest.approx(peak)
    assert cos.lr_at(60) == pytest.approx(low + (peak - low) / 2 * (math.cos(math.pi * 0.5) + 1))
    assert cos.lr_at(110) == pytest.approx(low)
    # past the end GPT-NeoX keeps evaluating the cosine (it climbs back), unless held
    assert cos.lr_at(160) == pytest.approx(low + (peak - low) / 2 * (math.cos(math.pi * 1.5) + 1))
    held = Schedule(peak, low, warmup_iters=10, decay_iters=110, style="cosine", hold=True)
    assert held.lr_at(160) == pytest.approx(low) and held.lr_at(500) == pytest.approx(low)
    lin = Schedule(peak, 0.0, warmup_iters=0, decay_iters=100, style="linear")
    assert lin.lr_at(25) == pytest.approx(0.75e-3)
    assert Schedule(peak, low, 0, 100, "linear").lr_at(99) == pytest.approx(low)  # min_lr floor
    exp = Schedule(peak, 0.0, warmup_iters=0, decay_iters=100, style="exponential")
    assert exp.lr_at(100) == pytest.approx(peak * math.exp(-0.693))
    const = Schedule(peak, 0.0, warmup_iters=4, decay_iters=100, style="constant")
    assert const.lr_at(2) == pytest.approx(peak / 2) and const.lr_at(50) == peak


def test_update_of_step_k_uses_the_rate_after_k_minus_1_steps():
    s = Schedule(1e-3, 0.0, warmup_iters=2, decay_iters=20, style="cosine")
    # GPT-NeoX's scheduler starts at step 0, and warms up from max(1, step) since its #1379
    assert s.lr_for_update(1) == pytest.approx(5e-4)
    assert s.lr_for_update(2) == pytest.approx(5e-4)
    assert s.lr_for_update(3) == pytest.approx(1e-3)


@pytest.mark.skipif(shared_dir() is None, reason="../shared is not on this machine")
def test_rates_of_each_update_equal_the_ones_gpt_neox_used():
    """The golden run of GPT-NeoX ea7aefd (warmup 2 of 20 steps): the rate each optimizer step
    used, from its log (its first update uses peak / warmup, not 0)."""
    path = shared_dir() / "golden/neox_runs/gelu_tanh_pp1/losses.json"
    rows = json.loads(path.read_text())["gelu_tanh_pp1"]["train"]
    s = Schedule(6e-4, 6e-5, warmup_iters=0.1 * 20, decay_iters=20, style="cosine")
    assert [r["iteration"] for r in rows] == list(range(1, 21))
    for row in rows:
        assert s.lr_for_update(row["iteration"]) == pytest.approx(row["lr_used_in_step"], rel=1e-6)
        assert s.lr_at(row["iteration"]) == pytest.approx(row["learning_rate"], rel=1e-6)


@pytest.mark.skipif(shared_dir() is None, reason="../shared is not on this machine")
def test_rates_equal_the_ones_gpt_neox_logged():
    losses = json.loads((shared_dir() / "golden/neox_checkpoints/losses.json").read_text())
    s = Schedule(6e-4, 6e-5, warmup_iters=0.1 * 20, decay_iters=20, style="cosine")
    for row in losses["pp1"]["train"]:
        assert s.lr_at(row["iteration"]) == pytest.approx(row["lr"], rel=1e-3), row


def test_wsd_holds_the_peak_then_decays_as_gpt_neox_pr_1375_writes_it():
    """Warmup 10, 100 steps after it, ratio 0.2: D = int(100 x 0.2) = 20 decay steps and
    S = 80 stable ones; n steps after warmup the rate is the peak while n <= S, then
    min_lr + (peak - min_lr) / 2 x (1 + cos(pi (n - S) / D))."""
    peak, low = 1e-3, 1e-4
    wsd = Schedule(peak, low, warmup_iters=10, decay_iters=110, style="wsd", wsd_ratio=0.2)
    assert wsd.lr_at(5) == pytest.approx(5e-4)  # the same warmup as every style
    assert [wsd.lr_at(s) for s in (10, 50, 90)] == [peak, peak, peak]
    for n in (81, 85, 90, 99, 100):
        want = low + (peak - low) / 2 * (1 + math.cos(math.pi * (n - 80) / 20))
        assert wsd.lr_at(10 + n) == pytest.approx(want)
    assert wsd.lr_at(110) == pytest.approx(low)
    # ratio 0: no decay step, the peak held to the end (GPT-NeoX's max(D, 1))
    assert Schedule(peak, low, 0, 100, "wsd", wsd_ratio=0.0).lr_at(100) == peak


def test_wsd_from_the_config_and_its_explanation(tmp_path):
    from torchneox.config.derive import derive
    from torchneox.config.load import load_config

    path = tmp_path / "a.yml"
    keys = {"train_iters": 200, "lr_decay_style": "wsd", "wsd_decay_ratio": 0.25, "warmup": 0.0}
    path.write_text(json.dumps(keys | {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}))
    loaded = load_config([path])
    derived = derive(loaded)
    schedule = Schedule.from_config(loaded.config.lr, derived)
    assert schedule.lr_at(150) == 0.01 and schedule.lr_at(175) == pytest.approx(0.005)
    assert "holds the peak, then (the last 0.25 of the steps" in derived.reasons["lr_schedule"]


def test_infinite_schedules_as_gpt_neox_pr_1194_writes_them():
    """Warmup 10 of 110 steps, cooldown 20 and a hold of 30 (n counts the steps after warmup):
    cooldown to constant_lr c, c held, then c x exp(-log(min_lr / c)... ) reaching min_lr at
    the end: c x exp(log(min_lr / c) / E x m), E = 100 - 20 - 30, m the steps past the hold."""
    from torchneox.optim.lr import Infinite

    peak, c, low, ts = 1e-3, 4e-4, 1e-5, 2.0

    def schedule(style):
        return Schedule(peak, low, 10, 110, style, infinite=Infinite(c, 20, 30, ts))

    cos, inv = schedule("infinite_cosine"), schedule("infinite_inv_sqrt")
    assert cos.lr_at(5) == inv.lr_at(5) == pytest.approx(5e-4)  # the usual warmup
    for n in (0, 5, 10, 20):
        assert cos.lr_at(10 + n) == pytest.approx(
            c + (peak - c) / 2 * (math.cos(math.pi * n / 20) + 1)
        )

        def f(t):
            return 1 / math.sqrt(1 + ts * t) - 1

        assert inv.lr_at(10 + n) == pytest.approx(peak + (c - peak) / f(1) * f(n / 20))
    for s in (cos, inv):
        assert s.lr_at(10 + 21) == s.lr_at(10 + 50) == pytest.approx(c)
        for m in (1, 25, 50):
            want = c * math.exp(math.log(low / c) / 50 * m)
            assert s.lr_at(10 + 50 + m) == pytest.approx(want)
        assert s.lr_at(110) == pytest.approx(low)


def test_infinite_schedules_need_rates_to_decay_between(tmp_path, capsys):
    from torchneox.cli import main

    path = tmp_path / "a.yml"
    path.write_text(json.dumps({"lr_decay_style": "infinite_cosine", "min_lr": 1e-5}))
    assert main(["config", "explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "constant_lr: must be above 0 for lr_decay_style infinite_cosine" in err
    assert len(err.strip().splitlines()) == 1


def test_infinite_schedule_from_the_config(tmp_path):
    from torchneox.config.derive import derive
    from torchneox.config.load import load_config
    from torchneox.optim.lr import Infinite

    path = tmp_path / "a.yml"
    keys = {"train_iters": 100, "warmup": 0.0, "lr_decay_style": "infinite_inv_sqrt"}
    keys |= {"constant_lr": 0.005, "min_lr": 1e-4, "timescale": 3.0}
    keys |= {"cooldown_iters_perc": 0.2, "constant_iters_perc": 0.3}
    path.write_text(json.dumps(keys | {"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}))
    loaded = load_config([path])
    derived = derive(loaded)
    schedule = Schedule.from_config(loaded.config.lr, derived)
    assert schedule.infinite == Infinite(0.005, 20, 30, 3.0)
    assert schedule.lr_at(35) == 0.005 and schedule.lr_at(100) == pytest.approx(1e-4)
    assert "cools down as 1/sqrt(1 + 3 t) to constant_lr 0.005" in derived.reasons["lr_schedule"]


def test_a_warmup_of_less_than_one_step_is_said_by_explain_and_at_start(make_config, capsys):
    """warmup 0.02 of 2 steps: 0.04 steps, so the first update runs at 25 x lr (GPT-NeoX's
    formula, kept); config explain's notes and the run's start-up lines say so."""
    from torchneox.cli import main

    cfg = make_config(train_iters=2, warmup=0.02)
    assert main(["config", "explain", cfg]) == 0
    said = (
        "warmup of 0.04 steps is less than one step, so the first update uses lr / 0.04 = 25 x lr"
    )
    assert said in capsys.readouterr().out.split("Notes")[-1]
    assert main(["train", cfg]) == 0
    assert f"note: {said}" in capsys.readouterr().out
