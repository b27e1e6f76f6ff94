"""Multi-token prediction (issue 62, DeepSeek-V3's MTP): the loss equals a hand-written
reference at depths 1 and 2; `config explain` counts the modules; the layouts that cannot carry
it are refused in one line (two modules under a zero-bubble schedule); a run saves and resumes it bitwise, and through two pipeline stages
(the last stage holding a copy of the embedding) it trains as one process does."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import assert_same_training, losses, metric_rows, reference, train, weights
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.block import Block
from torchneox.models.mixers.attention import AttentionBias
from torchneox.models.transformer import build_model
from torchneox.train.objectives import LanguageModeling

KEYS = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 16,
    "pos_emb": "rotary",
    "norm": "rmsnorm",
    "no_weight_tying": True,
    "padded_vocab_size": 64,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _masked_mean(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (ce * keep.flatten()).sum() / keep.sum()


@pytest.mark.parametrize("depth", [1, 2])
def test_the_mtp_loss_equals_a_hand_written_reference(depth):
    """Depth k reads the previous depth's hidden state and the embedding of the token k ahead,
    and predicts the label k ahead, under the loss mask moved alike (eod_mask_loss here); the
    objective is the next-token loss + lambda / D x the depths' losses."""
    model = build_model(model_args(load_mapping(KEYS | {"mtp_num_layers": depth}, "mtp")), seed=3)
    eod, lam = 5, 0.3
    tokens = torch.randint(6, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens[0, 4], tokens[1, 12] = eod, eod
    lm = LanguageModeling(eod_id=eod, mtp_depth=depth, mtp_weight=lam)
    prep = lm.prepare(tokens)
    seen = {}
    model.layers["1"].register_forward_hook(lambda m, i, out: seen.update(h=out[0]))
    terms = lm.terms(model(prep.inputs, mtp_tokens_BT=prep.inputs), prep)

    x, y, keep = tokens[:, :-1], tokens[:, 1:], (tokens[:, :-1] != eod).float()
    eps, t = model.args.norm_eps, x.shape[1]
    head, embed = model.output.weight, model.embed.weight
    h = seen["h"]
    main = _masked_mean(_rms(h, model.final_norm.weight, eps) @ head.T, y, keep)
    depth_losses = []
    with torch.no_grad():
        for k in range(1, depth + 1):  # only the positions with a token k ahead: t - k of them
            layer = model.mtp[str(k - 1)]
            ahead = _rms(embed[x[:, k:]], layer.enorm.weight, eps)
            joined = torch.cat([ahead, _rms(h[:, : t - k], layer.hnorm.weight, eps)], -1)
            rope = (model.rope_cos[: t - k], model.rope_sin[: t - k])
            h, _ = Block.forward(
                layer, joined @ layer.eh_proj.weight.T, rope, AttentionBias(None, is_causal=True)
            )
            logits = _rms(h, layer.shared_head.norm.weight, eps) @ head.T
            depth_losses.append(_masked_mean(logits, y[:, k:], keep[:, k:]))
    torch.testing.assert_close(terms.loss, main)
    for k, want in enumerate(depth_losses, start=1):
        torch.testing.assert_close(terms.metrics[f"mtp_loss_{k}"], want)
    want = main + lam / depth * torch.stack(depth_losses).sum()
    torch.testing.assert_close(terms.objective, want)
    terms.objective.backward()  # every module trains, the shared embedding from both uses
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())


def test_explain_counts_the_modules_and_generation_leaves_them_out():
    loaded = load_mapping(KEYS | {"mtp_num_layers": 2}, "mtp")
    model = build_model(model_args(loaded), seed=0)
    d = derive(loaded)
    assert sum(p.numel() for p in model.parameters()) == d["num_parameters"]
    base = derive(load_mapping(KEYS, "mtp"))
    h, v = 32, 64
    block = (d["num_parameters"] - base["num_parameters"]) // 2 - (3 * h + 2 * h * h)
    assert block == sum(p.numel() for p in model.layers["1"].parameters())
    # each module: 2 FLOPs per weight (its block's, eh_proj's, the shared head's) and scores
    per_module = (base["flops_per_token"] - 3 * 2 * h * v) // 2 + 3 * 2 * (2 * h * h + h * v)
    assert d["flops_per_token"] - base["flops_per_token"] == 2 * per_module
    tokens = torch.randint(0, 64, (1, 8))
    assert torch.equal(model(tokens), model(tokens, mtp_tokens_BT=tokens)[0])


@pytest.mark.parametrize(
    "extra, cause",
    [
        ({"train_impl": "dpo"}, "train_impl dpo"),
        (
            {
                "pipe_parallel_size": 2,
                "pipeline_schedule": "zbv",
                "num_layers": 4,
                "gradient_accumulation_steps": 2,
                "mtp_num_layers": 2,  # (one module runs under zbv: test_context_parallel.py)
            },
            "zbv",
        ),
    ],
)
def test_what_cannot_carry_it_is_refused_in_one_line(make_config, capsys, extra, cause):
    config = make_config(**KEYS | {"mtp_num_layers": 1, "padded_vocab_size": 512} | extra)
    assert main(["config", "explain", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mtp_num_layers" in err[0] and cause in err[0], err


PP_KEYS = {
    "num_layers": 4,
    "mtp_num_layers": 2,
    "mtp_loss_scaling_factor": 0.5,
    "eod_mask_loss": True,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "hidden_dropout": 0.0,
    "no_weight_tying": True,
}


def test_through_two_stages_it_trains_as_one_process_and_resumes_bitwise(make_config, tmp_path):
    """One process, whole and stopped at step 3 then resumed: the same losses, MTP losses and
    weights bit for bit (the modules saved and loaded); two pipeline stages, stopped at step 3
    and resumed on two stages, equal it (the last stage's copy of the untied embedding takes
    the MTP modules' gradient and the first stage's)."""
    config = make_config(**PP_KEYS)
    whole, split, staged = tmp_path / "whole", tmp_path / "split", tmp_path / "staged"
    train(config, f"save={whole}", "load=null")
    train(config, f"save={split}", f"load={split}", "exit_interval=3")
    train(config, f"save={split}", f"load={split}")
    rows = {r["iteration"]: r for r in metric_rows(whole) if "lm_loss" in r}
    assert sorted(rows) == list(range(1, 7))
    for name in ("lm_loss", "mtp_loss_1", "mtp_loss_2"):
        assert losses(split, name) == losses(whole, name), name  # bitwise
    assert all(r["mtp_loss_2"] > 0 for r in rows.values())
    w_whole = weights(whole)
    assert {n for n in w_whole if n.startswith("mtp.1.")} >= {"mtp.1.eh_proj.weight"}
    for name, tensor in weights(split).items():
        assert torch.equal(tensor, w_whole[name]), name
    stages = ["pipe_parallel_size=2"]
    train(config, f"save={staged}", f"load={staged}", *stages, "exit_interval=3", nproc=2)
    train(config, f"save={staged}", f"load={staged}", *stages, nproc=2)
    assert_same_training(staged, reference(whole))
    for name in ("mtp_loss_1", "mtp_loss_2"):
        got, want = losses(staged, name), losses(whole, name)
        assert sorted(got) == list(range(1, 7))
        assert all(got[k] == pytest.approx(want[k], rel=1e-5) for k in want), name
