"""Pipeline parallelism: every schedule and its combinations with data and tensor parallelism
give the losses and weights of one process; pipe_parallel_size 0 and 1 build no schedule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import (
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    metric_rows,
    reference,
    train,
)
from tests.train.test_lm_eval import write_tasks
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.parallel.pipeline import layer_costs, rank_stage_indices, stage_layers
from torchneox.train.trainer import Trainer

PP_KEYS = {
    "num_layers": 4,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "eval_iters": 1,
    "hidden_dropout": 0.0,
    "num_workers": 0,
    "no_weight_tying": True,
}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config("pp.yml", train_iters=3, **PP_KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("baseline")
    train(config, f"save={tmp_path / 'one'}", "load=null")
    return reference(tmp_path / "one")


LAYOUTS = {
    "pp2-1f1b": (2, ["pipe_parallel_size=2"]),
    "pp2-gpipe": (2, ["pipe_parallel_size=2", "pipeline_schedule=gpipe"]),
    "pp2-interleaved": (2, ["pipe_parallel_size=2", "pipeline_schedule=interleaved_1f1b"]),
    "pp2-zbv": (2, ["pipe_parallel_size=2", "pipeline_schedule=zbv"]),
    # sequence parallelism: the stages pass each tensor rank's slice of the sequence
    "tp2-pp2-sequence-parallel": (
        4,
        ["pipe_parallel_size=2", "model_parallel_size=2", "sequence_parallel=true"],
    ),
}
# ZeRO 0 (DDP) and 1 with data x pipeline and ZeRO 3 with data x tensor x pipeline parallelism
# (and below, ZeRO-3 with tied weights across stages): ZeRO-2 runs ZeRO-1's code (FSDP2
# keeping the gathered weights through backward; its parity is
# tests/parallel/test_data_parallel.py's), and so does ZeRO 0 beside tensor parallelism (DDP
# takes no DTensor: parallel/data_parallel.py); ZeRO-1 beside tensor parallelism is
# test_tensor_parallel.py's
for stage in (0, 1):
    zero = ["train_micro_batch_size_per_gpu=1", f"zero_optimization.stage={stage}"]
    LAYOUTS[f"dp2-pp2-zero{stage}"] = (4, ["pipe_parallel_size=2", *zero])
LAYOUTS["dp2-tp2-pp2-zero3"] = (
    8,
    ["pipe_parallel_size=2", "model_parallel_size=2", "train_micro_batch_size_per_gpu=1"]
    + ["zero_optimization.stage=3"],
)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layouts_equal_one_process(config, tmp_path, baseline, layout):
    nproc, overrides = LAYOUTS[layout]
    out = tmp_path / layout
    train(config, f"save={out}", "load=null", *overrides, nproc=nproc)
    assert_same_training(out, baseline)
    # a checkpoint written by 8 sharded processes exports as any other
    if layout == "dp2-tp2-pp2-zero3":
        transformers = pytest.importorskip("transformers")
        assert main(["convert", "to-hf", str(out), str(tmp_path / "hf")]) == 0
        hf = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf").eval()
        _, ours = load_model(out)
        tokens = torch.randint(0, 256, (2, 16))
        with torch.no_grad():
            torch.testing.assert_close(hf(tokens).logits, ours.eval()(tokens), atol=1e-5, rtol=1e-5)


SHARED_ACROSS_STAGES = [
    "no_weight_tying=false",
    "pos_emb=rpe",
    "rpe_num_buckets=8",
    "rpe_max_distance=16",
    "eod_mask_loss=true",
    "lm_z_loss=0.01",
    "train_iters=6",
]


def test_tied_embeddings_rpe_and_the_loss_mask_through_stages_resume_as_stages(config, tmp_path):
    """Tied embeddings (the first stage's embedding is the last stage's head) and rpe's table
    (every stage's layers read it): each holding stage keeps a copy, their gradients summed
    over the stages (sharded by ZeRO-3 within each) and counted once in the norm. The last
    stage's target carries the loss mask (end-of-document positions left out), the loss adds
    the z-loss, logged as one process logs it. Stopped at step 3 on 2 stages x ZeRO-3 and
    resumed on 2 stages alone: each stage's optimizer state is kept under its parameters'
    names (the nested form numbered its groups, and the stages overwrote each other's)."""
    # micro-batches of one sample in every layout: the masked loss is a mean per micro-batch
    keys = [*SHARED_ACROSS_STAGES, "train_micro_batch_size_per_gpu=1"]
    alone = ["gradient_accumulation_steps=8"]
    train(config, f"save={tmp_path / 'one'}", "load=null", *keys, *alone)
    moved, stages = tmp_path / "moved", ["pipe_parallel_size=2"]
    zero3 = [*stages, "zero_optimization.stage=3"]
    train(config, f"save={moved}", f"load={moved}", *keys, *zero3, "exit_interval=3", nproc=4)
    train(config, f"save={moved}", f"load={moved}", *keys, *stages, *alone, nproc=2)
    assert_same_training(moved, reference(tmp_path / "one"))
    z_one, z_pp = losses(tmp_path / "one", "z_loss"), losses(moved, "z_loss")
    assert sorted(z_pp) == list(range(1, 7)) and all(z_one[k] > 0 for k in z_one)
    for k in z_one:
        assert z_pp[k] == pytest.approx(z_one[k], rel=1e-5), k


def test_tied_embeddings_and_rpe_with_several_stages_per_rank_resume_as_one_process(
    config, tmp_path
):
    """Several stages on a rank: each holds its own copy of rpe's table, and zbv's V puts the
    first and the last stage (the tied head's copy of the embedding) on the first rank. A
    rank's later copies are twins of its first: their gradients added to it before the
    holders sum theirs, their values refreshed after each step and each load. Two steps
    under interleaved_1f1b, resumed for two under zbv: one process's training."""
    keys = ["no_weight_tying=false", *SHARED_ACROSS_STAGES[1:4], "train_iters=4"]
    train(config, f"save={tmp_path / 'one'}", "load=null", *keys)
    moved, stages = tmp_path / "moved", ["pipe_parallel_size=2"]
    interleaved = [*stages, "pipeline_schedule=interleaved_1f1b", "exit_interval=2"]
    train(config, f"save={moved}", "load=null", *keys, *interleaved, nproc=2)
    train(
        config, f"save={moved}", f"load={moved}", *keys, *stages, "pipeline_schedule=zbv", nproc=2
    )
    assert_same_training(moved, reference(tmp_path / "one"))


def test_soft_prompt_curriculum_and_eval_tasks_through_stages_resume_as_stages(
    make_config, tmp_path, monkeypatch
):
    """A soft prompt (the first stage puts it before the text, the last cuts it off; the
    later stage's weights frozen), curriculum learning's growing length (each new length a
    schedule that learns the stages' shapes again) and eval_tasks (the harness scores through
    the stages, the logits shared by every pipeline rank): stopped at step 2 on 2 stages and
    resumed on 2 stages, training and the tasks' scores equal one process's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path)
    lengths = {"difficulty": [8, 16, 32], "max_step": [1, 2]}
    keys = {
        "soft_prompt_tuning": {"enabled": True, "n_tokens": 4, "init_string": "the"},
        "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen",
                                "min_difficulty": 8, "max_difficulty": 32,
                                "schedule_type": "fixed_discrete", "schedule_config": lengths},
        "eval_tasks": ["local_ppl"],
        "eval_tasks_include_path": str(tmp_path),
        "eval_interval": 4,
    }  # fmt: skip
    cfg = make_config("prompted.yml", train_iters=4, **PP_KEYS, **keys)
    train(cfg, f"save={tmp_path / 'one'}", "load=null")
    moved, stages = tmp_path / "moved", "pipe_parallel_size=2"
    train(cfg, f"save={moved}", f"load={moved}", stages, "exit_interval=2", nproc=2)
    train(cfg, f"save={moved}", f"load={moved}", stages, nproc=2)
    assert_same_training(moved, reference(tmp_path / "one"))
    assert losses(moved, "curriculum_seqlen") == {1: 8, 2: 16, 3: 32, 4: 32}

    def tasks(out):
        return [(r["iteration"], r["eval_tasks"]) for r in metric_rows(out) if "eval_tasks" in r]

    (step, theirs), (_, ours) = *tasks(tmp_path / "one"), *tasks(moved)
    ppl = "word_perplexity"
    assert step == 4 and ours["local_ppl"][ppl] == pytest.approx(theirs["local_ppl"][ppl], rel=1e-5)


def test_pipeline_checkpoint_resumes_as_data_parallel(config, tmp_path, make_config):
    cfg = make_config("pp6.yml", train_iters=6, **PP_KEYS)
    # two pipeline stages, then two data-parallel ranks
    assert_resumes_like_whole(
        cfg, tmp_path, [], ["pipe_parallel_size=2"], 2, ["train_micro_batch_size_per_gpu=1"], 2
    )


@pytest.mark.parametrize("pp", [0, 1])
def test_one_stage_never_builds_a_schedule(config, pp):
    trainer = Trainer(load_config([config], [f"pipe_parallel_size={pp}"]), device="cpu")
    assert trainer.pipeline is None
    assert trainer.derived["pipeline_schedule_runs"] is False
    assert not any("pipelining" in type(m).__module__ for m in trainer.model.modules())


def test_stage_split_is_balanced_and_covers_every_layer(config):
    args = model_args(load_config([config], ["num_layers=10"]))
    for stages in (2, 3, 4, 10):
        ranges = stage_layers(args, stages, "type:transformer")
        assert [i for r in ranges for i in r] == list(range(10))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    tied = model_args(load_config([config], ["num_layers=10", "no_weight_tying=false"]))
    # the embedding weighs on the first stage, and (tied: the head's copy) on the last
    ends = stage_layers(tied, 3, "parameters")
    assert len(ends[1]) > len(ends[0]) and len(ends[1]) > len(ends[2])
    assert rank_stage_indices("zbv", 0, 2, 2) == [0, 3] and rank_stage_indices(
        "interleaved_1f1b", 1, 2, 2
    ) == [1, 3]


def test_parameters_partition_charges_each_block_what_it_holds(config):
    """An MoE layer weighs its experts: 'parameters' costs are each built block's count."""
    args = model_args(load_config([config], ["num_layers=4", "moe_num_experts=4"]))
    args = dataclasses.replace(args, moe_interval=2)
    model = build_model(args)
    built = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    assert layer_costs(args, "parameters") == built
    assert built[0] > built[1]  # layer 0 is an MoE layer, layer 1 a dense one
