"""train_epochs: the iterations GPT-NeoX computes from one epoch of the training split, and
every epoch read in the same order."""

from __future__ import annotations

import json

import numpy as np

from tests.helpers import losses, metric_rows
from torchneox.cli import main
from torchneox.data import loader as loader_module
from torchneox.data.indexed import IndexedDataset


def gpt_neox_iterations(prefix: str, seq: int, mb: int, dp: int, gas: int, epochs: int) -> int:
    """By hand, from GPT-NeoX's code: the train split of '90,8,2' (its document bounds rounded,
    the error taken off the end), (tokens - 1) // seq samples in the one epoch it builds, the
    loader's drop-last global micro-batches of mb x dp, and training.py's
    (len(loader) x epochs) // gradient_accumulation_steps."""
    sizes = IndexedDataset(prefix).sizes
    n = len(sizes)
    bounds = [0]
    for share in (90, 8, 2):
        bounds.append(bounds[-1] + int(round(share / 100 * float(n))))
    train_docs = bounds[1] - (bounds[-1] - n)
    tokens = int(sizes[:train_docs].sum())
    samples = (tokens - 1) // seq
    return (samples // (mb * dp)) * epochs // gas


def test_explain_gives_the_iterations_gpt_neox_computes(make_config, tiny_data, capsys):
    cfg = make_config(train_iters=None, train_epochs=3, gradient_accumulation_steps=3)
    assert main(["config", "explain", cfg, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = gpt_neox_iterations(tiny_data, 32, 4, 1, 3, 3)
    assert out["train_iters"] == expected
    assert "train_epochs 3" in out["reasons"]["train_iters"]
    assert out["lr_decay_iters"] == expected


def test_train_epochs_with_train_iters_is_one_line(make_config, capsys):
    cfg = make_config(train_epochs=2)
    assert main(["config", "explain", cfg]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train_epochs" in err and "together with train_iters" in err


def test_two_epochs_train_that_many_steps_in_the_same_order(
    make_config, tiny_data, tmp_path, monkeypatch
):
    # a short corpus: 32-token samples of 512 tokens a step, so an epoch is a few steps
    cfg = make_config(
        train_iters=None,
        train_epochs=2,
        seq_length=128,
        train_micro_batch_size_per_gpu=8,
        gradient_accumulation_steps=2,
        split="90,8,2",
        save=str(tmp_path / "run"),
        load=None,
    )
    expected = gpt_neox_iterations(tiny_data, 128, 8, 1, 2, 2)
    seen: list[np.ndarray] = []
    real_stack = loader_module.stack

    def recording(samples):
        batch = real_stack(samples)
        seen.append(batch.numpy().copy())
        return batch

    monkeypatch.setattr(loader_module, "stack", recording)
    assert main(["train", cfg, "--set", "eval_iters=0"]) == 0
    steps = [r["iteration"] for r in metric_rows(tmp_path / "run") if "lm_loss" in r]
    assert steps[-1] == expected and expected >= 2
    per_epoch = len(seen[: expected * 2]) // 2  # the micro-batches trained, two epochs of them
    first, second = seen[:per_epoch], seen[per_epoch : 2 * per_epoch]
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert not np.array_equal(first[0], first[1])


def test_a_dry_run_rehearses_the_epochs_steps(make_config, tiny_data, capsys):
    cfg = make_config(train_iters=None, train_epochs=2, load=None)
    assert main(["train", cfg, "--dry-run", "--world-size", "2", "--json"]) == 0
    expected = gpt_neox_iterations(tiny_data, 32, 4, 2, 1, 2)
    assert f"global_step{expected}" in capsys.readouterr().out


def test_the_resolved_config_gives_the_steps_the_epochs_made(make_config, tiny_data, capsys):
    cfg = make_config(train_iters=None, train_epochs=2)
    assert main(["config", "explain", cfg, "--format", "yaml"]) == 0
    text = capsys.readouterr().out
    assert f"train_iters: {gpt_neox_iterations(tiny_data, 32, 4, 1, 1, 2)}" in text
    assert "train_epochs" not in text  # (a checkpoint's config resumes without counting again)


def test_an_epochs_run_resumes_like_the_whole_run(make_config, tmp_path):
    keys = {
        "train_iters": None,
        "train_epochs": 2,
        "seq_length": 128,
        "train_micro_batch_size_per_gpu": 8,
        "use_checkpoint_lr_scheduler": True,
        "cpu_matmul": "default",
        "eval_iters": 0,
    }
    whole = make_config("w.yml", save=str(tmp_path / "w"), load=str(tmp_path / "w"), **keys)
    assert main(["train", whole]) == 0
    cut = make_config(
        "s.yml", save=str(tmp_path / "s"), load=str(tmp_path / "s"), exit_interval=5, **keys
    )
    assert main(["train", cut]) == 0
    assert main(["train", cut, "--set", "exit_interval=null"]) == 0  # resumed at 6
    lw, ls = losses(tmp_path / "w"), losses(tmp_path / "s")
    assert max(lw) > 5 and {k: lw[k] for k in lw if k > 5} == {k: ls[k] for k in ls if k > 5}
