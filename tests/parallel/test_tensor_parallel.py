"""Tensor parallelism on gloo: every tensor-parallel layout (with sequence parallelism,
activation checkpointing, ZeRO stages and data parallelism) gives the losses, gradient norms
and weights of one process, and its checkpoints reshard into other layouts."""

from __future__ import annotations

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    reference,
    train,
)
from torchneox.checkpoint import files as checkpoint_format


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
# ZeRO 1 and 3: ZeRO-2 runs ZeRO-1's code (FSDP2 keeping the gathered weights through
# backward; its parity is tests/parallel/test_data_parallel.py's), and so does ZeRO 0 beside
# tensor parallelism (DDP takes no DTensor: parallel/data_parallel.py)
for stage in (1, 3):
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
    # tied embeddings (GPT-NeoX's default) in the move into tensor parallelism
    untied_only = move == "tp2-to-one"
    cfg = make_config(
        "u6.yml",
        train_micro_batch_size_per_gpu=4,
        train_iters=6,
        no_weight_tying=untied_only,
        **DP_KEYS,
    )
    (first, first_n), (then, then_n) = RESHARDS[move]
    moved = assert_resumes_like_whole(cfg, tmp_path, [], first, first_n, then, then_n)
    assert checkpoint_format.read_meta(moved / "global_step3")["world_size"] == first_n


def test_moe_under_tensor_parallelism_equals_one_process(moe_config, tmp_path):
    train(moe_config, f"save={tmp_path / 'one'}", "load=null")
    baseline = reference(tmp_path / "one")
    train(moe_config, f"save={tmp_path / 'tp'}", "load=null", "model_parallel_size=2", nproc=2)
    assert_same_training(tmp_path / "tp", baseline)


MLA_DEEPSEEK = [
    "pos_emb=rotary",
    "rotary_pct=1.0",
    "norm=rmsnorm",
    "activation=swiglu",
    "mla_kv_lora_rank=24",
    "mla_q_lora_rank=32",
    "mla_qk_nope_head_dim=12",
    "mla_qk_rope_head_dim=8",
    "mla_v_head_dim=16",
    "moe_score_func=sigmoid",
    "moe_renormalize_top_k=true",
    "moe_router_bias_update_rate=0.01",
    "moe_expert_groups=4",
    "moe_topk_groups=2",
    "moe_routed_scaling_factor=2.5",
    "moe_first_dense_layers=1",
    "moe_intermediate_size=32",
    "moe_shared_expert_intermediate_size=32",
    "intermediate_size=96",  # the dense first layer's MLP: 32 wide, split over the ranks
    "num_layers=2",
    "train_iters=2",
]


def test_mla_and_deepseek_v3_moe_under_tensor_parallelism_equal_one_process(moe_config, tmp_path):
    """MLA's heads split over the ranks (its down projections and latents whole, the rotary
    key's gradient summed), beside DeepSeek-V3's experts: dense first layer, group-limited
    sigmoid routing with the bias, scaled gates, a shared expert."""
    train(moe_config, f"save={tmp_path / 'one'}", "load=null", *MLA_DEEPSEEK)
    out = tmp_path / "tp"
    train(moe_config, f"save={out}", "load=null", "model_parallel_size=2", *MLA_DEEPSEEK, nproc=2)
    assert_same_training(out, reference(tmp_path / "one"))


OPTIONS = {
    # ALiBi's slopes and T5's relative table are cut to each rank's heads; learned positions
    # are whole on every rank; tied embeddings: the head reads the embedding's vocabulary
    # shards (with sequence parallelism, the final norm's sequence shards gathered first)
    # use_qk_layernorm: each head's own norm on the rank's heads (Qwen3), or the queries
    # (keys) gathered whole for a norm over all heads (OLMo 2; GPT-NeoX's own)
    "alibi-qk-neox-layernorm": [
        "pos_emb=alibi",
        "use_qk_layernorm=true",
        "norm=layernorm",
        "num_kv_heads=4",
    ],
    # (lm_z_loss: logsumexp over the vocabulary shards, reduced without gathering them)
    "rpe-tied-qk-head-z-loss-sequence-parallel": [
        "no_weight_tying=false",
        "use_qk_layernorm=true",
        "qk_norm_scope=head",
        "lm_z_loss=0.01",
        "pos_emb=rpe",
        "rpe_num_buckets=8",
        "rpe_max_distance=16",
        "sequence_parallel=true",
    ],
    "learned-qk-width-sequence-parallel": [
        "pos_emb=learned",
        "use_qk_layernorm=true",
        "qk_norm_scope=width",
        "sequence_parallel=true",
    ],
    # a soft prompt: the embeddings stay whole until the prompt is put before the text (and
    # the learned positions added), then each rank keeps its slice
    "soft-prompt-learned-sequence-parallel": [
        'soft_prompt_tuning={"enabled": true, "n_tokens": 4}',
        "pos_emb=learned",
        "sequence_parallel=true",
    ],
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_model_options_under_tensor_parallelism_equal_one_process(untied, tmp_path, option):
    keys = [k for k in OPTIONS[option] if not k.startswith("sequence")]
    train(untied, f"save={tmp_path / 'one'}", "load=null", *keys)
    out = tmp_path / "tp"
    train(untied, f"save={out}", "load=null", "model_parallel_size=2", *OPTIONS[option], nproc=2)
    assert_same_training(out, reference(tmp_path / "one"))


def test_relative_positions_resume_from_tensor_parallel_into_one_process(untied, tmp_path):
    rpe = ["pos_emb=rpe", "rpe_num_buckets=8", "rpe_max_distance=16", "train_iters=6"]
    assert_resumes_like_whole(untied, tmp_path, rpe, ["model_parallel_size=2", *rpe], 2, rpe, 1)


def test_fp8_under_tensor_parallelism_trains_like_one_process(untied, tmp_path):
    """fp8_recipe tensorwise on 2 tensor ranks: torchao's float8 styles (casting each layer's
    input and output gradient to fp8 on the DTensor, one scale over the ranks' parts); the
    losses are one process's fp8 losses, the gradient norms within fp8's rounding."""
    keys = ["fp8_recipe=tensorwise", "train_iters=2"]
    train(untied, f"save={tmp_path / 'one'}", "load=null", *keys)
    train(untied, f"save={tmp_path / 'tp'}", "load=null", "model_parallel_size=2", *keys, nproc=2)
    for key, rel in (("lm_loss", 1e-4), ("grad_norm", 1e-2)):
        one, tp = losses(tmp_path / "one", key), losses(tmp_path / "tp", key)
        assert sorted(tp) == sorted(one) == [1, 2]
        assert all(tp[k] == pytest.approx(one[k], rel=rel) for k in one), (key, one, tp)
