"""use_bnb_optimizer: 8-bit Adam's steps equal the libraries' own optimizers (bitsandbytes'
Adam8bit, torchao's AdamW8bit) on the same parameters and gradients, learned positions through
StableEmbedding, explain's choice, the estimator's bytes against a hand count, and a short run
from the CLI that resumes exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchneox
from tests.conftest import shared_dir
from tests.helpers import losses
from torchneox.cli import main
from torchneox.config.features import eight_bit
from torchneox.config.features.optimizer import OptimizerSpec
from torchneox.config.load import load_config
from torchneox.models.stable_embedding import StableEmbedding
from torchneox.optim.builder import param_groups
from torchneox.optim.eight_bit import build_eight_bit_adam
from torchneox.train.trainer import Trainer

SHARED = shared_dir()
BNB_CONFIG = SHARED / "neox_configs" / "bnb_125M.yml" if SHARED else None
SPEC = OptimizerSpec(
    kind="adam", type_name="Adam", lr=1e-2, weight_decay=0.1, params={"betas": [0.8, 0.95]}
)


class Tiny(nn.Module):
    """A matrix and a position table big enough for 8-bit state (8,192 and 4,096 values), a
    bias and a norm that are not."""

    def __init__(self, stable: type[nn.Module]):
        super().__init__()
        torch.manual_seed(0)
        self.pos_embed = stable(64, 64)
        self.proj = nn.Linear(64, 128)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, grads: list[dict]) -> None:
    for step in grads:
        for name, p in model.named_parameters():
            p.grad = step[name].clone()
        optimizer.step()


def _grads(model: nn.Module, steps: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [
        {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        for _ in range(steps)
    ]


def test_bitsandbytes_steps_equal_its_own_adam8bit():
    import bitsandbytes as bnb

    ours = Tiny(StableEmbedding)
    theirs = Tiny(bnb.nn.StableEmbedding)  # registers its weight for 32-bit state
    theirs.load_state_dict(ours.state_dict())
    mine = build_eight_bit_adam(ours, param_groups(ours, 0.1), SPEC, 1e-2, "bitsandbytes")
    ref = bnb.optim.Adam8bit(param_groups(theirs, 0.1), lr=1e-2, betas=(0.8, 0.95), eps=1e-8)
    grads = _grads(ours)
    _steps(ours, mine, grads)
    _steps(theirs, ref, grads)
    # bnb's process-wide manager keeps the reference's override (by id) after the test
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.module_weight_config_triple.clear()
    manager.pid2config.clear()
    manager.index2config.clear()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q), name
    state = mine.state[ours.proj.weight]
    assert state["state1"].dtype == torch.uint8 and state["absmax1"].shape == (8192 // 256,)
    assert mine.state[ours.pos_embed.weight]["state1"].dtype == torch.float32
    assert not torch.equal(ours.proj.weight, Tiny(StableEmbedding).proj.weight)  # it moved


def test_torchao_steps_equal_its_own_adamw8bit():
    from torchao.optim import AdamW8bit

    ours, theirs = Tiny(StableEmbedding), Tiny(StableEmbedding)
    mine = build_eight_bit_adam(ours, param_groups(ours, 0.1), SPEC, 1e-2, "torchao")
    # torchao has no 32-bit override: its own optimizer over the others, and the position
    # table checked against torch's AdamW (the same fp32 update)
    groups = param_groups(theirs, 0.1)
    table = theirs.pos_embed.weight
    groups[0]["params"] = [p for p in groups[0]["params"] if p is not table]
    ref = AdamW8bit(groups, lr=1e-2, betas=(0.8, 0.95), eps=1e-8)
    fp32 = torch.optim.AdamW([table], lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    grads = _grads(ours)
    _steps(ours, mine, grads)
    for step in grads:
        for name, p in theirs.named_parameters():
            p.grad = step[name].clone()
        ref.step()
        fp32.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if name == "pos_embed.weight":
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(p, q), name
    assert type(mine.state[ours.proj.weight]["exp_avg"]).__name__ == "OptimState8bit"
    assert mine.state[ours.pos_embed.weight]["exp_avg"].dtype == torch.float32


def test_stable_embedding_is_layernorm_of_the_lookup():
    import bitsandbytes as bnb

    torch.manual_seed(0)
    ours = StableEmbedding(16, 8)
    with torch.no_grad():
        ours.norm.weight.uniform_(0.5, 1.5)
        ours.norm.bias.uniform_(-0.5, 0.5)
    ids = torch.tensor([[0, 3, 15], [7, 7, 1]])
    looked = ours.weight[ids]
    mean = looked.mean(-1, keepdim=True)
    var = looked.var(-1, unbiased=False, keepdim=True)
    by_hand = (looked - mean) / torch.sqrt(var + 1e-5) * ours.norm.weight + ours.norm.bias
    torch.testing.assert_close(ours(ids), by_hand)
    theirs = bnb.nn.StableEmbedding(16, 8)
    theirs.load_state_dict(ours.state_dict())  # the same names: weight, norm.weight, norm.bias
    assert torch.equal(ours(ids), theirs(ids))


def test_learned_positions_become_stable_embedding(make_config):
    from torchneox.models.args import ModelArgs
    from torchneox.models.transformer import build_model

    def model(**keys):
        loaded = load_config([make_config(pos_emb="learned", **keys)])
        return build_model(ModelArgs.from_config(loaded.config, 64))

    plain, stable = model(), model(use_bnb_optimizer=True)
    assert type(plain.pos_embed) is nn.Embedding
    assert isinstance(stable.pos_embed, StableEmbedding)
    names = {n for n, _ in stable.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert names == {"pos_embed.norm.weight", "pos_embed.norm.bias"}
    # the table is drawn as without use_bnb_optimizer (GPT-NeoX's init_method over xavier)
    assert torch.equal(stable.pos_embed.weight, plain.pos_embed.weight)
    pos = torch.arange(8)
    expected = F.layer_norm(plain.pos_embed(pos), (32,))
    torch.testing.assert_close(stable.pos_embed(pos), expected)


def test_explain_shows_the_library(make_config, capsys, monkeypatch):
    cfg = make_config(use_bnb_optimizer=True, pos_emb="learned")
    assert main(["config", "explain", cfg]) == 0
    out = capsys.readouterr().out
    assert "bitsandbytes' Adam8bit (bitsandbytes is installed" in out
    assert "learned positions through StableEmbedding" in out
    # ZeRO 1-3: torchao's, whose optimizer takes FSDP2's DTensor shards, whatever is installed
    assert main(["config", "explain", cfg, "--set", "zero_optimization.stage=2"]) == 0
    assert "eight_bit_adam     torchao  torchao's AdamW8bit (ZeRO 1-3" in capsys.readouterr().out
    # tensor, pipeline and expert parallelism: DTensor parameters too, at ZeRO 0
    tp = ["--set", "model_parallel_size=2", "--set", "global_num_gpus=2"]
    assert main(["config", "explain", cfg, *tp]) == 0
    said = "torchao's AdamW8bit (tensor parallelism: it takes the DTensor parameters"
    assert said in capsys.readouterr().out
    monkeypatch.setattr(eight_bit, "installed_library", lambda: "torchao")
    assert main(["config", "explain", cfg]) == 0
    assert "torchao's AdamW8bit (bitsandbytes is not installed)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "sets,says",
    [
        (["optimizer.params.amsgrad=true"], "8-bit Adam has no amsgrad"),
    ],
)
def test_what_8bit_adam_does_not_run_with_is_one_line(make_config, capsys, sets, says):
    cfg = make_config(use_bnb_optimizer=True, no_weight_tying=True)
    args = ["config", "explain", cfg, "--set", "global_num_gpus=2"]
    assert main([*args, *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert says in err and "use_bnb_optimizer" in err


def test_estimated_state_bytes_by_hand():
    from torchneox.config.layout import Layout
    from torchneox.estimate.memory import state_bytes

    params = [("embed.weight", (100, 64)), ("pos_embed.weight", (64, 64)), ("b", (64,))]
    lay = Layout(gpus=1, dp=1, tp=1, pp=1, zero=0, micro_batch=1, gas=1, checkpoint="none")
    # the 6,400-value embedding: 2 bytes a value + 2 x 25 blocks of 256 x 4 bytes; the
    # StableEmbedding table (4,096 values) and the bias (64) in fp32: 8 bytes a value; the
    # two maps bitsandbytes keeps once (2 x 256 x 4)
    bnb = 2 * 6400 + 2 * 25 * 4 + 8 * 4096 + 8 * 64 + 2048
    count = eight_bit.eight_bit_optimizer_bytes
    got = state_bytes(params, lay, 1, 8, 0, per_tensor=lambda t: count("bitsandbytes", t))
    assert got["resident"]["optimizer"] == bnb
    # torchao: the same here (6,400 is a multiple of 256; its two maps are per quantised
    # tensor, and there is one)
    ao = state_bytes(params, lay, 1, 8, 0, per_tensor=lambda t: count("torchao", t))
    assert ao["resident"]["optimizer"] == bnb
    odd = [("w", 4097)]  # not whole blocks: torchao keeps fp32, bitsandbytes 17 blocks
    assert count("torchao", odd) == 8 * 4097
    assert count("bitsandbytes", odd) == 2 * 4097 + 2 * 17 * 4 + 2048


def test_short_run_from_the_cli_resumes_exactly(make_config, tmp_path):
    keys = {"use_bnb_optimizer": True, "pos_emb": "learned", "hidden_size": 64}
    whole = make_config("w.yml", save=str(tmp_path / "w"), load=str(tmp_path / "w"), **keys)
    assert main(["train", whole]) == 0
    cfg = make_config(
        "s.yml", save=str(tmp_path / "s"), load=str(tmp_path / "s"), exit_interval=3, **keys
    )
    assert Trainer(load_config([cfg]), device="cpu").run() is not None
    trainer = Trainer(load_config([cfg]), device="cpu")
    trainer.run()
    assert type(trainer.optimizer).__name__ == "Adam8bit"
    lw, ls = losses(tmp_path / "w"), losses(tmp_path / "s")
    assert sorted(lw) == list(range(1, 7))
    assert {k: lw[k] for k in range(4, 7)} == {k: ls[k] for k in range(4, 7)}
    assert lw[6] < lw[1]


@pytest.mark.parametrize("library", ["bitsandbytes", "torchao"])
def test_saved_state_resumes_bitwise(tmp_path, library):
    """The trainer's checkpoint path (DCP's optimizer state dict, written, read into a fresh
    optimizer): the next step equals the one never saved (torchao's on the Tiny shapes the
    test above compiled; a whole torchao run compiles every shape of a model on the CPU)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from torchneox.checkpoint.files import _dcp_save, load_state
    from torchneox.optim.builder import load_optimizer_state

    model = Tiny(StableEmbedding)
    opt = build_eight_bit_adam(model, param_groups(model, 0.1), SPEC, 1e-2, library)
    grads = _grads(model, 3)
    _steps(model, opt, grads[:2])
    _dcp_save({"optimizer": get_optimizer_state_dict(model, opt)}, tmp_path / "ck")
    again = copy.deepcopy(model)
    fresh = build_eight_bit_adam(again, param_groups(again, 0.1), SPEC, 1e-2, library)
    if hasattr(fresh, "init_state"):
        fresh.init_state()  # as the trainer's loader does
    tensors = {"optimizer": get_optimizer_state_dict(again, fresh)}
    load_state(tmp_path / "ck", tensors)
    load_optimizer_state(again, fresh, tensors["optimizer"])
    _steps(model, opt, grads[2:])
    _steps(again, fresh, grads[2:])
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
def test_gpt_neox_bnb_config_explains_and_trains_scaled_down(tmp_path, tiny_data, capsys):
    config = str(BNB_CONFIG)
    assert main(["config", "explain", config]) == 0
    out = capsys.readouterr().out
    assert "eight_bit_adam     bitsandbytes  bitsandbytes' Adam8bit" in out
    assert "pos_emb rotary: no position table to make a StableEmbedding" in out
    run = tmp_path / "run"
    overrides = [
        "fp16.enabled=false",  # fp16 matmuls on a CPU without fp16 units: ~30x slower
        "num_layers=2",
        "hidden_size=64",
        "num_attention_heads=4",
        "seq_length=64",
        "max_position_embeddings=64",
        "train_iters=6",
        "lr_decay_iters=6",
        "eval_interval=6",
        "eval_iters=1",
        "log_interval=2",
        "optimizer.params.lr=0.003",
        "tokenizer_type=CharLevelTokenizer",
        "make_vocab_size_divisible_by=64",
        f"data_path={tiny_data}",
        "split=90,8,2",
        "distributed_backend=gloo",
        "num_workers=0",
        f"save={run}",
        "load=null",
    ]
    assert main(["train", config, *[a for o in overrides for a in ("--set", o)]]) == 0
    loss = losses(run)
    assert sorted(loss) == [2, 4, 6]
    assert loss[6] < loss[4] < loss[2]


def test_dry_run_holds_the_estimated_8bit_state():
    """The dry run steps the real bitsandbytes optimizer on fake tensors (2 DDP ranks): the
    state it creates is, byte for byte, what estimate counts."""
    from torchneox.estimate.dry_run import dry_run

    sets = ["use_bnb_optimizer=true", "pos_emb=learned", "train_micro_batch_size_per_gpu=2"]
    loaded = load_config([str(Path(torchneox.__file__).parent / "configs" / "tiny_cpu.yml")], sets)
    run = dry_run(loaded, 2, ranks="all", workers=1)
    assert not run.problems, run.problems
    for r in run.ranks:
        assert r.stepped, r.step
        assert r.bytes["optimizer"] == r.expected["optimizer"]
        assert r.bytes["optimizer"] < r.bytes["parameters"] * 2 / 3  # fp32 Adam: 2 x
