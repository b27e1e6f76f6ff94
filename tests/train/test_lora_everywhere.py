"""LoRA beside every feature it composes with, in one mixed model: attention with MoE experts
(one adapter per expert, the router adapted), Mamba, RWKV and aMLP layers, every second half
of the layers sharing the first half's weights (one adapter per shared weight), a soft prompt
training with the adapters, muP at twice the base width. It trains (its loss falls), the
merged model computes what the adapted one does, a resumed run equals an unstopped one bit for
bit, and muP gives A its width-scaled learning rate. fp8's linears carry their adapters beside
them (tested as the project tests fp8 on a CPU: torchao's casts under bf16 autocast)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import losses
from torchneox.cli import main
from torchneox.config.features.lora import MLA_ONLY, OURS
from torchneox.config.load import load_config
from torchneox.models.lora import adapters_off, merged_state_dict
from torchneox.models.transformer import Transformer
from torchneox.train.trainer import Trainer

pytest.importorskip("mup")

PLAIN = tuple(t for t in OURS if t not in MLA_ONLY)
"""Every layer LoRA adapts but MLA's (tests/interop/test_lora_mla.py: MLA refuses muP)."""

MIXED = {
    "num_layers": 8,
    "attention_config": [[["global", "mamba", "rwkv", "amlp"], 2]],
    "gmlp_attn_dim": 16,
    "norm": "rmsnorm",
    "activation": "swiglu",
    "num_unique_layers": 4,
    "param_sharing_style": "grouped",
    "moe_num_experts": 4,
    "moe_expert_interval": 4,
    "moe_top_k": 2,
    "soft_prompt_tuning": {"enabled": True, "n_tokens": 4},
    "use_mup": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "lora": {"rank": 2, "alpha": 4, "target_modules": list(PLAIN)},
    "train_iters": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 0.03, "betas": [0.9, 0.95], "eps": 1.0e-8}},
    "warmup": 0.0,
    "hidden_size": 64,
}


def _run(cfg: str, **changes) -> Trainer:
    loaded = load_config([cfg])
    for key, value in changes.items():
        loaded.config.set(key, value)
    trainer = Trainer(loaded, device="cpu")
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def mixed(make_module_config, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("everywhere")
    shapes = tmp / "shapes.yml"  # muP's base at width 32, the runs at 64
    base = make_module_config(
        "base.yml",
        **(MIXED | {"hidden_size": 32}),
        save_base_shapes=True,
        base_shapes_file=str(shapes),
    )
    assert main(["train", base]) == 0
    whole = make_module_config("whole.yml", **MIXED, base_shapes_file=str(shapes))
    first = make_module_config(
        "stopped.yml", **MIXED, base_shapes_file=str(shapes), save=str(tmp / "stopped"),
        load=str(tmp / "stopped"),
    )  # fmt: skip
    trainer = _run(whole)
    before = Transformer(trainer.model.args)  # the untrained model, drawn as the run drew it
    before.to_empty(device="cpu")
    before.init_weights("cpu", seed=trainer.cfg.training.seed)
    _run(first, exit_interval=2)
    _run(first)
    return trainer, before, tmp


def test_every_family_trains_its_adapters_and_its_loss_falls(mixed):
    trainer, before, _ = mixed
    run = losses(trainer.cfg.checkpoint.save)
    assert run[4] < run[1]
    now = trainer.model.state_dict()
    changed = {n for n, t in before.state_dict().items() if not torch.equal(t, now[n])}
    assert changed == {n for n in now if "lora_B" in n or "lora_A" in n} | {"soft_prompt.weight"}
    held = {n.rsplit(".lora_", 1)[0].split(".", 2)[2] for n in now if ".lora_" in n}
    assert held == {*PLAIN, "mlp.experts_up_lora", "mlp.experts_gate_lora",
                    "mlp.experts_down_lora"} - {"mlp.up", "mlp.gate", "mlp.down"}  # fmt: skip
    # shared layers: layers 4-7 hold layers 0-3's adapters, one tensor each, trained once
    layers = trainer.model.layers
    assert layers["5"].mamba.in_proj.lora_A.weight is layers["1"].mamba.in_proj.lora_A.weight
    assert (
        layers["4"].mlp.experts_up_lora.lora_B.weight
        is layers["0"].mlp.experts_up_lora.lora_B.weight
    )
    assert not any(n.startswith("layers.4.") for n in now)


def test_the_merged_model_computes_the_adapted_one(mixed):
    trainer, _, _ = mixed
    model = trainer.model.eval()
    args = dataclasses.replace(model.args, lora_rank=0, lora_targets=())
    plain = Transformer(args)
    plain.load_state_dict(merged_state_dict(model))
    plain.init_buffers("cpu")
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted, merged = model(tokens), plain.eval()(tokens)
        with adapters_off(model):
            base = model(tokens)
    adapted, merged, base = (x[0] if isinstance(x, tuple) else x for x in (adapted, merged, base))
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
    assert not torch.allclose(base, adapted, atol=1e-4)  # the adapters do something


def test_a_resumed_run_equals_the_unstopped_one_bit_for_bit(mixed):
    trainer, _, tmp = mixed
    whole, resumed = trainer.cfg.checkpoint.save, tmp / "stopped"
    assert losses(resumed) == losses(whole) and len(losses(whole)) == 4
    assert losses(resumed, "grad_norm") == losses(whole, "grad_norm")


def test_under_mup_a_takes_the_width_scaled_rate_and_b_the_base_rate(mixed):
    trainer, _, _ = mixed
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    scales = {
        names[id(p)]: g["lr_scale"] for g in trainer.optimizer.param_groups for p in g["params"]
    }
    assert scales["layers.0.attention.wq.lora_A.weight"] == 0.5  # in 64 over the base's 32
    assert scales["layers.0.mlp.experts_up_lora.lora_A.weight"] == 0.5
    assert scales["layers.0.attention.wq.lora_B.weight"] == 1.0


def test_fp8_linears_carry_their_adapters_beside_them(make_config):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    cfg = make_config(
        precision="bfloat16", fp8_recipe="tensorwise", train_iters=2, lora=lora, save=None,
        load=None, optimizer=MIXED["optimizer"], warmup=0.0,
    )  # fmt: skip
    trainer = Trainer(load_config([cfg]), device="cpu")
    before = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    trainer.run()
    model = trainer.model
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    adapted = {n.rsplit(".lora_", 1)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {f"layers.{i}.{m}" for i in (0, 1) for m in LORA_FP8} and adapted <= fp8
    now = model.state_dict()
    changed = {n for n, t in before.items() if not torch.equal(t, now[n])}
    assert changed == {n for n in now if ".lora_" in n}  # the adapters train, the base not
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".lora_" in n)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    layer = model.layers["0"].attention.wq
    seen = []
    layer.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        model.eval()(tokens)
        with adapters_off(model):
            model(tokens)
    (x, adapted_out), (_, base_out) = seen
    term = (
        layer.lora_scale
        * (x @ layer.lora_A.weight.T.to(x.dtype))
        @ layer.lora_B.weight.T.to(x.dtype)
    )
    torch.testing.assert_close(adapted_out.float(), (base_out + term.to(base_out.dtype)).float())


LORA_FP8 = ("attention.wq", "attention.wv", "mlp.down")
