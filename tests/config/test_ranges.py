"""Every number a config gives is range-checked where its key is declared (fields.py's
``key(..., gt=/ge=/lt=/le=)``), by one check at load: ``train``, ``config explain`` and
``estimate`` refuse the same values with one line naming the key, the allowed range and where
the value came from (the file, or ``--set``), exit 2."""

from __future__ import annotations

import math

import pytest

from torchneox.cli import main
from torchneox.config.schema import KEYS

BASE = """{
  "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
  "train_micro_batch_size_per_gpu": 2, "train_iters": 10,
  "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}},
}
"""

# (key, a wrong value as --set writes it, the allowed range the line must name)
BAD_VALUES = [
    ("dpo_beta", "-0.1", "> 0"),
    ("dpo_beta", "0", "> 0"),
    ("kto_beta", "0", "> 0"),
    ("kto_desirable_weight", "-1", "> 0"),
    ("kto_undesirable_weight", "0", "> 0"),
    ("z_loss", "-0.5", ">= 0"),
    ("lm_z_loss", "-1", ">= 0"),
    ("moe_aux_loss_coeff", "-0.01", ">= 0"),
    ("context_parallel_size", "0", ">= 1"),
    ("context_parallel_size", "-1", ">= 1"),
    ("expert_parallel_size", "0", ">= 1"),
    ("pipe_parallel_size", "-1", ">= 0"),
    ("model_parallel_size", "0", ">= 1"),
    ("pipeline_virtual_stages", "0", ">= 1"),
    ("te_fp8_amax_history_len", "0", ">= 1"),
    ("te_fp8_margin", "-1", ">= 0"),
    ("lr_decay_fraction", "1.5", "in (0, 1]"),
    ("hidden_dropout", "1", "in [0, 1)"),
    ("warmup", ".nan", "in [0, 1]"),
    ("extra_save_iters", "[4, -1]", ">= 0 (each of them)"),
    ("distributed_timeout_minutes", "0", "> 0"),
    ("num_nodes", "0", "-1 (every node) or >= 1"),
    ("num_nodes", "-3", "-1 (every node) or >= 1"),
]
VERBS = {  # the words before the config file, and after it
    "config explain": (["config", "explain"], []),
    "estimate": (["estimate"], ["--gpus", "1"]),
    "train": (["train"], []),
}


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("torchneox: error: "), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(("key", "value", "bounds"), BAD_VALUES, ids=lambda x: str(x))
def test_a_value_out_of_its_range_is_refused_by_every_verb(
    tmp_path, monkeypatch, capsys, verb, key, value, bounds
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yml").write_text(BASE)
    before, after = VERBS[verb]
    status = main([*before, "a.yml", *after, "--set", f"{key}={value}"])
    err = _one_line_error(capsys)
    assert status == 2
    assert f"--set: {key}: must be {bounds}, got" in err, err
    assert not (tmp_path / "run").exists()


def test_a_value_out_of_range_in_a_file_names_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yml").write_text(BASE)
    (tmp_path / "kto.yml").write_text("{kto_beta: -0.1}")
    assert main(["config", "explain", "a.yml", "kto.yml"]) == 2
    assert "kto.yml: kto_beta: must be > 0, got -0.1" in _one_line_error(capsys)


def test_every_default_lies_in_its_declared_range():
    for name, spec in KEYS.items():
        bounds, default = spec.info.range, spec.default
        if bounds is None or default is None or isinstance(default, bool):
            continue
        for v in default if isinstance(default, list) else [default]:
            assert math.isfinite(v) and bounds.holds(v), (name, default, bounds)


def test_the_keys_reference_shows_each_range(capsys):
    assert main(["config", "keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  context_parallel_size = 1  (>= 1)  [torchneox only]" in lines
    assert "  dpo_beta = 0.1  (> 0)" in lines


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optimizer.params.lr=-1", "--set: optimizer: params.lr must be > 0, got -1"),
        ("optimizer.params.lr=.inf", "--set: optimizer: params.lr must be > 0, got inf"),
        ("optimizer.params.betas=[2, 0.9]", "--set: optimizer: params.betas must be in [0, 1)"),
        ("optimizer.params.lrr=0.1", "--set: optimizer: params.lrr is not a parameter of Adam"),
        ("zero_optimization.stage=7", "--set: zero_optimization: stage must be 0, 1, 2 or 3"),
        ("fp16.loss_scale=-2", "--set: fp16: loss_scale must be a number >= 0"),
    ],
)
def test_a_wrong_value_given_with_set_inside_a_files_mapping_is_blamed_on_set(
    tmp_path, monkeypatch, capsys, override, expected
):
    """The file gives the mapping (optimizer, zero_optimization, fp16); the wrong entry is the
    override's, and the line says so instead of naming the file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yml").write_text(BASE)
    (tmp_path / "z.yml").write_text("{zero_optimization: {stage: 1}, fp16: {enabled: true}}")
    assert main(["config", "explain", "a.yml", "z.yml", "--set", override]) == 2
    err = _one_line_error(capsys)
    assert expected in err, err
    assert "a.yml" not in err and "z.yml" not in err


@pytest.mark.parametrize(
    "verb",
    [
        ["config", "explain", "a.yml", "--world-size", "3"],
        ["estimate", "a.yml", "--gpus", "3"],
        ["train", "a.yml", "--nproc", "3"],
    ],
    ids=lambda v: v[0],
)
def test_a_layout_rule_of_several_keys_is_refused_by_every_verb(
    tmp_path, monkeypatch, capsys, verb
):
    """Context parallelism's divisibility of the sequence: check_layout's, so the verbs that
    only read the config refuse it as train does, before any process starts."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yml").write_text(BASE)
    assert main([*verb, "--set", "context_parallel_size=3"]) == 2
    err = _one_line_error(capsys)
    assert "--set: context_parallel_size: seq_length 32 must be a multiple of 2 x " in err, err


def test_a_layout_rule_broken_by_a_set_entry_of_a_files_mapping_is_blamed_on_set(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yml").write_text(BASE)
    (tmp_path / "z.yml").write_text("{zero_optimization: {stage: 1}}")
    args = ["config", "explain", "a.yml", "z.yml", "--world-size", "4"]
    assert main([*args, "--set", "zero_optimization.mics_shard_size=3"]) == 2
    err = _one_line_error(capsys)
    assert "--set: zero_optimization: mics_shard_size 3 must divide the data-parallel size" in err


@pytest.mark.parametrize("verb", list(VERBS))
def test_a_check_of_two_keys_is_blamed_on_set_when_one_came_from_there(
    tmp_path, monkeypatch, capsys, verb
):
    """max_position_embeddings in the file, a longer seq_length given with --set: the file is
    not at fault, the override is (and without the override, the file is named)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yml").write_text(BASE.replace('"seq_length": 32', '"seq_length": 8'))
    (tmp_path / "b.yml").write_text("{max_position_embeddings: 16}")
    before, after = VERBS[verb]
    assert main([*before, "a.yml", "b.yml", *after, "--set", "seq_length=32"]) == 2
    err = _one_line_error(capsys)
    assert "--set: max_position_embeddings: 16 is shorter than seq_length 32" in err, err
    (tmp_path / "a.yml").write_text(BASE)  # seq_length 32 in the file
    assert main([*before, "a.yml", "b.yml", *after]) == 2
    assert "yml: max_position_embeddings: 16 is shorter than seq_length 32" in (
        _one_line_error(capsys)
    )
