"""Layer weight sharing and soft prompts across processes: 2 processes (DDP; ZeRO-3, the blocks
that share one owner's tensors in one FSDP unit; tensor parallel; the shared MoE layers' experts
split over 2 expert ranks, and 2 pipeline stages whose layers share across them, each resumed
to the bit; a soft prompt before a curriculum's growing text under ZeRO-3, context
parallelism and 2 pipeline stages x 2 context ranks, the last two resumed to the bit) give the losses and weights of one process on the same
global batch."""

from __future__ import annotations

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_bitwise,
    assert_same_training,
    losses,
    one_process,
    train,
)

# the shared layers are MoE layers (top-k routing is per token; the balancing loss, over each
# rank's micro-batch, is left out so that every layout has one process's batch)
SHARED = {"num_layers": 4, "num_unique_layers": 2, "no_weight_tying": True}
SHARED |= {"moe_num_experts": 4, "moe_top_k": 2, "moe_router_type": "topk"}
SHARED |= {"moe_aux_loss_coeff": 0.0}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(
        "shared.yml", train_micro_batch_size_per_gpu=2, train_iters=3, **DP_KEYS, **SHARED
    )


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


@pytest.mark.parametrize(
    "layout",
    [
        ["zero_optimization.stage=3"],
        ["model_parallel_size=2", "train_micro_batch_size_per_gpu=4"],
        # DDP (ZeRO 0) with the experts that two layers share split once over the expert ranks
        ["zero_optimization.stage=0", "expert_parallel_size=2", "checkpoint_factor=2"],
        # layers 2 and 3 (stage 1) share the weights of layers 0 and 1 (stage 0): stage 1 holds
        # copies under the owners' names, their gradients summed with the owners' and counted
        # once, saved once; stopped after step 2, it resumes on 2 stages
        ["pipe_parallel_size=2", "gradient_accumulation_steps=4", "checkpoint_factor=2"],
    ],
    ids=["zero3", "tp2", "ddp-ep2", "pp2"],
)
def test_two_processes_equal_one(config, tmp_path, baseline, layout):
    out = tmp_path / "run"
    train(config, f"save={out}", "load=null", *layout, nproc=2)
    assert sorted(losses(out)) == [1, 2, 3]
    assert_same_training(out, baseline)
    if "checkpoint_factor=2" in layout:  # stopped after step 2, it resumes on 2 expert ranks
        assert_resumes_bitwise(config, out, 2, layout, nproc=2)


# a curriculum's growing length (8, 16, then 32 tokens) after a prompt of 3: under context
# parallelism 3 + 8 and 3 + 16 tokens are padded (out of the loss) to 2 x cp equal chunks
CURRICULUM = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": 32,
    "schedule_type": "fixed_discrete",
    "schedule_config": {"difficulty": [8, 16, 32], "max_step": [1, 2]},
}


@pytest.fixture(scope="module")
def prompt_config(make_module_config):
    spec = {"enabled": True, "n_tokens": 3, "init_string": "the"}
    return make_module_config(
        "prompt.yml",
        train_micro_batch_size_per_gpu=2,
        train_iters=3,
        soft_prompt_tuning=spec,
        curriculum_learning=CURRICULUM,
        **DP_KEYS,
    )


@pytest.mark.parametrize(
    ("layout", "nproc"),
    [
        (["zero_optimization.stage=3"], 2),
        # the prompt's positions lead the sequence the context ranks split (rank 0 holds them)
        (["context_parallel_size=2", "gradient_accumulation_steps=4", "checkpoint_factor=1"], 2),
        # ... and through 2 pipeline stages: the first stage's chunks of [prompt, text] take
        # the prompt's rows, the last scores the text's positions (the prompt's out of the loss)
        (["context_parallel_size=2", "pipe_parallel_size=2", "train_micro_batch_size_per_gpu=4",
          "checkpoint_factor=1"], 4),
    ],
    ids=["zero3", "cp2", "pp2-cp2"],
)  # fmt: skip
def test_soft_prompt_on_several_processes_equals_one(
    prompt_config, tmp_path, tmp_path_factory, layout, nproc
):
    baseline = one_process(prompt_config, tmp_path_factory)
    out = tmp_path / "run"
    train(prompt_config, f"save={out}", "load=null", *layout, nproc=nproc)
    assert_same_training(out, baseline)
    if "checkpoint_factor=1" in layout:  # resumed after step 1: the padded 3 + 16, then 3 + 32
        assert_resumes_bitwise(prompt_config, out, 1, layout, nproc=nproc)
