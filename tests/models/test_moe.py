"""Mixture of experts: grouped GEMMs equal the per-expert loop, every token reaches its top-k
experts (dropless), the load-balancing loss is Switch's, and an MoE model trains, resumes
exactly and gives one process's losses under tensor parallelism (the seed report's config,
scaled down)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import shared_dir
from tests.helpers import metric_rows, train
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.moe import MoE, balancing_loss, expert_grouped, expert_loop, sinkhorn
from torchneox.models.transformer import build_model

KEYS = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "pos_emb": "rotary",
    "no_weight_tying": True,
    "padded_vocab_size": 128,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_expert_interval": 2,
}


def moe_model(**extra):
    return build_model(model_args(load_mapping(KEYS | extra, "moe")), seed=0)


def test_parameter_count_is_what_explain_says():
    loaded = load_mapping(KEYS, "moe")
    model = build_model(model_args(loaded), seed=0)
    d = derive(loaded)
    assert sum(p.numel() for p in model.parameters()) == d["num_parameters"]
    assert sum(isinstance(m, MoE) for m in model.modules()) == 2  # layers 0 and 2
    assert d["num_active_parameters"] < d["num_parameters"]


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_equals_the_loop(bias):
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]  # an expert with no tokens included
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, 24, generator=g, requires_grad=True)
    b = torch.randn(4, 24, generator=g, requires_grad=True) if bias else None
    grads = []
    for run in (expert_loop, expert_grouped):
        y = run(x, w, counts, b)
        y.backward(torch.ones_like(y) * torch.arange(24.0))
        grads.append([t.grad.clone() for t in (x, w, b) if t is not None])
        for t in (x, w, b):
            if t is not None:
                t.grad = None
    torch.testing.assert_close(expert_loop(x, w, counts, b), expert_grouped(x, w, counts, b))
    for a, c in zip(*grads, strict=True):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("router", ["topk", "sinkhorn"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_every_token_reaches_its_experts(router, activation):
    model = moe_model(moe_router_type=router, activation=activation)
    moe = model.layers["0"].mlp
    moe.eval()
    x = torch.randn(3, 10, 64)
    with torch.no_grad():
        out, stats = moe(x)
        experts, gates, _ = moe.route(x.reshape(-1, 64))
        want = torch.zeros(30, 64)
        for t, row in enumerate(x.reshape(-1, 64)):
            for k in range(moe.top_k):
                e = experts[t, k]
                up = row @ moe.experts_up[e] + moe.experts_up_bias[e]
                if moe.experts_gate is not None:
                    h = moe.act(row @ moe.experts_gate[e] + moe.experts_gate_bias[e]) * up
                else:
                    h = moe.act(up)
                want[t] += gates[t, k] * (h @ moe.experts_down[e] + moe.experts_down_bias[e])
    torch.testing.assert_close(out.reshape(-1, 64), want, rtol=1e-4, atol=1e-5)
    assert int(stats.tokens_per_expert.sum()) == 30 * moe.top_k  # nothing dropped


def test_load_balancing_loss_is_switch_s():
    moe = moe_model(moe_router_type="topk").layers["0"].mlp
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform probabilities: balanced in expectation
    _, stats = moe(torch.randn(4, 16, 64))
    # E x sum_e share_e x 1/E = sum_e share_e = 1
    assert balancing_loss(stats).item() == pytest.approx(1.0)
    x = torch.randn(64, 64)
    _, stats = moe(x)
    probs = moe.router(x).softmax(-1)
    share = stats.tokens_per_expert.float() / (64 * moe.top_k)
    want = 8 * (share * probs.mean(0)).sum().item()
    assert balancing_loss(stats).item() == pytest.approx(want, rel=1e-5)


def test_sinkhorn_balances_skewed_scores():
    logits = torch.randn(512, 8) + torch.tensor([3.0, 0, 0, 0, 0, 0, 0, 0])
    skewed = torch.bincount(logits.argmax(-1), minlength=8)
    balanced = torch.bincount(sinkhorn(logits).argmax(-1), minlength=8)
    assert skewed.max() > 300 and balanced.max() < 2 * 512 / 8


def gpt_neox_sinkhorn(cost: np.ndarray, tol: float = 1e-4, max_iter: int = 3) -> np.ndarray:
    """GPT-NeoX's SinkhornRouter.sinkhorn (megatron/model/router.py at ea7aefd), in numpy."""
    cost = np.exp(cost)
    d0 = np.ones(cost.shape[0], dtype=cost.dtype)
    d1 = 1 / (cost.shape[1] * cost.sum(0))
    d1_old = d1
    for _ in range(max_iter):
        d0 = (1 / d0.shape[0]) / ((d1 * cost).sum(1) + 1e-8)
        d1 = (1 / d1.shape[0]) / ((d0[:, None] * cost).sum(0) + 1e-8)
        error = np.abs(d1_old - d1).mean()
        d1_old = d1
        if error < tol:
            break
    return d1 * cost * d0[:, None]


@pytest.mark.parametrize("scale", [0.01, 1.0, 3.0])  # near-uniform logits stop after one round
def test_sinkhorn_is_gpt_neox_sinkhorn(scale):
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) * scale
    want = gpt_neox_sinkhorn(logits.numpy().astype(np.float32))
    np.testing.assert_allclose(sinkhorn(logits).numpy(), want, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_router_scores_as_gpt_neox(k):
    """k = 1 weighs the chosen expert by the sigmoid of its logit, k > 1 by the softmax; in
    training the choice comes from the balanced logits, in evaluation from the scores."""
    moe = moe_model(moe_router_type="sinkhorn", moe_top_k=k).layers["0"].mlp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    logits = moe.router(x).float()
    scores = torch.sigmoid(logits) if k == 1 else logits.softmax(-1)
    for training in (True, False):
        moe.train(training)
        experts, gates, _ = moe.route(x)
        chooser = sinkhorn(logits.detach()) if training else scores
        assert torch.equal(experts, chooser.topk(k, dim=-1).indices)
        torch.testing.assert_close(gates, scores.gather(-1, experts))


def test_jitter_is_only_for_the_topk_router():
    moe = moe_model(moe_router_type="sinkhorn", moe_jitter_eps=0.5).layers["0"].mlp
    moe.train()
    x = torch.randn(64, 64)
    assert torch.equal(moe.route(x)[0], moe.route(x)[0])  # GPT-NeoX's Sinkhorn has no jitter


def test_moe_model_trains_and_reports_routing(moe_config, tmp_path):
    assert main(["train", moe_config, "--set", f"save={tmp_path / 'm'}", "--set", "load=null"]) == 0
    rows = metric_rows(tmp_path / "m")
    steps = [r for r in rows if "lm_loss" in r]
    assert steps[-1]["lm_loss"] < steps[0]["lm_loss"]
    for r in steps:
        assert 0.9 < r["moe_aux_loss"] < 2.0
        counts = r["moe_tokens_per_expert"]
        assert len(counts) == 4 and all(len(c) == 8 for c in counts)  # every layer (interval 1)
        assert all(sum(c) == 8 * 32 * 2 for c in counts)  # every token, twice (top-2)


def test_moe_resumes_exactly(moe_config, tmp_path):
    train(moe_config, f"save={tmp_path / 'whole'}", "load=null")
    run = tmp_path / "split"
    train(moe_config, f"save={run}", f"load={run}", "exit_interval=3")
    train(moe_config, f"save={run}", f"load={run}")
    whole = metric_rows(tmp_path / "whole")
    split = metric_rows(run)
    a = {r["iteration"]: r["lm_loss"] for r in whole if "lm_loss" in r}
    b = {r["iteration"]: r["lm_loss"] for r in split if "lm_loss" in r}
    assert a == b  # bitwise


def test_moe_export_to_hugging_face_is_refused(moe_config, tmp_path, capsys):
    assert main(["train", moe_config, "--set", f"save={tmp_path / 'm'}", "--set", "load=null",
                 "--set", "train_iters=1"]) == 0  # fmt: skip
    assert main(["convert", "to-hf", str(tmp_path / "m"), str(tmp_path / "hf")]) == 2
    assert "mixture-of-experts layers" in capsys.readouterr().err


def test_jitter_perturbs_routing_only_while_training():
    moe = moe_model(moe_router_type="topk", moe_jitter_eps=0.5).layers["0"].mlp
    x = torch.randn(64, 64)
    moe.train()
    first, second = moe.route(x)[0], moe.route(x)[0]
    assert not torch.equal(first, second)  # noisy inputs pick other experts now and then
    moe.eval()
    assert torch.equal(moe.route(x)[0], moe.route(x)[0])


def test_the_seed_report_config_trains_scaled_down(tmp_path, tiny_data):
    """The MoE config quoted in the seed report (8 experts, model_parallel_size 2,
    pipe_parallel_size 1), as it is, with only the sizes and the data changed."""
    from tests.helpers import seed_config

    if shared_dir() is None:
        pytest.skip("needs ../shared (the seed report)")
    sizes = [
        "num_layers=2",
        "hidden_size=64",
        "num_attention_heads=4",
        "seq_length=32",
        "max_position_embeddings=32",
        "tokenizer_type=CharLevelTokenizer",
        f"data_path={tiny_data}",
        f"save={tmp_path / 'run'}",
        "eval_iters=1",
    ]
    train(str(seed_config(tmp_path)), *sizes, nproc=2)
    rows = metric_rows(tmp_path / "run")
    steps = [r for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5]  # train_iters 5, as the config says
    assert all(len(r["moe_tokens_per_expert"][0]) == 8 for r in steps)
