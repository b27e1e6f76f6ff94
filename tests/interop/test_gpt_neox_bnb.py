"""A GPT-NeoX checkpoint of a use_bnb_optimizer run: its learned position embedding is a
bnb.nn.StableEmbedding, saved in layer 0 as ``position_embeddings.weight`` and the LayerNorm's
``position_embeddings.norm.weight`` / ``.bias``; it converts into the model that computes
the same logits, and its 8-bit optimizer state is refused in one line."""

from __future__ import annotations

import json

import torch

from tests.interop.test_gpt_neox_mamba import KEYS as MAMBA_KEYS
from tests.interop.test_gpt_neox_mamba import neox_layers
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

KEYS = MAMBA_KEYS | {"pos_emb": "learned", "use_bnb_optimizer": True}


def write_checkpoint(folder, model) -> None:
    step = folder / "global_step5"
    (step / "configs").mkdir(parents=True)
    (step / "configs" / "bnb.yml").write_text(json.dumps(KEYS))
    layers = neox_layers(model)
    for name in ("weight", "norm.weight", "norm.bias"):
        layers[0][f"position_embeddings.{name}"] = model.pos_embed.get_parameter(name).detach()
    for layer, tensors in layers.items():
        torch.save(tensors, step / f"layer_{layer:02d}-model_00-model_states.pt")
    (folder / "latest").write_text("global_step5")


def test_stable_embedding_checkpoint_converts_with_equal_logits(tmp_path):
    model = build_model(model_args(load_mapping(KEYS, "test")), seed=3)
    with torch.no_grad():  # the position norm away from its init, so that it counts
        model.pos_embed.norm.weight.add_(torch.randn(64) * 0.1)
        model.pos_embed.norm.bias.add_(torch.randn(64) * 0.1)
    write_checkpoint(tmp_path / "neox", model)
    assert main(["convert", "from-gpt-neox", str(tmp_path / "neox"), str(tmp_path / "ckpt")]) == 0
    _, ours = load_model(tmp_path / "ckpt")
    assert torch.equal(ours.pos_embed.norm.bias, model.pos_embed.norm.bias)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), model.eval()(tokens), atol=0, rtol=0)


def test_eight_bit_optimizer_state_is_refused_in_one_line(tmp_path, capsys):
    write_checkpoint(tmp_path / "neox", build_model(model_args(load_mapping(KEYS, "test"))))
    args = ["convert", "from-gpt-neox", str(tmp_path / "neox"), str(tmp_path / "c")]
    assert main([*args, "--with-optimizer"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the 8-bit state of a use_bnb_optimizer run does not import" in err
