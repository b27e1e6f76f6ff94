"""GPT-NeoX checkpoints of mamba models: layer files written here in GPT-NeoX's layout, with
the names of its ParallelMambaResidualLayer (megatron/model/mamba/mamba.py: ``norm`` (an
RMSNorm: ``scale``) then ``mixer`` with A_log, D, in_proj, conv1d, x_proj, dt_proj, out_proj),
convert into the model that computes the same logits; the optimizer's order is GPT-NeoX's."""

from __future__ import annotations

import json

import torch

from tests.helpers import BASE, VARIANTS
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.config.load import load_mapping
from torchneox.interop.gpt_neox_optim import optimizer_order
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

KEYS = BASE | VARIANTS["mamba"] | {"no_weight_tying": True, "pipe_parallel_size": 1}
MIXER = ("A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight")
MIXER += ("dt_proj.weight", "dt_proj.bias", "out_proj.weight")


def neox_layers(model) -> dict[int, dict[str, torch.Tensor]]:
    """The model's tensors as GPT-NeoX's pipeline layers name them (0: embedding, 2..n+1: the
    mamba layers, n+3: the final norm, n+4: the head)."""
    n = model.args.num_layers
    layers = {0: {"word_embeddings.weight": model.embed.weight}}
    for i in range(n):
        block = model.layers[str(i)]
        tensors = {"norm.scale": block.mamba_norm.weight}
        tensors |= {f"mixer.{p}": block.mamba.get_parameter(p) for p in MIXER}
        layers[i + 2] = tensors
    layers[n + 3] = {"norm.scale": model.final_norm.weight}
    layers[n + 4] = {"final_linear.weight": model.output.weight}
    return {k: {name: t.detach().clone() for name, t in v.items()} for k, v in layers.items()}


def test_gpt_neox_mamba_checkpoint_converts_with_equal_logits(tmp_path):
    model = build_model(model_args(load_mapping(KEYS, "test")), seed=3)
    with torch.no_grad():  # norms and the D skip away from their init, so they count
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".D")):
                p.add_(torch.randn_like(p) * 0.1)
    step = tmp_path / "neox" / "global_step5"
    (step / "configs").mkdir(parents=True)
    (step / "configs" / "mamba.yml").write_text(json.dumps(KEYS))
    for layer, tensors in neox_layers(model).items():
        torch.save(tensors, step / f"layer_{layer:02d}-model_00-model_states.pt")
    (tmp_path / "neox" / "latest").write_text("global_step5")
    assert main(["convert", "from-gpt-neox", str(tmp_path / "neox"), str(tmp_path / "ckpt")]) == 0
    _, ours = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), model.eval()(tokens), atol=0, rtol=0)


def test_tensor_parallel_mamba_shards_are_refused_in_one_line(tmp_path, capsys):
    model = build_model(model_args(load_mapping(KEYS, "test")))
    step = tmp_path / "neox" / "global_step5"
    (step / "configs").mkdir(parents=True)
    (step / "configs" / "mamba.yml").write_text(json.dumps(KEYS | {"model_parallel_size": 2}))
    for layer, tensors in neox_layers(model).items():
        for rank in range(2):
            torch.save(tensors, step / f"layer_{layer:02d}-model_{rank:02d}-model_states.pt")
    (tmp_path / "neox" / "latest").write_text("global_step5")
    assert main(["convert", "from-gpt-neox", str(tmp_path / "neox"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_parallel_size" in err


def test_optimizer_order_is_gpt_neox_parameter_groups():
    """GPT-NeoX's get_params_for_weight_decay_optimization walks module.modules(): per layer the
    norm (no decay), the mixer's own A_log and D (_no_weight_decay), then in_proj, conv1d,
    x_proj, dt_proj, out_proj (weights decay, biases do not); decay group first."""
    model = build_model(model_args(load_mapping(KEYS, "test")))
    layers = neox_layers(model)
    order = optimizer_order(model.args, layers)
    decay = [(0, "word_embeddings.weight")]
    plain = []
    for layer in (2, 3):
        plain += [(layer, "norm.scale"), (layer, "mixer.A_log"), (layer, "mixer.D")]
        decay += [(layer, f"mixer.{m}.weight") for m in ("in_proj", "conv1d", "x_proj")]
        plain += [(layer, "mixer.conv1d.bias")]
        decay += [(layer, "mixer.dt_proj.weight")]
        plain += [(layer, "mixer.dt_proj.bias")]
        decay += [(layer, "mixer.out_proj.weight")]
    decay += [(6, "final_linear.weight")]
    plain.insert(len(plain), (5, "norm.scale"))
    assert order == decay + plain
