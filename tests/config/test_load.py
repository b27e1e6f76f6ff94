"""Reading and merging configs the way GPT-NeoX does, and what explain prints."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from torchneox.base.errors import ConfigError
from torchneox.cli import main
from torchneox.config.checks.model import layer_attention_types
from torchneox.config.derive import derive
from torchneox.config.fields import Status
from torchneox.config.load import load_config
from torchneox.config.report import keys_markdown, resolved_config
from torchneox.config.schema import KEYS

MODEL = """
# NeoX dialect: flow mapping, comments, trailing commas, Python-style True
{
  "num-layers": 2,          # hyphens read as underscores
  "hidden_size": 64,
  "num_attention_heads": 4,
  "seq_length": 32,
  "no_weight_tying": True,
  "optimizer": {
    "type": "Adam",
    "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,},
  },
  "min_lr": 1e-5,           # PyYAML reads this as the string '1e-5'
  "train_micro_batch_size_per_gpu": 4,
  "train_iters": 100,
}
"""


def test_neox_dialect_reads_and_numbers_in_e_notation_are_numbers(write):
    loaded = load_config([write("m.yml", MODEL)])
    cfg = loaded.config
    assert cfg.model.num_layers == 2
    assert cfg.model.no_weight_tying is True
    assert cfg.lr.min_lr == pytest.approx(1e-5)
    assert isinstance(cfg.lr.min_lr, float)
    assert cfg.optimizer.optimizer["params"]["lr"] == pytest.approx(1e-3)
    assert cfg.optimizer.optimizer["params"]["eps"] == pytest.approx(1e-8)
    assert loaded.source("num_layers").endswith("m.yml")


def test_files_merge_and_overrides_win(write):
    a = write("a.yml", MODEL)
    b = write("b.yml", "{seed: 7, data_path: data/x_text_document}")
    loaded = load_config(
        [a, b],
        [
            "seed=9",
            "optimizer.params.lr=3e-4",
            "hidden-size=128",
            "optimizer.params.betas=[0.8, 0.9]",
        ],
    )
    cfg = loaded.config
    assert cfg.training.seed == 9
    assert cfg.model.hidden_size == 128
    assert cfg.data.data_path == "data/x_text_document"
    assert cfg.optimizer.optimizer["params"]["lr"] == pytest.approx(3e-4)
    assert cfg.optimizer.optimizer["params"]["betas"] == [0.8, 0.9]
    assert cfg.optimizer.optimizer["params"]["eps"] == pytest.approx(1e-8)  # untouched sibling
    assert loaded.source("seed") == "--set"


def test_override_creates_missing_dicts(write):
    loaded = load_config(
        [write("a.yml", "{seq_length: 8}")], ["optimizer.type=SGD", "optimizer.params.lr=0.1"]
    )
    assert loaded.config.optimizer.optimizer == {"type": "SGD", "params": {"lr": 0.1}}


def test_batch_triple_any_two_give_the_third(write):
    path = write("a.yml", MODEL)
    cases = [
        (["train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=2"], (32, 4, 2)),
        (["train_batch_size=32", "train_micro_batch_size_per_gpu=2"], (32, 2, 4)),
        (
            [
                "train_batch_size=32",
                "gradient_accumulation_steps=4",
                "train_micro_batch_size_per_gpu=null",
            ],
            (32, 2, 4),
        ),
        (["train_batch_size=16", "train_micro_batch_size_per_gpu=null"], (16, 4, 1)),
    ]
    for overrides, (tbs, mb, gas) in cases:
        d = derive(load_config([path], overrides), world_size=4)
        got = (
            d["train_batch_size"],
            d["train_micro_batch_size_per_gpu"],
            d["gradient_accumulation_steps"],
        )
        assert got == (tbs, mb, gas), overrides
        assert d["data_parallel_size"] == 4


def test_layout_and_pipeline_decision(write):
    path = write("a.yml", MODEL)
    for pp, runs in ((0, False), (1, False), (2, True)):
        d = derive(
            load_config([path], [f"pipe_parallel_size={pp}", "model_parallel_size=2"]), world_size=8
        )
        assert d["pipeline_schedule_runs"] is runs
        assert d["pipeline_stages"] == max(pp, 1)
        assert d["data_parallel_size"] == 8 // (max(pp, 1) * 2)
    d = derive(load_config([path], ["pipe_parallel_size=2"]), world_size=2)
    assert d["pipeline_schedule"] == "gpipe"  # the default 1f1b needs 2 micro-batches
    assert "1f1b needs a micro-batch per stage (2)" in d.reasons["pipeline_schedule"]
    d = derive(
        load_config([path], ["pipe_parallel_size=2", "gradient_accumulation_steps=2"]), world_size=2
    )
    assert d["pipeline_schedule"] == "1f1b"


def test_world_size_from_launcher_env_and_config(write):
    path = write("a.yml", MODEL)
    assert derive(load_config([path]), env={"WORLD_SIZE": "4"})["world_size"] == 4
    assert derive(load_config([path], ["global_num_gpus=2"]), env={})["world_size"] == 2
    assert derive(load_config([path], ["num_gpus=8", "num_nodes=2"]), env={})["world_size"] == 16


def test_precision_and_loss_scaling(write):
    path = write("a.yml", MODEL)
    d = derive(
        load_config([path], ["fp16={enabled: true, loss_scale: 0, initial_scale_power: 12}"])
    )
    assert d["precision"] == "fp16"
    assert d["loss_scale"] == "dynamic from 2^12"
    assert derive(load_config([path], ["bf16={enabled: true}"]))["precision"] == "bfloat16"
    assert derive(load_config([path]))["precision"] == "fp32"


def test_learning_rate_and_schedule(write):
    d = derive(load_config([write("a.yml", MODEL)], ["warmup=0.1", "lr_decay_iters=50"]))
    assert d["lr"] == pytest.approx(1e-3)
    assert d["lr_decay_iters"] == 50
    assert d["warmup_iters"] == pytest.approx(5.0)
    d = derive(load_config([write("b.yml", MODEL)], ["lr_decay_fraction=0.5"]))
    assert d["lr_decay_iters"] == 50
    # GPT-NeoX: lr_decay_iters wins over lr_decay_fraction
    both = ["lr_decay_fraction=0.5", "lr_decay_iters=80"]
    assert derive(load_config([write("c.yml", MODEL)], both))["lr_decay_iters"] == 80
    # a warmup shorter than one step makes the first update larger than lr, as in GPT-NeoX
    d = derive(load_config([write("d.yml", MODEL)], ["warmup=0.005"]))
    assert d["warmup_iters"] == pytest.approx(0.5)
    assert "the first update uses lr / 0.5 = 2 x lr" in d.reasons["warmup_iters"]


def test_weight_decay_from_top_level_key_like_neox(write):
    d = derive(
        load_config(
            [write("a.yml", MODEL)], ["optimizer.params.weight_decay=0.0", "weight_decay=0.05"]
        )
    )
    assert d["weight_decay"] == pytest.approx(0.05)
    assert "overridden by weight_decay" in d.reasons["weight_decay"]


def _non_default(spec) -> Any:
    tp, default = spec.type, spec.default
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = (
        args[0]
        if typing.get_origin(tp) in (typing.Union,) or type(tp).__name__ == "UnionType"
        else tp
    )
    if typing.get_origin(base) is typing.Literal:
        return next(c for c in typing.get_args(base) if c != default)
    if base is bool:
        return not default
    if base is int:
        return (default or 0) + 3
    if base is float:
        return (default or 0.0) + 0.25
    if base is str:
        return "something"
    if typing.get_origin(base) is list:
        return (
            ["x"]
            if typing.get_args(base) in ((str,), ()) or typing.get_args(base)[0] is Any
            else [1]
        )
    if typing.get_origin(base) is dict:
        return {"enabled": True}
    if base is Any:
        return "something"
    raise AssertionError(f"no sample value for {spec.name}")


@pytest.mark.parametrize("name", [n for n, s in KEYS.items() if s.info.status is Status.NO_EFFECT])
def test_every_no_effect_key_is_listed_with_its_reason(write, name):
    value = _non_default(KEYS[name])
    path = write("a.yml", json.dumps({name: value}))
    d = derive(load_config([path]))
    assert d.no_effect[name] == KEYS[name].info.why


@pytest.mark.parametrize(
    "name", [n for n, s in KEYS.items() if s.info.status is Status.UNSUPPORTED]
)
def test_every_unsupported_key_is_refused_when_set(write, name):
    path = write("a.yml", json.dumps({name: _non_default(KEYS[name])}))
    with pytest.raises(ConfigError) as err:
        load_config([path])
    assert err.value.key == name
    assert KEYS[name].info.why in str(err.value)


def test_json_has_the_stable_keys(write, capsys):
    assert (
        main(
            [
                "config",
                "explain",
                str(write("a.yml", MODEL)),
                "--json",
                "--set",
                "bias_dropout_fusion=true",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    required = {
        "world_size",
        "data_parallel_size",
        "model_parallel_size",
        "pipe_parallel_size",
        "pipeline_schedule_runs",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "precision",
        "num_parameters",
        "flops_per_token",
        "no_effect_keys",
        "reasons",
    }
    assert required <= set(data)
    assert data["no_effect_keys"] == ["bias_dropout_fusion"]
    assert isinstance(data["pipeline_schedule_runs"], bool)
    assert set(data["reasons"]) >= required - {"no_effect_keys", "reasons"}


def test_text_output_is_grouped_and_explains(write, capsys):
    assert main(["config", "explain", str(write("a.yml", MODEL)), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    for heading in ("Layout", "Batch", "Precision", "Optimizer", "Model"):
        assert f"\n{heading}\n" in out
    assert "data_parallel_size" in out and "2 = world size 2" in out


def test_resolved_yaml_loads_back_to_the_same_config(write, capsys, tmp_path):
    source = write("a.yml", MODEL)
    overrides = ["fp16={enabled: true}", "gradient_accumulation_steps=2", "seed=5"]
    loaded = load_config([source], overrides)
    expected = resolved_config(loaded, derive(loaded)).to_flat()
    assert (
        main(
            [
                "config",
                "explain",
                str(source),
                "--format",
                "yaml",
                *[arg for o in overrides for arg in ("--set", o)],
            ]
        )
        == 0
    )
    again = write("resolved.yml", capsys.readouterr().out)
    reloaded = load_config([again])
    assert reloaded.config.to_flat() == expected
    assert derive(reloaded).values == derive(loaded).values


def test_docs_config_md_is_generated_from_the_schema():
    doc = (REPO / "docs" / "config.md").read_text()
    assert doc == keys_markdown(), "regenerate: torchneox config keys --markdown > docs/config.md"


def test_module_entry_point_and_exit_status(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("{hiden_size: 3}")
    run = subprocess.run(
        [sys.executable, "-m", "torchneox", "config", "explain", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.strip().endswith("hiden_size: unknown key; did you mean hidden_size?")
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchneox",
            "config",
            "explain",
            str(REPO / "src" / "torchneox" / "configs" / "tiny_cpu.yml"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "pipeline_schedule_runs" in ok.stdout


def test_cli_usage_error_is_one_line(capsys):
    assert main(["config", "explian"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice" in err


def test_keys_reference_lists_every_key(capsys):
    assert main(["config", "keys"]) == 0
    out = capsys.readouterr().out
    for name in KEYS:
        assert f"  {name} = " in out


def test_config_path_is_read_relative_to_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("x.yml").write_text("{seed: 3}")
    assert load_config(["x.yml"]).config.training.seed == 3


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "configs").glob("*.yml")) + [REPO / "src/torchneox/configs/tiny_cpu.yml"],
    ids=lambda p: p.name,
)
def test_shipped_configs_explain(path):
    loaded = load_config([path])
    par = loaded.config.parallel
    ranks = max(par.pipe_parallel_size, 1) * par.model_parallel_size * par.context_parallel_size
    derived = derive(loaded, world_size=math.lcm(8, ranks))  # llama2-70b: tp 8 x pp 4 = 32
    assert derived["num_parameters"] > 0 and derived["train_batch_size"] > 0


def test_launcher_keys_become_a_torchrun_command(write, tmp_path):
    hostfile = write("hosts", "# two nodes\nnode-a slots=8\nnode-b slots=8\n")
    d = derive(load_config([write("a.yml", MODEL)], [f"hostfile={hostfile}"]), world_size=16)
    assert d["launch"].startswith(
        "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node-a:29500"
    )
    d = derive(load_config([write("b.yml", MODEL)], ["num_gpus=4"]), world_size=4)
    assert d["launch"].startswith("torchrun --standalone --nproc-per-node 4 -m torchneox train")
    bad = write("badhosts", "node-a eight\n")
    with pytest.raises(ConfigError, match="badhosts:1: expected 'HOST slots=N'"):
        derive(load_config([write("c.yml", MODEL)], [f"hostfile={bad}"]), world_size=1)


@pytest.mark.parametrize(
    "attention_config,layers",
    [
        ([[["rwkv", "global"], 2]], ["rwkv", "global", "rwkv", "global"]),
        ([[["global"], 1], [["gmlp", "flash", "global"], 1]], ["global", "gmlp", "flash", "global"]),
        ([[["rwkv", "global"], "all"]], ["rwkv", "global", "rwkv", "global"]),
        (["global", "rwkv", "rwkv", "global"], ["global", "rwkv", "rwkv", "global"]),
    ],
)  # fmt: skip
def test_attention_config_expands_as_gpt_neox_does(tmp_path, attention_config, layers):
    """GPT-NeoX's expand_attention_types: a pattern repeated count times, 'all' over every
    layer, a list of names one per layer."""
    path = tmp_path / "a.yml"
    path.write_text(json.dumps({"num_layers": 4, "attention_config": attention_config}))
    assert layer_attention_types(load_config([path]).config) == layers
