"""One layout check, before any process starts: `config explain`, `estimate` and
`train --nproc` refuse a layout that cannot run with the same line, and the estimator's
alternatives never propose one."""

from __future__ import annotations

import pytest

from torchneox.base.errors import ConfigError
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.layout import Layout, check_layout, layout_problem
from torchneox.config.load import load_config, load_mapping

UNTIED = {"no_weight_tying": True}
CASES = [
    (
        "mtp-beside-a-tied-head-with-a-zero-bubble-schedule",
        {
            "pipe_parallel_size": 2,
            "gradient_accumulation_steps": 2,
            "pipeline_schedule": "zbv",
            "num_layers": 4,
            "mtp_num_layers": 1,
        },
        "mtp_num_layers: 1 with pipeline_schedule zbv and tied embeddings: multi-token "
        "prediction cannot run two or more modules (or one beside tied embeddings)",
    ),
    (
        "1f1b-with-fewer-micro-batches-than-stages",
        UNTIED
        | {"pipe_parallel_size": 2, "gradient_accumulation_steps": 1, "pipeline_schedule": "1f1b"},
        "gradient_accumulation_steps: 1 micro-batches per step, but pipeline_schedule 1f1b "
        "needs at least one micro-batch per stage (2)",
    ),
    (
        "interleaved-schedule-with-odd-micro-batches",
        UNTIED
        | {
            "pipe_parallel_size": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "gradient_accumulation_steps": 3,
            "num_layers": 4,
        },
        "gradient_accumulation_steps: 3 micro-batches per step, but pipeline_schedule "
        "interleaved_1f1b needs a multiple of pipe_parallel_size (2) micro-batches",
    ),
    (
        "more-stages-than-layers",
        UNTIED | {"pipe_parallel_size": 2, "gradient_accumulation_steps": 2, "num_layers": 1},
        "pipe_parallel_size: 2 stages but only 1 layers; each stage needs one",
    ),
    (
        "experts-that-do-not-split",
        {"moe_num_experts": 3, "expert_parallel_size": 2},
        "expert_parallel_size: 2 must divide the data-parallel size 2 and moe_num_experts 3",
    ),
]


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" or "torchneox: error" not in captured.out
    err = captured.err
    assert err.startswith("torchneox: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("keys", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_verb_refuses_the_layout_before_any_process_starts(
    make_config, capsys, keys, message
):
    config = make_config(**keys)
    verbs = {
        "explain": ["config", "explain", config, "--world-size", "2"],
        "estimate": ["estimate", config, "--gpus", "2"],
        # refused in this process, before torchrun would start two
        "train": ["train", config, "--nproc", "2"],
    }
    for verb, argv in verbs.items():
        assert main(argv) == 2, verb
        err = one_error_line(capsys)
        assert message in err, f"{verb}: {err}"
        assert f"{config}: " in err, f"{verb}: the line names the file: {err}"


def test_the_default_schedule_falls_back_to_gpipe(make_config, capsys):
    config = make_config(no_weight_tying=True, pipe_parallel_size=2)
    assert main(["config", "explain", config, "--world-size", "2", "--json"]) == 0
    assert '"pipeline_schedule": "gpipe"' in capsys.readouterr().out


def test_a_layout_that_runs_passes(make_config):
    loaded = load_config(
        [make_config(no_weight_tying=True, pipe_parallel_size=2, gradient_accumulation_steps=2)]
    )
    layout = Layout.from_derived(loaded.config, derive(loaded, world_size=4))
    assert (layout.dp, layout.tp, layout.pp, layout.gas, layout.schedule) == (2, 1, 2, 2, "1f1b")
    check_layout(loaded, layout)


def test_an_unset_key_is_named_without_a_file():
    loaded = load_mapping(
        {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32}, "x"
    )
    layout = Layout.from_derived(loaded.config, derive(loaded, world_size=2))
    pp2 = Layout(**{**layout.__dict__, "pp": 2, "dp": 1, "schedule": "1f1b", "gas": 1})
    with pytest.raises(ConfigError) as e:
        check_layout(loaded, pp2)
    assert str(e.value).startswith("gradient_accumulation_steps: 1 micro-batches per step")
    assert layout_problem(loaded.config, layout) is None


@pytest.mark.parametrize("key", ["eod_mask_loss", "lm_z_loss"])
def test_the_loss_mask_and_z_loss_take_pipelines_with_and_without_context_parallelism(key):
    keys = UNTIED | {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
    loaded = load_mapping(keys | {"seq_length": 32, key: 0.01 if key == "lm_z_loss" else True}, "x")
    layout = Layout.from_derived(loaded.config, derive(loaded, world_size=8))
    pp2 = Layout(**{**layout.__dict__, "pp": 2, "dp": 4, "gas": 2})
    assert layout_problem(loaded.config, pp2) is None
    pp2_cp2 = Layout(**{**layout.__dict__, "pp": 2, "cp": 2, "dp": 2, "gas": 2})
    assert layout_problem(loaded.config, pp2_cp2) is None  # its parity: test_context_parallel
