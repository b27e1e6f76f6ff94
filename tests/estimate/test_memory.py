"""The estimator's parameter, gradient and optimizer bytes per rank equal what training
processes hold, for data, tensor and combined layouts and each ZeRO stage, and for
mixture-of-experts models with and without expert parallelism (and with MLA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchneox.config.load import load_config
from torchneox.estimate.search import estimate

PROBE = Path(__file__).with_name("memory_probe.py")

MOE = ["moe_num_experts=4", "moe_top_k=2", "moe_expert_interval=2"]
# (the suite's budget: ZeRO-1 is held beside tensor parallelism, where its shards are a tensor
# rank's, and tensor parallelism only there; the expert axis only at ZeRO-3, where ZeRO shards
# the other weights and leaves the experts alone; MoE under tensor parallelism in MLA's model)
LAYOUTS = {
    "dp2-zero0": (2, ["zero_optimization.stage=0"]),
    "dp2-zero3": (2, ["zero_optimization.stage=3"]),
    "dp2-tp2-zero1": (4, ["model_parallel_size=2", "zero_optimization.stage=1"]),
    # mixture of experts: experts sharded by ZeRO like any weight, or split over the expert
    # axis and left alone by ZeRO/DDP, or whole on every tensor rank
    "moe-dp2-ep2-zero3": (2, [*MOE, "expert_parallel_size=2", "zero_optimization.stage=3"]),
    # MLA (its down projections whole on each tensor rank, the up projections split by heads)
    # with DeepSeek-V3's experts of their own width, a shared expert and the router bias
    "mla-moe-tp2": (
        2,
        [
            *MOE,
            *("pos_emb=rotary", "rotary_pct=1.0", "mla_kv_lora_rank=24", "mla_qk_nope_head_dim=12"),
            *("mla_qk_rope_head_dim=8", "mla_v_head_dim=16", "moe_intermediate_size=16"),
            *("moe_shared_expert_intermediate_size=32", "moe_router_bias_update_rate=0.01"),
            "moe_router_type=topk",
            *("model_parallel_size=2", "train_micro_batch_size_per_gpu=4"),
        ],
    ),
}


def probe(cfg: str, out: Path, nproc: int, overrides: list[str]) -> dict:
    """What rank 0 of a run of ``cfg`` holds after one step (see memory_probe.py)."""
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(PROBE), cfg, str(out), *overrides],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "rank0.json").read_text()) | json.loads(
        (out / "activations0.json").read_text()
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimated_bytes_per_rank_equal_the_processes(make_config, tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    cfg = make_config(
        train_batch_size=8,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        hidden_size=48,  # 48 x 4 = 192 rows: not a multiple of every shard count
        num_attention_heads=4,
        no_weight_tying=True,
        activation="swiglu",
        hidden_dropout=0.0,
        num_workers=0,
    )
    measured = probe(cfg, tmp_path / "probe", nproc, overrides)
    measured.pop("activations")
    est = estimate(load_config([cfg], overrides), gpus=nproc, gpu="h100")
    assert est["resident_bytes"] == measured


@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [
        (1, []),
        (4, ["context_parallel_size=2", "zero_optimization.stage=1"]),  # x data parallel 2
    ],
    ids=["one", "cp2-dp2"],
)
def test_activation_memory_per_rank_within_ten_percent(make_config, tmp_path, nproc, overrides):
    """With context parallelism a rank keeps its share of the tokens' activations and every
    layer's gathered keys and values: the estimate is within 10% of what autograd saves."""
    cfg = make_config(
        seq_length=256,
        hidden_size=64,
        num_attention_heads=4,
        no_weight_tying=True,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    measured = probe(cfg, tmp_path / "probe", nproc, overrides)["activations"]
    est = estimate(load_config([cfg], overrides), gpus=nproc, gpu="h100")
    assert est["activations_after_forward_bytes"] == pytest.approx(measured, rel=0.10)


def test_activation_memory_of_every_layer_family_within_ten_percent(make_config, tmp_path):
    """Each family's layer is traced on its own (a mamba scan keeps other tensors than
    attention): the estimate of a model mixing them is within 10% of what autograd saves."""
    cfg = make_config(
        seq_length=128,
        hidden_size=64,
        num_attention_heads=4,
        num_layers=4,
        attention_config=[[["mamba", "rwkv", "gmlp", "global"], 1]],
        no_weight_tying=True,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    measured = probe(cfg, tmp_path / "probe", 1, [])["activations"]
    est = estimate(load_config([cfg]), gpus=1, gpu="h100")
    assert est["activations_after_forward_bytes"] == pytest.approx(measured, rel=0.10)
