"""A model that mixes every layer family (mamba, RWKV-6, gMLP and aMLP, block-sparse and dense
attention) trains as one process does under ZeRO-1, ZeRO-3, pipeline stages and both,
resumes bit for bit and across layouts, decodes from its states as recomputing does, explains
its layers and counts what it builds."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    reference,
    train,
    weights,
)
from torchneox.config.derive import derive
from torchneox.config.load import load_config
from torchneox.inference.generate import Sampling, generate
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

MIX = [[["mamba", "rwkv", "gmlp", "local", "global", "amlp"], 1]]
MIX_KEYS = {
    "num_layers": 6,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "seq_length": 32,
    "attention_config": MIX,
    "sparsity_config": {"block": 8, "num_local_blocks": 2},
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "eval_iters": 1,
    "hidden_dropout": 0.0,
    "num_workers": 0,
    "no_weight_tying": True,
    "gpt_j_residual": False,
}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config("mix.yml", train_iters=3, **MIX_KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("baseline")
    train(config, f"save={tmp_path / 'one'}", "load=null")
    return reference(tmp_path / "one")


def test_the_mix_explains_each_layer_and_counts_what_it_builds(config):
    loaded = load_config([config])
    derived = derive(loaded)
    assert derived["layers"] == "0 mamba, 1 rwkv, 2 gmlp, 3 local, 4 global, 5 amlp"
    attention = derived.reasons["attention"]  # the block-sparse layer is attention too
    assert "on 2 of 6 layers" in attention and "1 of them block-sparse" in attention
    model = build_model(model_args(loaded))
    assert derived["num_parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("loop", ["dynamic", "static"])
def test_decoding_the_mix_from_its_states_equals_recomputing(config, loop):
    """Each family decodes from what it keeps (keys and values, conv, SSM, shift and WKV
    states, cached gates): left-padded prompts give the tokens of recomputing every prefix."""
    model = build_model(model_args(load_config([config])), seed=3).eval()
    with torch.no_grad():  # lively: at GPT-NeoX's init a tiny model repeats its last token
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    cached = generate(model, prompts, Sampling(maximum_tokens=10, decode_loop=loop))
    recomputed = generate(model, prompts, Sampling(maximum_tokens=10, use_cache=False))
    assert cached == recomputed
    assert len({t for row in cached for t in row}) > len(prompts)  # not one token per row


@pytest.mark.parametrize(
    "nproc,overrides",
    [
        (2, ["zero_optimization.stage=1", "train_micro_batch_size_per_gpu=1"]),
        (2, ["zero_optimization.stage=3", "train_micro_batch_size_per_gpu=1"]),
        (2, ["pipe_parallel_size=2"]),
        (4, ["pipe_parallel_size=2", "train_micro_batch_size_per_gpu=1",
             "zero_optimization.stage=3"]),
        (2, ["context_parallel_size=2"]),
    ],
    ids=["zero1", "zero3", "pp2", "dp2-pp2-zero3", "cp2"],
)  # fmt: skip
def test_a_mixed_model_in_every_layout_equals_one_process(
    config, tmp_path, baseline, nproc, overrides
):
    out = tmp_path / "run"
    train(config, f"save={out}", "load=null", *overrides, nproc=nproc)
    assert_same_training(out, baseline)


def test_a_mixed_model_resumes_bit_for_bit(make_config, tmp_path):
    """Stopped at step 3 and resumed, the run's losses and final weights are those of a run
    never stopped, to the bit (every family's state is in the checkpoint)."""
    cfg = make_config("mix6.yml", train_iters=6, **MIX_KEYS)
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    train(cfg, f"save={whole}", "load=null")
    train(cfg, f"save={moved}", f"load={moved}", "exit_interval=3")
    train(cfg, f"save={moved}", f"load={moved}")
    done, after = losses(whole), losses(moved)
    assert [after[k] for k in (4, 5, 6)] == [done[k] for k in (4, 5, 6)]
    resumed = weights(moved)
    for name, tensor in weights(whole).items():
        assert torch.equal(tensor, resumed[name]), name


def test_a_zero3_checkpoint_of_the_mix_resumes_in_one_process(make_config, tmp_path):
    """Stopped at step 3 as two ZeRO-3 ranks, resumed as one process: steps 4-6 are those of
    a run never stopped (every family's sharded state gathers back whole)."""
    cfg = make_config("mix6z.yml", train_iters=6, **MIX_KEYS)
    one = ["train_micro_batch_size_per_gpu=2"]
    zero3 = ["zero_optimization.stage=3", "train_micro_batch_size_per_gpu=1"]
    assert_resumes_like_whole(cfg, tmp_path, one, zero3, 2, one)
