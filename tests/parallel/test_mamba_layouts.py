"""Mamba under ZeRO-3's bf16 gathers (A_log and D stay fp32) and pipeline stages weighed by
its own parameters (2 processes equal 1 under ZeRO-1, ZeRO-3 and pipeline stages, and resuming
bit for bit: tests/parallel/test_layer_families.py, whose model has a mamba layer among every
other family)."""

from __future__ import annotations

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_bitwise,
    assert_same_training,
    losses,
    reference,
    train,
)

# Adam's eps 1e-6: an element whose gradient is float noise (~1e-10, the layouts' summation
# orders) moves by lr x 1e-4, not lr x 1e-2 (eps 1e-8), so three steps stay within the parity
# tolerances with RWKV's low-rank weights beside the other families
ADAM_EPS_1E6 = {"type": "Adam", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-6}}
MIXED = {"attention_config": [[["mamba", "global"], 1]], "no_weight_tying": True}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(
        "mamba.yml", train_micro_batch_size_per_gpu=2, train_iters=4, **DP_KEYS, **MIXED
    )


def test_bf16_gathers_keep_a_log_and_d_in_fp32(config, tmp_path):
    """ZeRO-3 gathering weights in bf16: with mamba_selective_fp32_params (the default) the
    mixers are gathered in fp32, so the run differs from one gathering them in bf16 (which
    runs too: the scan reads every parameter in fp32)."""
    runs = []
    for flag in ("true", "false"):
        out = tmp_path / flag
        train(
            config, f"save={out}", "load=null", "precision=bfloat16", "zero_param_dtype=bf16",
            "zero_optimization.stage=3", f"mamba_selective_fp32_params={flag}", "train_iters=2",
            "eval_iters=0", nproc=2,
        )  # fmt: skip
        runs.append(losses(out))
    assert runs[0] != runs[1]


def test_stages_weigh_mamba_layers_by_their_parameters():
    """pipe_partition_method parameters: a mamba layer (3 h d_inner + ...) weighs less than an
    attention block with its MLP (12 h^2 at 4h): 2 attention then 6 mamba layers split 3 | 5
    (counted as attention blocks: 4 | 4)."""
    from tests.helpers import BASE
    from torchneox.config.load import load_mapping
    from torchneox.models.args import model_args
    from torchneox.parallel.pipeline import stage_layers

    mixed = {"num_layers": 8, "attention_config": [[["global"], 2], [["mamba"], 6]]}
    args = model_args(load_mapping(BASE | mixed, "test"))
    first, second = stage_layers(args, 2, "parameters")
    assert (len(first), len(second)) == (3, 5)


def test_mamba_gmlp_and_rwkv_layers_split_over_tensor_ranks_equal_one_process(
    make_config, tmp_path
):
    """model_parallel_size 2: mamba's in_proj (x and z each by channels), convolution, dt,
    A_log and D, gMLP's and aMLP's halves, gate and tiny attention's output split by
    channels, and RWKV's time mix by heads (its decay, bonus and GroupNorm too) and channel mix
    by width: loss and gradient norm at every step are one process's; stopped after step 2,
    the run resumes on 2 tensor ranks to the bit; with sequence parallelism too."""
    cfg = make_config(
        "tp.yml", train_iters=3, num_layers=5, train_micro_batch_size_per_gpu=2, seq_length=32,
        attention_config=[[["mamba", "gmlp", "global", "amlp", "rwkv"], 1]],
        no_weight_tying=True, gradient_accumulation_steps=2, eval_iters=1, hidden_dropout=0.0,
        num_workers=0, optimizer=ADAM_EPS_1E6,
    )  # fmt: skip
    one, split = tmp_path / "one", tmp_path / "tp"
    train(cfg, f"save={one}", "load=null")
    tp = ["model_parallel_size=2"]
    train(cfg, f"save={split}", "load=null", "checkpoint_factor=2", *tp, nproc=2)
    assert_same_training(split, reference(one))
    assert_resumes_bitwise(cfg, split, 2, tp, nproc=2)
    # with sequence parallelism: the norms on each rank's slice, each mixer reading the
    # sequence gathered whole and its output reduce-scattered back to the slices (RWKV's
    # channel mix: its rank's slice of the gated product)
    sp = tmp_path / "sp"
    train(cfg, f"save={sp}", "load=null", *tp, "sequence_parallel=true", nproc=2)
    assert_same_training(sp, reference(one))
