"""torchneox's routing options (issue 62): sigmoid scores, DeepSeek-V3's auxiliary-loss-free
balancing bias, shared experts with Qwen2-MoE's gate. Each equals a hand-written reference; the
bias moves by DeepSeek-V3's rule, is saved and resumes bitwise; the defaults change nothing."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import (
    assert_same_training,
    metric_rows,
    reference,
    train,
    trained_once,
    weights,
)
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.moe import MoE, update_router_bias
from torchneox.models.transformer import build_model

KEYS = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 16,
    "pos_emb": "rotary",
    "no_weight_tying": True,
    "padded_vocab_size": 64,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_router_type": "topk",
    "activation": "swiglu",
    "intermediate_size": 48,
    "use_bias_in_mlp": False,
}
OPTIONS = {
    "moe_score_func": "sigmoid",
    "moe_router_bias_update_rate": 0.01,
    "moe_renormalize_top_k": True,
    "moe_shared_expert_intermediate_size": 24,
    "moe_shared_expert_gate": True,
}


def moe_layer(**extra) -> MoE:
    model = build_model(model_args(load_mapping(KEYS | extra, "moe")), seed=0)
    return model.layers["0"].mlp


def test_the_bias_moves_by_deepseek_v3_s_rule():
    """Over-loaded experts down by the rate, under-loaded up, one at the mean unchanged."""
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    load = torch.tensor([10, 2, 5, 3])  # mean 5
    update_router_bias(bias, load, 0.1)
    torch.testing.assert_close(bias, torch.tensor([0.4, 0.1, -0.25, 0.1]), rtol=0, atol=1e-7)
    moe = moe_layer(moe_router_bias_update_rate=0.001)
    moe.update_router_bias(torch.tensor([0, 0, 8, 0]))  # mean 2
    torch.testing.assert_close(moe.router_bias, torch.tensor([1e-3, 1e-3, -1e-3, 1e-3]))


def _expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Routed expert ``e`` written out (swiglu)."""
    gate, up = x @ moe.experts_gate[e], x @ moe.experts_up[e]
    return (F.silu(gate) * up) @ moe.experts_down[e]


@pytest.mark.parametrize("renormalize", [False, True])
def test_sigmoid_routing_with_the_bias_equals_a_hand_written_reference(renormalize):
    moe = moe_layer(**OPTIONS | {"moe_renormalize_top_k": renormalize})
    moe.eval()
    moe.router_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, stats = moe(x)
        want = torch.zeros_like(x)
        for t in range(12):
            scores = torch.sigmoid(x[t] @ moe.router.weight.T)
            chosen = (scores + moe.router_bias).topk(2).indices  # the bias picks ...
            gates = scores[chosen]  # ... the scores alone weight
            if renormalize:
                gates = gates / gates.sum()
            for g, e in zip(gates, chosen, strict=True):
                want[t] += g * _expert(moe, int(e), x[t])
            shared = moe.shared_expert
            s = shared.down(F.silu(shared.gate(x[t])) * shared.up(x[t]))
            want[t] += torch.sigmoid(moe.shared_expert_gate(x[t])) * s
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert int(stats.tokens_per_expert.sum()) == 24
    scores = torch.sigmoid(x @ moe.router.weight.T)
    torch.testing.assert_close(stats.prob_sum, (scores / scores.sum(-1, keepdim=True)).sum(0))


def test_the_bias_steers_selection_not_the_weights():
    moe = moe_layer(moe_router_bias_update_rate=0.01)
    moe.router_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    x = torch.randn(20, 32)
    experts, gates, probs = moe.route(x)
    assert (experts == 3).any(-1).all()  # every token sent to the biased expert
    torch.testing.assert_close(gates, probs.gather(-1, experts))  # softmax, no bias in it


def test_the_defaults_add_nothing():
    """GPT-NeoX's MoE layer: no bias buffer, no shared expert, the state dict unchanged."""
    moe = moe_layer()
    assert moe.router_bias is None and moe.shared_expert is None
    assert moe.shared_expert_gate is None
    names = set(moe.state_dict())
    assert names == {"router.weight", "experts_up", "experts_gate", "experts_down"}


def test_explain_counts_the_shared_expert():
    loaded = load_mapping(KEYS | OPTIONS, "moe")
    model = build_model(model_args(loaded), seed=0)
    d = derive(loaded)
    assert sum(p.numel() for p in model.parameters()) == d["num_parameters"]
    shared = 2 * (3 * 32 * 24 + 32)  # up, gate, down and the gate's [1, 32]; both layers
    base = load_mapping(KEYS, "moe")
    assert d["num_parameters"] - derive(base)["num_parameters"] == shared
    assert d["num_active_parameters"] - derive(base)["num_active_parameters"] == shared


@pytest.mark.parametrize(
    "extra, blamed",
    [
        ({"moe_router_type": "sinkhorn", "moe_score_func": "sigmoid"}, "moe_score_func"),
        ({"moe_router_type": "sinkhorn", "moe_router_bias_update_rate": 0.1}, "moe_router_bias"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate"),
        ({"moe_router_bias_update_rate": -1.0}, "moe_router_bias_update_rate"),
    ],
)
def test_combinations_that_cannot_work_are_refused(make_config, capsys, extra, blamed):
    config = make_config(**KEYS | extra)
    assert main(["config", "explain", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and blamed in err[0]


def test_a_run_with_the_bias_logs_it_and_resumes_bitwise(make_config, tmp_path):
    config = make_config(
        **KEYS | OPTIONS | {"moe_router_bias_update_rate": 0.01, "padded_vocab_size": 512},
        train_batch_size=4,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
    )
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(config, f"save={whole}", "load=null")
    train(config, f"save={split}", f"load={split}", "exit_interval=3")
    train(config, f"save={split}", f"load={split}")
    rows = [r for r in metric_rows(whole) if "lm_loss" in r]
    assert all(len(r["moe_router_bias"]) == 2 and len(r["moe_router_bias"][0]) == 4 for r in rows)
    assert all(r["moe_max_load"] >= 1.0 for r in rows)
    # step 1's bias: the rule applied to step 1's load, from zero
    load = torch.tensor(rows[0]["moe_tokens_per_expert"][0], dtype=torch.float64)
    want = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(torch.tensor(rows[0]["moe_router_bias"][0]), want.float())
    a = {r["iteration"]: r["lm_loss"] for r in rows}
    b = {r["iteration"]: r["lm_loss"] for r in metric_rows(split) if "lm_loss" in r}
    assert a == b  # bitwise
    w_whole, w_split = weights(whole), weights(split)
    for layer in (0, 1):  # saved: the bias after the last step, as logged, in both runs
        saved = w_whole[f"layers.{layer}.mlp.router_bias"]
        assert torch.equal(saved, w_split[f"layers.{layer}.mlp.router_bias"])
        assert torch.equal(saved, torch.tensor(rows[-1]["moe_router_bias"][layer]))


def test_the_bias_and_the_shared_expert_under_expert_parallelism_equal_one_process(
    make_config, tmp_path
):
    """dp2 x ep2: the load summed over the ranks moves every rank's bias as one process's; the
    shared expert is dense (reduced by DDP, not split over ep). (Under tensor parallelism the
    shared expert is whole on each tensor rank, as the routed experts are, whose tensor-parallel
    parity tests/parallel/test_tensor_parallel.py holds.)"""
    config = make_config(
        **KEYS | OPTIONS | {"padded_vocab_size": 512, "moe_aux_loss_coeff": 0.1},
        train_batch_size=4,
        train_micro_batch_size_per_gpu=4,  # the balancing loss sees the global batch at once
        gradient_accumulation_steps=1,
        train_iters=4,
    )
    one, out = trained_once(config), tmp_path / "dp2-ep2"
    layout = ["expert_parallel_size=2", "train_micro_batch_size_per_gpu=2"]
    train(config, f"save={out}", "load=null", *layout, nproc=2)
    assert_same_training(out, reference(one))
    rows = {r["iteration"]: r for r in metric_rows(one) if "lm_loss" in r}
    for r in metric_rows(out):
        if "lm_loss" in r:
            assert r["moe_router_bias"] == rows[r["iteration"]]["moe_router_bias"]
