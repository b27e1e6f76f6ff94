"""Qwen2-MoE (shared expert with its sigmoid gate), Qwen3-MoE (per-head query/key norms) and
OLMoE (query/key norms over all heads) both ways: a tiny random transformers model converts in
to transformers' logits within 1e-5 and back to identical tensors; what torchneox cannot
express (dense layers between the MoE layers, OLMoE's clip_qkv, the router bias) is refused in
one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import assert_same_safetensors
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.interop import huggingface as convert

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
CASES = {
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(
        **SHAPE, moe_intermediate_size=16, shared_expert_intermediate_size=24, **kw
    ),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **SHAPE, moe_intermediate_size=16, norm_topk_prob=True, head_dim=16, **kw
    ),
    "olmoe": lambda **kw: transformers.OlmoeConfig(**SHAPE, pad_token_id=0, eos_token_id=1, **kw),
}


def hf_folder(tmp_path, name, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CASES[name](**kw)).eval()
    with torch.no_grad():  # norms and biases start at 1/0; the router at 0 in transformers 5
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if pname.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("name", list(CASES))
def test_converts_in_to_transformers_logits_and_back_to_identical_tensors(tmp_path, name):
    hf_model, folder = hf_folder(tmp_path, name)
    convert.from_hf(folder, tmp_path / "ckpt")
    _, ours = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        torch.testing.assert_close(ours.eval()(tokens), expected, atol=1e-5, rtol=1e-5)
    convert.to_hf(tmp_path / "ckpt", tmp_path / "back")
    assert_same_safetensors(folder, tmp_path / "back")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded) is type(hf_model)
    for key in ("norm_topk_prob", "num_experts", "num_experts_per_tok", "head_dim"):
        # (the export writes head_dim, 8, where transformers derives it)
        assert getattr(reloaded.config, key, None) in (getattr(hf_model.config, key, None), 8), key
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "name, extra, fragment",
    [
        ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers [1]"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv 8.0"),
    ],
)
def test_what_is_not_mapped_is_refused_in_one_line(tmp_path, capsys, name, extra, fragment):
    _, folder = hf_folder(tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | extra))
    capsys.readouterr()  # (transformers' progress bars)
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    key, value = fragment.split(" ", 1)
    assert err.count("\n") == 0 and f"config.json: {key}: {value}" in err, err


def test_the_router_bias_is_refused_on_export(tmp_path, capsys):
    """A model routed by a bias cannot be written as a family without one."""
    _, folder = hf_folder(tmp_path, "qwen2_moe")
    convert.from_hf(folder, tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "global_step0" / "config.yml"
    from torchneox.config.load import load_config
    from torchneox.models.args import model_args
    from torchneox.models.hf.architectures import export_architecture

    loaded = load_config([config])
    assert export_architecture(model_args(loaded)) == "Qwen2MoeForCausalLM"
    edited = config.read_text() + "\nmoe_router_bias_update_rate: 0.001\n"
    config.write_text(edited)
    with pytest.raises(Exception, match="moe_router_bias_update_rate"):
        export_architecture(model_args(load_config([config])))
