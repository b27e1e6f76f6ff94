"""muP in the parallel layouts: the groups and the initialisation come from the base shapes by
parameter name and whole shape, so ZeRO-3's and tensor parallelism's DTensors and a pipeline's
stages train as one process does."""

from __future__ import annotations

import pytest

from tests.helpers import DP_KEYS, assert_same_training, one_process, train
from torchneox.cli import main

pytest.importorskip("mup")

MUP = {"use_mup": True, "hidden_size": 64, "train_iters": 3, "no_weight_tying": True, **DP_KEYS}


@pytest.fixture(scope="module")
def config(make_module_config, tmp_path_factory):
    shapes = tmp_path_factory.mktemp("mup") / "shapes.yml"
    base = make_module_config(
        "base.yml",
        save_base_shapes=True,
        base_shapes_file=str(shapes),
        **(MUP | {"hidden_size": 32}),
    )
    assert main(["train", base]) == 0
    return make_module_config("mup.yml", base_shapes_file=str(shapes), **MUP)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


@pytest.mark.parametrize(
    "others",
    [
        ["zero_optimization.stage=3", "train_micro_batch_size_per_gpu=2"],
        ["model_parallel_size=2", "train_micro_batch_size_per_gpu=4"],
        ["pipe_parallel_size=2", "train_micro_batch_size_per_gpu=4"],
    ],
    ids=["zero3-dp2", "tp2", "pp2"],
)
def test_mup_equals_one_process(config, tmp_path, baseline, others):
    out = tmp_path / "run"
    train(config, f"save={out}", "load=null", *others, nproc=2)
    assert_same_training(out, baseline)
