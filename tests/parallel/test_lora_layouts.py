"""LoRA under data parallelism: DDP (ZeRO 0) and FSDP2 (ZeRO 1-3, the frozen base and the
trained adapters in the same units) train as one process does."""

from __future__ import annotations

import pytest

from tests.helpers import assert_same_training, reference, train
from torchneox.checkpoint.files import read_meta, resolve

KEYS = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 32,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "eval_iters": 1,
    "num_workers": 0,
    "no_weight_tying": True,
    "lora": {"rank": 4, "alpha": 8, "target_modules": ["attention.wq", "attention.wv", "mlp.down"]},
}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config("lora.yml", train_iters=3, **KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("baseline")
    train(config, f"save={tmp_path / 'one'}", "load=null")
    return reference(tmp_path / "one")


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_lora_on_two_processes_equals_one(config, tmp_path, baseline, stage):
    out = tmp_path / "run"
    micro = ["train_micro_batch_size_per_gpu=1", f"zero_optimization.stage={stage}"]
    train(config, f"save={out}", "load=null", *micro, nproc=2)
    assert_same_training(out, baseline)


def test_lora_in_two_pipeline_stages_equals_one_process(config, tmp_path, baseline):
    out = tmp_path / "run"
    train(config, f"save={out}", "load=null", "pipe_parallel_size=2", nproc=2)
    assert_same_training(out, baseline)


def test_lora_split_over_two_tensor_ranks_equals_one_process(config, tmp_path, baseline):
    out = tmp_path / "run"
    train(config, f"save={out}", "load=null", "model_parallel_size=2", nproc=2)
    assert_same_training(out, baseline)


def test_lora_with_context_parallelism_equals_one_process(config, tmp_path, baseline):
    out = tmp_path / "run"
    train(config, f"save={out}", "load=null", "context_parallel_size=2", nproc=2)
    assert_same_training(out, baseline)


def test_zero3_saves_the_adapters_and_resumes_as_one_process_trains(config, tmp_path):
    """From a base checkpoint: the checkpoints hold the adapters (the base named), and two
    ZeRO-3 processes stopped at step 2 and resumed equal one process never stopped."""
    base, one, two = tmp_path / "base", tmp_path / "one", tmp_path / "two"
    train(config, f"save={base}", "load=null", "lora=null", "train_iters=1")
    from_base = [f"load={base}", "finetune=true"]
    train(config, f"save={one}", *from_base)
    zero3 = ["train_micro_batch_size_per_gpu=1", "zero_optimization.stage=3"]
    train(config, f"save={two}", *from_base, *zero3, "exit_interval=2", nproc=2)
    assert read_meta(resolve(two))["lora_base"] == str(resolve(base).resolve())
    train(config, f"save={two}", f"load={two}", "finetune=false", *zero3, nproc=2)
    assert_same_training(two, reference(one))


def test_adapters_merged_into_a_run_without_lora_on_two_tensor_ranks_equal_one(config, tmp_path):
    """A run without lora from an adapters-only checkpoint takes them merged into its weights,
    each rank into its part (a column-split layer's B by rows, a row-split one's A by
    columns): two tensor ranks train as one process does."""
    base, adapters, one, two = (tmp_path / n for n in ("base", "adapters", "one", "two"))
    train(config, f"save={base}", "load=null", "lora=null", "train_iters=1")
    train(config, f"save={adapters}", f"load={base}", "finetune=true", "train_iters=2")
    full = [f"load={adapters}", "finetune=true", "lora=null", "train_iters=2"]
    train(config, f"save={one}", *full)
    ran = train(config, f"save={two}", *full, "model_parallel_size=2", nproc=2)
    assert "they are merged into the weights they adapt" in ran.stdout, ran.stdout
    assert_same_training(two, reference(one))
