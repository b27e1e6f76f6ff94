"""lora: each mistake one line naming the file and the key, exit 2, no traceback; explain
shows the adapted layers and what trains."""

from __future__ import annotations

import json

import pytest

from torchneox.cli import main

BASE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "train_micro_batch_size_per_gpu": 2,
    "train_iters": 10,
    "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}},
}
GOOD = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "attention.wv"]}


def lora(**changes) -> dict:
    return {"lora": GOOD | changes}


CASES = [
    ("not-a-mapping", {"lora": 4}, "lora: expected a mapping, got 4"),
    ("typo", {"lora": {**GOOD, "ranks": 2}}, "lora: unknown key ranks; did you mean rank?"),
    ("rank-zero", lora(rank=0), "lora: rank must be an integer >= 1, got 0"),
    ("rank-float", lora(rank=2.5), "lora: rank must be an integer >= 1, got 2.5"),
    ("alpha", lora(alpha=0), "lora: alpha must be a number > 0, got 0"),
    ("dropout", lora(dropout=1.0), "lora: dropout must be a number in [0, 1), got 1.0"),
    (
        "target-typo",
        lora(target_modules=["q_prj"]),
        "lora: target_modules: unknown layer 'q_prj'; did you mean q_proj?",
    ),
    ("targets-empty", lora(target_modules=[]), "lora: target_modules must be a list"),
    (
        "target-string",
        lora(target_modules="q_proj"),
        "lora: target_modules must be a list of layer names, got the text 'q_proj': write [q_proj]",
    ),
    ("alpha-text", lora(alpha="1e"), "lora: alpha must be a number > 0, got '1e'"),
    (
        "base-dtype",
        lora(base_dtype="bf61"),
        "lora: base_dtype must be fp32 or bf16, got 'bf61'; did you mean bf16?",
    ),
    (
        "gate-ungated",
        lora(target_modules=["gate_proj"]),
        "lora: target_modules names mlp.gate, but the activation is not gated",
    ),
    (
        "no-such-family",
        {**lora(), "attention_config": [[["mamba"], "all"]]},
        "lora: target_modules names attention.wq, a layer of attention blocks, and "
        "attention_config gives no attention layer",
    ),
    (
        "router-without-moe",
        lora(target_modules=["mlp.router"]),
        "lora: target_modules names mlp.router, and the model has no MoE layer",
    ),
]


@pytest.mark.parametrize(("keys", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_clear_line(tmp_path, capsys, keys, fragment):
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE | keys))
    status = main(["config", "explain", str(path)])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    err = captured.err
    assert err.startswith("torchneox: error: ") and err.count("\n") == 1, err
    assert "a.yml" in err and fragment in err, err


def test_explain_shows_the_adapters(tmp_path, capsys):
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE | lora()))
    assert main(["config", "explain", str(path)]) == 0
    out = capsys.readouterr().out
    # q and v: rank 4 x (64 in + 64 out) each, 2 in each of 2 layers
    line = next(x for x in out.splitlines() if "lora_trainable_parameters" in x)
    assert "2,048 trainable parameters" in line, line
    assert (
        "rank 4, alpha 8 (scale 2), dropout 0 on attention.wq (q_proj), attention.wv (v_proj)"
        in line
    )
    assert main(["config", "explain", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lora_trainable_parameters"] == 2048
    assert "the base frozen, in fp32 (base_dtype: bf16 halves its linear weights)" in line
    path.write_text(json.dumps(BASE | lora(base_dtype="bfloat16")))
    assert main(["config", "explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "the base frozen, stored in bf16 (its linear weights;" in out, out


def test_defaults_are_peft_defaults(tmp_path, capsys):
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE | {"lora": {}}))
    assert main(["config", "explain", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lora_trainable_parameters"] == 2 * 2 * 8 * 128


def test_no_lora_no_row(tmp_path, capsys):
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE))
    assert main(["config", "explain", str(path), "--json"]) == 0
    assert "lora_trainable_parameters" not in json.loads(capsys.readouterr().out)


TEXT_NUMBERS = [  # YAML reads 1e3 (no dot, or no sign after e) as text: numbers all the same
    (
        "lora",
        lora(rank="4e0", alpha="1e3", dropout="1e-1"),
        "rank 4, alpha 1000 (scale 250), dropout 0.1",
    ),
    (
        "soft-prompt",
        {"soft_prompt_tuning": {"enabled": True, "n_tokens": "4e0", "init_range": "1e-2"}},
        "4 trained vectors before the text (from uniform in [-0.01, 0.01])",
    ),
    (
        "curriculum",
        {
            "curriculum_learning": {
                "enabled": True, "curriculum_type": "seqlen", "min_difficulty": "8e0",
                "max_difficulty": "6.4e1", "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": "1e3", "difficulty_step": "8e0"},
            }
        },
        "8 + (step/1000) x (64 - 8), down to a multiple of 8",
    ),
    (
        "muon",
        {"optimizer": {"type": "muon", "params": {"lr": "1e-3", "ns_steps": "1e1"}}},
        "10 Newton-Schulz steps",
    ),
    (
        "amp",
        {"amp": {"enabled": True, "opt_level": "O2", "loss_scale": "6.5e4"}},
        "static loss scale 65000",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("keys", "shown"), [c[1:] for c in TEXT_NUMBERS], ids=[c[0] for c in TEXT_NUMBERS]
)
def test_numbers_written_as_text_are_read_as_numbers(tmp_path, capsys, keys, shown):
    """As a flat key's: lora's, soft_prompt_tuning's, curriculum_learning's, muon's and amp's
    numbers given as text (1e3) are those numbers, not refused."""
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE | keys))
    status = main(["config", "explain", str(path)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert shown in captured.out, captured.out
