"""train_epochs and curriculum_learning: each mistake one line naming the file and the key,
exit 2, no traceback (as tests/config/test_bad_configs.py holds every key to)."""

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
GOOD = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 16,
    "max_difficulty": 64,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
}


def curriculum(**changes) -> dict:
    return {"curriculum_learning": GOOD | changes}


CASES = [
    ("epochs-and-iters", {"train_epochs": 2}, "train_epochs: given together with train_iters"),
    (
        "epochs-blend",
        {"train_epochs": 2, "train_iters": None, "train_data_paths": ["a"]},
        "train_epochs: counts the epochs of one data_path",
    ),
    (
        "epochs-unpacked",
        {"train_epochs": 2, "train_iters": None, "pack_impl": "unpacked"},
        "train_epochs: needs pack_impl packed, not unpacked",
    ),
    ("epochs-zero", {"train_epochs": 0, "train_iters": None}, "train_epochs: must be >= 1"),
    (
        "curriculum-typo",
        {"curriculum_learning": {**GOOD, "schedul_type": "x"}},
        "curriculum_learning: unknown key schedul_type; did you mean schedule_type?",
    ),
    (
        "curriculum-schedule-typo",
        curriculum(schedule_config={"total_curriculum_step": 10, "difficulty_steps": 8}),
        "unknown key schedule_config.difficulty_steps; did you mean difficulty_step?",
    ),
    (
        "curriculum-type",
        curriculum(curriculum_type="vocabularyrarity"),
        "curriculum_learning: curriculum_type 'vocabularyrarity' is not built; only 'seqlen'",
    ),
    ("curriculum-min-max", curriculum(min_difficulty=128), "min_difficulty 128 is above"),
    (
        "curriculum-schedule-type",
        curriculum(schedule_type="custom"),
        "schedule_type 'custom' is not one of fixed_linear, fixed_root, fixed_discrete",
    ),
    (
        "curriculum-missing",
        curriculum(schedule_type="fixed_root"),
        "schedule_type fixed_root needs schedule_config.root_degree",
    ),
    (
        "curriculum-discrete-counts",
        curriculum(
            schedule_type="fixed_discrete",
            schedule_config={"difficulty": [16, 64], "max_step": [2, 4]},
        ),
        "schedule_config.difficulty has 2 lengths for 2 max_step",
    ),
    (
        "curriculum-zero-length",
        curriculum(min_difficulty=4),
        "min_difficulty 4 rounds down to 0 tokens at difficulty_step 8",
    ),
    (
        "curriculum-not-a-number",
        curriculum(max_difficulty="long"),
        "max_difficulty must be an integer >= 1, got 'long'",
    ),
    (
        "curriculum-context",
        {**curriculum(), "context_parallel_size": 8},
        "curriculum_learning: trains on sequences of 8 tokens, which context_parallel_size 8 "
        "cannot cut into 2 x 8 equal chunks; use multiples of 16",
    ),
    (
        "curriculum-rm",
        {**curriculum(), "train_impl": "rm"},
        "curriculum_learning: with train_impl rm cannot cut a pair shorter",
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


def test_a_disabled_curriculum_is_accepted(tmp_path, capsys):
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE | {"curriculum_learning": {"enabled": False}}))
    assert main(["config", "explain", str(path), "--json"]) == 0
    assert "curriculum" not in json.loads(capsys.readouterr().out)


def test_explain_shows_the_schedule(tmp_path, capsys):
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE | curriculum()))
    assert main(["config", "explain", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["curriculum"].startswith("16 + (step/10) x (64 - 16), down to a multiple of 8")


def test_unpacked_data_without_labels_says_the_padding_counts(tmp_path, capsys):
    """GPT-NeoX's loss over an unpacked sample without a label dataset includes the padding:
    kept, and said by explain (and the run's start-up lines, which print explain's notes)."""
    from torchneox.cli import main

    config = tmp_path / "a.yml"
    keys = {"train_data_paths": ["d"], "valid_data_paths": ["d"], "test_data_paths": ["d"]}
    config.write_text(json.dumps(keys | {"pack_impl": "unpacked"}))
    assert main(["config", "explain", str(config)]) == 0
    assert "and the padding counts in the loss as in GPT-NeoX" in capsys.readouterr().out
    labels = {"train_label_data_paths": ["l"], "valid_label_data_paths": ["l"]}
    config.write_text(
        json.dumps(keys | labels | {"pack_impl": "unpacked", "test_label_data_paths": ["l"]})
    )
    assert main(["config", "explain", str(config)]) == 0
    assert "the padding counts" not in capsys.readouterr().out
