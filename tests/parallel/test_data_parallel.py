"""Data parallelism on gloo: 2 processes give the losses and weights of 1 process on the same
global batch, for every ZeRO stage, and checkpoints move between layouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from torchneox.config.load import load_config
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.train import checkpoint


def train(config: str, *overrides: str, nproc: int = 1) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torchneox", "train", config]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    for o in overrides:
        args += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def losses(folder, key: str = "lm_loss") -> dict[int, float]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r[key] for r in rows if key in r}


def weights(folder) -> dict[str, torch.Tensor]:
    step = checkpoint.resolve(folder)
    model = build_model(model_args(checkpoint.checkpoint_config(step)))
    checkpoint.load_model_weights(step, model)
    return model.state_dict()


def reference(folder):
    """What a parallel run is compared with: the losses, gradient norms and final weights of
    a one-process run."""
    return losses(folder), losses(folder, "grad_norm"), weights(folder)


def assert_same_training(out, baseline) -> None:
    """The run in ``out`` has the losses, gradient norms (the gradients of every step, taken
    whole) and final weights of the one-process ``baseline``."""
    one_losses, one_norms, one_weights = baseline
    got, norms = losses(out), losses(out, "grad_norm")
    assert sorted(got) == sorted(one_losses) == sorted(norms)
    for k in got:
        assert got[k] == pytest.approx(one_losses[k], rel=1e-5, abs=1e-6), k
        assert norms[k] == pytest.approx(one_norms[k], rel=1e-4, abs=1e-6), k
    # Adam's first update is lr * g / (|g| + eps) per element: where a gradient is float noise
    # (~1e-9) the layouts' different summation orders can move that element by up to ~lr * 1e-2
    for name, tensor in weights(out).items():
        torch.testing.assert_close(
            tensor, one_weights[name], rtol=1e-4, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_resumes_like_whole(
    cfg,
    tmp_path,
    whole: list[str],
    first: list[str],
    first_nproc: int,
    then: list[str],
    then_nproc: int = 1,
):
    """Stop at step 3 under layout ``first``, resume under ``then``: steps 4-6 equal a run
    never stopped (``whole``, one process). Returns the run's folder."""
    train(cfg, f"save={tmp_path / 'whole'}", "load=null", *whole)
    moved = tmp_path / "moved"
    train(cfg, f"save={moved}", f"load={moved}", *first, "exit_interval=3", nproc=first_nproc)
    train(cfg, f"save={moved}", f"load={moved}", *then, nproc=then_nproc)
    done, after = losses(tmp_path / "whole"), losses(moved)
    for k in (4, 5, 6):
        assert after[k] == pytest.approx(done[k], rel=1e-5), k
    return moved


# the global batch every layout below trains: 8 sequences in 2 accumulation steps
DP_KEYS = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "eval_iters": 1,
    "hidden_dropout": 0.0,
    "num_workers": 0,
}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(train_micro_batch_size_per_gpu=2, train_iters=4, **DP_KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("baseline")
    train(config, f"save={tmp_path / 'one'}", "load=null", "train_micro_batch_size_per_gpu=4")
    return reference(tmp_path / "one")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_processes_equal_one(config, tmp_path, baseline, stage):
    out = tmp_path / f"zero{stage}"
    run = train(config, f"save={out}", "load=null", f"zero_optimization.stage={stage}", nproc=2)
    assert "data_parallel" not in run.stderr
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert_same_training(out, baseline)


def test_checkpoint_moves_from_two_sharded_processes_to_one(
    config, tmp_path, baseline, make_config
):
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **DP_KEYS)
    one = ["train_micro_batch_size_per_gpu=4"]
    moved = assert_resumes_like_whole(cfg, tmp_path, one, ["zero_optimization.stage=3"], 2, one)
    assert checkpoint.read_meta(moved / "global_step3")["world_size"] == 2


def test_world_size_that_does_not_fit_the_batch_is_refused(config, tmp_path):
    args = [
        sys.executable,
        "-m",
        "torchneox",
        "train",
        config,
        "--nproc",
        "2",
        "--set",
        "train_batch_size=6",
        "--set",
        "train_micro_batch_size_per_gpu=4",
    ]
    run = subprocess.run(
        args,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
        check=False,
    )
    assert run.returncode == 2
    assert run.stderr.count("torchneox: error:") == 1  # checked once, before any process starts
    assert (
        "train_batch_size: 6 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x data-parallel size 2"
        in run.stderr
    )


def test_config_is_loadable_for_the_tests(config):
    assert load_config([config]).config.training.train_batch_size == 8


@pytest.fixture(scope="module")
def untied(make_module_config):
    return make_module_config(
        "untied.yml",
        train_micro_batch_size_per_gpu=4,
        train_iters=4,
        **DP_KEYS,
        no_weight_tying=True,
        activation="swiglu",
        num_kv_heads=2,
        norm="rmsnorm",
    )


@pytest.fixture(scope="module")
def untied_baseline(untied, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("untied-baseline")
    train(
        untied,
        f"save={tmp_path / 'one'}",
        "load=null",
        "train_micro_batch_size_per_gpu=4",
        "gradient_accumulation_steps=2",
    )
    return reference(tmp_path / "one")


TP_LAYOUTS = {
    "tp2": (2, ["model_parallel_size=2"]),
    # sequence parallelism, and selective activation checkpointing keeping the collectives
    "tp2-sequence-parallel-selective-ac": (
        2,
        [
            "model_parallel_size=2",
            "sequence_parallel=true",
            "checkpoint_activations=true",
            "checkpoint_activations_mode=selective",
        ],
    ),
}
for stage in (0, 1, 2, 3):
    TP_LAYOUTS[f"dp2-tp2-zero{stage}"] = (
        4,
        [
            "model_parallel_size=2",
            "train_micro_batch_size_per_gpu=2",
            f"zero_optimization.stage={stage}",
        ],
    )


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tensor_parallel_layouts_equal_one_process(untied, tmp_path, untied_baseline, layout):
    nproc, overrides = TP_LAYOUTS[layout]
    out = tmp_path / "tp"
    train(untied, f"save={out}", "load=null", *overrides, nproc=nproc)
    assert_same_training(out, untied_baseline)


RESHARDS = {
    "tp2-to-one": ((["model_parallel_size=2"], 2), ([], 1)),
    "dp4-zero1-to-dp2-tp2-zero3": (
        (["train_micro_batch_size_per_gpu=1", "zero_optimization.stage=1"], 4),
        (
            [
                "model_parallel_size=2",
                "train_micro_batch_size_per_gpu=2",
                "zero_optimization.stage=3",
            ],
            4,
        ),
    ),
}


@pytest.mark.parametrize("move", list(RESHARDS))
def test_tensor_parallel_checkpoints_reshard(untied, tmp_path, make_config, move):
    cfg = make_config(
        "u6.yml", train_micro_batch_size_per_gpu=4, train_iters=6, no_weight_tying=True, **DP_KEYS
    )
    (first, first_n), (then, then_n) = RESHARDS[move]
    moved = assert_resumes_like_whole(cfg, tmp_path, [], first, first_n, then, then_n)
    assert checkpoint.read_meta(moved / "global_step3")["world_size"] == first_n
