"""The DeepSpeed dicts GPT-NeoX passes on: amp (apex AMP) mapped onto fp16 with apex's loss
scaling, scheduler and sparse_attention listed as doing nothing (as in GPT-NeoX), and
data_efficiency's seqlen curriculum run as curriculum_learning, the rest refused in one line."""

from __future__ import annotations

import pytest

from tests.helpers import metric_rows
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.features.curriculum import curriculum
from torchneox.config.load import load_config
from torchneox.train.precision import LossScaler
from torchneox.train.trainer import Trainer


def _one_line_error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_o1_o2_train_in_fp16_with_apex_loss_scaling(make_config, level):
    loaded = load_config([make_config(amp={"enabled": True, "opt_level": level}, precision=None)])
    d = derive(loaded)
    assert d["precision"] == "fp16" and d["amp"] == level
    scaler = LossScaler.from_config(loaded.config.precision, d["precision"])
    # apex's DynamicLossScaler: 2^16, doubled after 2000 clean steps, halved at each overflow
    assert (scaler.scale, scaler.dynamic, scaler.window, scaler.hysteresis) == (
        2.0**16,
        True,
        2000,
        1,
    )
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**15


def test_amp_static_loss_scale_and_o0(make_config):
    loaded = load_config([make_config(amp={"enabled": True, "loss_scale": 128.0}, precision=None)])
    d = derive(loaded)
    assert d["precision"] == "fp16" and d["amp"] == "O1"  # apex's default opt_level
    scaler = LossScaler.from_config(loaded.config.precision, d["precision"])
    assert (scaler.scale, scaler.dynamic) == (128.0, False)
    for amp in ({"enabled": True, "opt_level": "O0"}, {"enabled": False, "opt_level": "O2"}):
        assert derive(load_config([make_config(amp=amp, precision=None)]))["precision"] == "fp32"


def test_a_run_with_amp_logs_apex_loss_scale(make_config, tmp_path):
    cfg = make_config(
        amp={"enabled": True, "opt_level": "O2"}, precision=None, train_iters=2, load=None
    )
    Trainer(load_config([cfg]), device="cpu").run()
    rows = [r for r in metric_rows(tmp_path / "run") if "lm_loss" in r]
    assert [r["loss_scale"] for r in rows] == [2.0**16, 2.0**16]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"amp": {"enabled": True, "opt_level": "O3"}}, "opt_level O3 (fp16 weights without"),
        (
            {"amp": {"enabled": True}, "fp16": {"enabled": True}},
            "is enabled together with fp16/bf16, which DeepSpeed refuses",
        ),
        (
            {"amp": {"enabled": True}, "zero_optimization": {"stage": 1}},
            "DeepSpeed refuses apex AMP with ZeRO (stage 1)",
        ),
        ({"amp": {"enabled": True}, "precision": "fp32"}, "decides the precision; remove"),
        ({"amp": {"enabled": True, "opt_levl": "O1"}}, "unknown entry 'opt_levl'"),
        ({"amp": {"opt_level": "O1"}}, "must contain 'enabled'"),
    ],
)
def test_amp_mistakes_are_one_line(make_config, capsys, keys, message):
    keys = {"precision": None} | keys
    err = _one_line_error(capsys, ["config", "explain", make_config(**keys)])
    assert ": amp: " in err and message in err


def test_scheduler_and_sparse_attention_change_nothing_as_in_gpt_neox(make_config, capsys):
    plain = derive(load_config([make_config()]))
    cfg = make_config(
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}},
        sparse_attention={"mode": "fixed", "block": 16},
    )
    d = derive(load_config([cfg]))
    assert {k: d.values[k] for k in plain.values} == plain.values  # same schedule, same run
    assert "GPT-NeoX hands DeepSpeed its own schedule" in d.no_effect["scheduler"]
    assert "DeepSpeed only parses it" in d.no_effect["sparse_attention"]


def _data_efficiency(metrics: dict, routing: bool = False) -> dict:
    return {
        "enabled": True,
        "seed": 1234,
        "data_routing": {"enabled": routing},
        "data_sampling": {
            "enabled": True,
            "num_workers": 0,
            "curriculum_learning": {"enabled": True, "curriculum_metrics": metrics},
        },
    }


SEQLEN = {
    "index_to_sample_path": "unused",
    "difficulty_type": "value",
    "clustering_type": "single_cluster",
    "min_difficulty": 8,
    "max_difficulty": 32,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
}


def test_data_efficiency_seqlen_is_the_sequence_length_curriculum(make_config):
    cfg = make_config(data_efficiency=_data_efficiency({"seqlen_truncate": SEQLEN}))
    cur = curriculum(load_config([cfg]).config)
    assert (
        "from data_efficiency's seqlen_truncate metric"
        in derive(load_config([cfg])).reasons["curriculum"]
    )
    # floor(k/10 x (32 - 8) + 8) down to a multiple of 8 (DeepSpeed's fixed_linear)
    assert [cur.length(k) for k in (1, 3, 4, 6, 7, 10, 11)] == [8, 8, 16, 16, 24, 32, 32]
    off = _data_efficiency({"seqlen_truncate": SEQLEN})
    off["data_sampling"]["enabled"] = False
    assert curriculum(load_config([make_config(data_efficiency=off)]).config) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            _data_efficiency({"seqlen_truncate": SEQLEN}, routing=True),
            "data_routing (random layerwise token dropping) is DeepSpeed-only",
        ),
        (
            _data_efficiency({"vocabularyrarity": SEQLEN}),
            "curriculum metric(s) vocabularyrarity are DeepSpeed-only",
        ),
        (
            _data_efficiency({"seqlen_truncate": SEQLEN | {"difficulty_type": "percentile"}}),
            "seqlen_truncate's difficulty_type 'percentile' needs DeepSpeed's data analyzer",
        ),
        (
            _data_efficiency({"seqlen_truncate": {"min_difficulty": 8}}),
            "curriculum_metrics.seqlen_truncate: needs max_difficulty",
        ),
    ],
)
def test_data_efficiency_beyond_the_curriculum_is_refused_in_one_line(
    make_config, capsys, value, message
):
    err = _one_line_error(capsys, ["config", "explain", make_config(data_efficiency=value)])
    assert ": data_efficiency: " in err and message in err


def test_two_curricula_are_refused(make_config, capsys):
    legacy = {"enabled": True, "curriculum_type": "seqlen", **SEQLEN}
    for k in ("index_to_sample_path", "difficulty_type", "clustering_type"):
        legacy.pop(k)
    cfg = make_config(
        curriculum_learning=legacy,
        data_efficiency=_data_efficiency({"seqlen_truncate": SEQLEN}),
    )
    err = _one_line_error(capsys, ["config", "explain", cfg])
    assert "its seqlen curriculum and curriculum_learning are both enabled; keep one" in err


def test_a_run_with_data_efficiency_trains_on_the_scheduled_lengths(make_config, tmp_path):
    cfg = make_config(
        data_efficiency=_data_efficiency({"seqlen_truncate": SEQLEN}), train_iters=4, load=None
    )
    Trainer(load_config([cfg]), device="cpu").run()
    rows = [r for r in metric_rows(tmp_path / "run") if "lm_loss" in r]
    # floor(k/10 x 24 + 8) down to a multiple of 8: 10.4, 12.8, 15.2, 17.6 -> 8, 8, 8, 16
    assert [r["curriculum_seqlen"] for r in rows] == [8, 8, 8, 16]
