"""LoRA adapters on the model's linears: where they go, how they start (PEFT's draws, the
model equal to its base), what trains, and the merged weight."""

from __future__ import annotations

import math

import torch

from tests.helpers import BASE, VARIANTS
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.linear import Linear
from torchneox.models.transformer import build_model

SWIGLU = BASE | VARIANTS["rmsnorm-swiglu-gqa"]
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "attention.wv", "down_proj"]}


def model(keys: dict, seed: int = 3):
    return build_model(model_args(load_mapping(keys, "lora")), seed=seed)


def test_adapters_on_the_targets_only_they_train_and_the_model_starts_as_its_base():
    base, adapted = model(SWIGLU), model(SWIGLU | {"lora": LORA})
    names = [n for n, _ in adapted.named_parameters() if "lora_" in n]
    expected = [
        f"layers.{i}.{m}.lora_{ab}.weight"
        for i in range(2)
        for m in ("attention.wq", "attention.wv", "mlp.down")
        for ab in "AB"
    ]
    assert names == expected
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable == expected
    base_sd = base.state_dict()
    for name, tensor in adapted.state_dict().items():
        if "lora_" not in name:  # the base weights are drawn as without adapters
            assert torch.equal(tensor, base_sd[name]), name
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(adapted(tokens), base(tokens))  # B is zeros


def test_a_is_drawn_as_peft_draws_it_per_name_and_b_is_zeros():
    adapted = model(SWIGLU | {"lora": LORA})
    sd = adapted.state_dict()
    a0, a1 = sd["layers.0.attention.wq.lora_A.weight"], sd["layers.1.attention.wq.lora_A.weight"]
    bound = 1 / math.sqrt(64)  # kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
    assert a0.shape == (4, 64) and a0.abs().max() <= bound and a0.abs().max() > 0.8 * bound
    assert not torch.equal(a0, a1)
    down = sd["layers.0.mlp.down.lora_A.weight"]
    assert down.abs().max() <= 1 / math.sqrt(down.shape[1])
    assert all(not t.any() for n, t in sd.items() if "lora_B" in n)
    again = model(SWIGLU | {"lora": LORA}).state_dict()
    assert all(torch.equal(t, again[n]) for n, t in sd.items())  # seeded by name


def test_the_adapted_layer_and_its_merged_weight():
    layer = Linear(8, 6, bias=True)
    layer.add_adapter(rank=2, scale=1.5, dropout=0.0)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = (
            x @ layer.weight.T
            + layer.bias
            + 1.5 * (x @ layer.lora_A.weight.T) @ (layer.lora_B.weight.T)
        )
        torch.testing.assert_close(layer(x), expected)
        merged = torch.nn.functional.linear(x, layer.merged_weight(), layer.bias)
        torch.testing.assert_close(merged, expected)
