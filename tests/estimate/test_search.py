"""`torchneox estimate`: GPT-NeoX-20B's real layout fits its real hardware; too few GPUs do
not, and every layout offered instead fits when estimated again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.estimate.memory import GIB
from torchneox.estimate.search import estimate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NEOX_20B = str(CONFIGS / "neox-20b.yml")


def test_neox_20b_fits_the_96_a100s_it_trained_on():
    est = estimate(load_config([NEOX_20B]), gpus=96, gpu="a100-40gb", nodes=12)
    assert est["num_parameters"] == 20_554_567_680  # the published count
    assert (est["layout"]["dp"], est["layout"]["tp"], est["layout"]["pp"]) == (12, 2, 4)
    assert est["fits"] is True
    mem = est["memory_per_rank_bytes"]
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    assert 30 * GIB < mem["total"] < 40 * GIB
    acts = est["activations_by_checkpointing_bytes"]
    assert acts["full"] < acts["selective"] < acts["none"]
    assert "alternatives" not in est


def test_too_few_gpus_do_not_fit_and_the_offered_layouts_do():
    loaded = load_config([NEOX_20B])
    est = estimate(loaded, gpus=32, gpu="a100-40gb", nodes=4)
    assert est["fits"] is False
    assert est["alternatives"]
    for alt in est["alternatives"]:
        overrides = [f"{k}={json.dumps(v)}" for k, v in alt["changes"].items()]
        again = estimate(load_config([NEOX_20B], overrides), gpus=32, gpu="a100-40gb", nodes=4)
        assert again["fits"] is True, alt
        assert again["memory_per_rank_bytes"]["total"] == alt["memory_per_rank_bytes"]
    sizes = [len(a["changes"]) for a in est["alternatives"]]
    assert sizes == sorted(sizes)  # fewest changes first


def test_json_output_has_the_stable_keys(capsys):
    assert (
        main(
            ["estimate", NEOX_20B, "--gpus", "96", "--nodes", "12", "--gpu", "a100-40gb", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    for key in (
        "num_parameters",
        "flops_per_token",
        "memory_per_rank_bytes",
        "fits",
        "step_time_s",
    ):
        assert key in out
    for part in ("parameters", "gradients", "optimizer", "activations", "temporary", "total"):
        assert part in out["memory_per_rank_bytes"]
    # step time at the stated MFU: model FLOPs / (GPUs x peak x MFU), slowed by the bubble and
    # the recomputation of full checkpointing
    ideal = out["flops_per_step"] / (96 * 312e12 * 0.4)
    bubble = 1 - 3 / (32 + 3)
    assert out["step_time_s"] == pytest.approx(ideal / bubble * 4 / 3)


def test_text_output_and_bad_arguments(capsys):
    assert main(["estimate", NEOX_20B, "--gpus", "32", "--nodes", "4", "--gpu", "a100-40gb"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "layouts that fit" in out and "--set " in out
    assert main(["estimate", NEOX_20B, "--gpus", "96", "--gpu", "tpu-v9"]) == 2
    assert "--gpu 'tpu-v9' is not one of" in capsys.readouterr().err
    assert main(["estimate", NEOX_20B, "--gpus", "10", "--nodes", "4"]) == 2


MOE = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "seq_length": 512,
    "pos_emb": "rotary",
    "no_weight_tying": True,
    "padded_vocab_size": 1024,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_expert_interval": 2,
    "train_micro_batch_size_per_gpu": 4,
    "precision": "bfloat16",
}


def moe_config(tmp_path, **changes) -> str:
    path = tmp_path / ("moe" + "".join(f"-{k}-{v}" for k, v in changes.items()) + ".yml")
    path.write_text(json.dumps(MOE | changes))
    return str(path)


def moe_estimate(tmp_path, **changes):
    return estimate(load_config([moe_config(tmp_path, **changes)]), gpus=4, gpu="h100")


def test_moe_models_are_estimated(tmp_path, capsys):
    from torchneox.estimate.parameters import meta_model as _meta_model

    est = moe_estimate(tmp_path)
    _, model = _meta_model(load_config([moe_config(tmp_path)]), 1024)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts_" in n)
    assert est["num_parameters"] == sum(p.numel() for p in model.parameters())
    # each token reaches top_k of the 8 experts
    assert est["active_parameters"] == est["num_parameters"] - experts * (8 - 2) // 8

    # expert parallelism over 2 of the 4 data ranks halves the expert weights each holds (DDP)
    ep = moe_estimate(tmp_path, expert_parallel_size=2)
    saved = est["resident_bytes"]["parameter_shard"] - ep["resident_bytes"]["parameter_shard"]
    assert saved == experts // 2 * 4

    # experts process tokens x top_k rows: top-2 holds more activations than top-1, and a dense
    # model less than either
    top1 = moe_estimate(tmp_path, moe_top_k=1)["activations_after_forward_bytes"]
    dense = moe_estimate(tmp_path, moe_num_experts=1)["activations_after_forward_bytes"]
    assert dense < top1 < est["activations_after_forward_bytes"]

    assert main(["estimate", moe_config(tmp_path), "--gpus", "4"]) == 0
    assert "reach each token" in capsys.readouterr().out
    # through pipeline stages: each stage holds its own layers' experts
    staged = moe_estimate(tmp_path, pipe_parallel_size=2, gradient_accumulation_steps=2)
    held = staged["resident_bytes"]["parameter_shard"]
    assert 0 < held < est["resident_bytes"]["parameter_shard"]


def test_hybrid_sharding_shards_over_one_group_and_is_a_candidate_across_nodes():
    """mics_shard_size: ZeRO's shards span one group of data-parallel ranks, so each rank holds
    dp / group times more optimizer state; on several nodes the layout search also tries
    sharding within a node."""
    full = estimate(load_config([NEOX_20B]), gpus=96, gpu="a100-40gb", nodes=12)
    hybrid = estimate(
        load_config([NEOX_20B], ["zero_optimization.mics_shard_size=4"]),
        gpus=96,
        gpu="a100-40gb",
        nodes=12,
    )
    assert hybrid["layout"]["dp_shard"] == 4 and full["layout"]["dp"] == 12
    ratio = (
        hybrid["memory_per_rank_bytes"]["optimizer"] / full["memory_per_rank_bytes"]["optimizer"]
    )
    assert ratio == pytest.approx(3, rel=0.02)
    # the search's candidates on 12 nodes of 8 (tp 2): ZeRO over all 12 ranks, or within a node's 4
    from torchneox.config.derive import derive
    from torchneox.config.layout import Layout
    from torchneox.estimate.search import _shard_groups

    loaded = load_config([NEOX_20B])
    layout = Layout.from_derived(loaded.config, derive(loaded, world_size=96))
    assert (layout.dp, layout.tp) == (12, 2)
    assert _shard_groups(layout, per_node=8, nodes=12) == [None, 4]
    assert _shard_groups(layout, per_node=8, nodes=1) == [None]
