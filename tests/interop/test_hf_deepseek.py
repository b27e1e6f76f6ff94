"""DeepseekV3ForCausalLM both ways: a tiny random transformers model (MLA with a query latent,
interleaved rotary weights, a dense first layer, then group-limited sigmoid routing with the
score-correction bias, scaled gates and shared experts, and an MTP module written into the
folder, as DeepSeek-V3's own weights hold one) converts in to transformers' logits within
1e-5, keeping the MTP module, and back to identical tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import assert_same_safetensors
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.interop import huggingface as convert

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 2,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "qk_nope_head_dim": 10,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 64,
    "num_nextn_predict_layers": 0,
}


def hf_folder(tmp_path, **kw):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**(SHAPE | kw))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms at 1, the router and its bias at 0 in transformers 5
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


def add_mtp_module(folder) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP module as its weights save it (transformers' save_pretrained drops
    it): model.layers.3, a block of the last layer's kind, its norms and eh_proj, and copies
    of the embedding and head."""
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    mtp = {
        k.replace("layers.2.", "layers.3."): v + 0.01 * torch.randn(v.shape, generator=g)
        for k, v in tensors.items()
        if k.startswith("model.layers.2.")
    }
    h = SHAPE["hidden_size"]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors | mtp, folder / "model.safetensors", metadata={"format": "pt"})
    return mtp


def test_converts_in_to_transformers_logits_and_back_to_identical_tensors(tmp_path):
    hf_model, folder = hf_folder(tmp_path, num_nextn_predict_layers=1)
    mtp = add_mtp_module(folder)
    convert.from_hf(folder, tmp_path / "ckpt")
    _, ours = load_model(tmp_path / "ckpt")
    assert ours.layers["0"].mlp.__class__.__name__ == "MLP"  # first_k_dense_replace
    module = ours.mtp["0"]  # kept, with the last layer's MoE block
    assert torch.equal(module.eh_proj.weight, mtp["model.layers.3.eh_proj.weight"])
    assert torch.equal(
        module.shared_head.norm.weight, mtp["model.layers.3.shared_head.norm.weight"]
    )
    assert torch.equal(
        module.mlp.router_bias, mtp["model.layers.3.mlp.gate.e_score_correction_bias"]
    )
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        torch.testing.assert_close(ours.eval()(tokens), expected, atol=1e-5, rtol=1e-5)
    convert.to_hf(tmp_path / "ckpt", tmp_path / "back")
    assert_same_safetensors(folder, tmp_path / "back")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded) is type(hf_model)
    for key in SHAPE:
        assert getattr(reloaded.config, key) == getattr(hf_model.config, key), key
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=0, rtol=0)


def test_queries_without_a_latent_convert_and_what_is_not_mapped_is_refused(tmp_path, capsys):
    # config.json names an MTP module that save_pretrained did not write: converted without
    hf_model, folder = hf_folder(tmp_path, q_lora_rank=None, num_nextn_predict_layers=1)
    capsys.readouterr()
    convert.from_hf(folder, tmp_path / "ckpt")
    assert "holds none of their tensors" in capsys.readouterr().err
    _, ours = load_model(tmp_path / "ckpt")
    assert ours.mtp is None
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.eval()(tokens), hf_model(tokens).logits, atol=1e-5, rtol=1e-5
        )
    # an MTP module whose copy of the embedding is not the model's: refused, never dropped
    add_mtp_module(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.3.embed_tokens.weight"][0, 0] += 1
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for change, said in (
        ({}, "model.layers.3.embed_tokens.weight differs from the model's"),
        ({"rope_interleave": False}, "config.json: rope_interleave: false"),
    ):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | change))
        capsys.readouterr()
        assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and said in err, err
