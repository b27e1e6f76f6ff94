"""GPT-NeoX checkpoints of gMLP and aMLP layers: a checkpoint written here in GPT-NeoX's layout,
with the tensor names of megatron/model/gmlp.py's GMLPBlock, converts into the model that
computes with those tensors; what does not import is one line."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from torchneox.checkpoint.weights import load_model
from torchneox.cli import main

H, S, A, V = 32, 16, 8, 512  # hidden, seq_length, gmlp_attn_dim, padded vocabulary
FF = 4 * H
CONFIG = {
    "num_layers": 2,
    "hidden_size": H,
    "num_attention_heads": 4,
    "seq_length": S,
    "attention_config": [[["gmlp", "amlp"], 1]],
    "gmlp_attn_dim": A,
    "pos_emb": "none",
    "no_weight_tying": True,
    "norm": "layernorm",
    "tokenizer_type": "CharLevelTokenizer",
    "make_vocab_size_divisible_by": 128,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
}


def gmlp_block(amlp: bool) -> dict[str, tuple[int, ...]]:
    """GMLPBlock's state dict shapes (model_parallel_size 1), in its module order."""
    shapes = {
        "norm.weight": (H,),
        "norm.bias": (H,),
        "input_linear.weight": (2 * FF, H),
        "input_linear.bias": (2 * FF,),
        "sgu.norm.weight": (FF,),
        "sgu.norm.bias": (FF,),
        "sgu.proj.weight": (S, S),
        "sgu.proj.bias": (S,),
    }
    if amlp:
        shapes |= {
            "sgu.attn.proj_qkv.weight": (3 * A, 2 * FF),
            "sgu.attn.proj_qkv.bias": (3 * A,),
            "sgu.attn.proj_ffn.weight": (FF, A),
            "sgu.attn.proj_ffn.bias": (FF,),
        }
    return shapes | {"output_linear.weight": (H, FF), "output_linear.bias": (H,)}


def neox_checkpoint(folder, tp: int = 1) -> dict[int, dict[str, torch.Tensor]]:
    """A GPT-NeoX step folder (pipe layout: layer 0 the embedding, 2 and 3 the blocks, 5 the
    final norm, 6 the head) of random tensors; returns them by layer."""
    g = torch.Generator().manual_seed(0)
    layers = {
        0: {"word_embeddings.weight": (V, H)},
        2: gmlp_block(amlp=False),
        3: gmlp_block(amlp=True),
        5: {"norm.weight": (H,), "norm.bias": (H,)},
        6: {"final_linear.weight": (V, H)},
    }
    tensors = {
        layer: {k: torch.randn(shape, generator=g) * 0.3 for k, shape in names.items()}
        for layer, names in layers.items()
    }
    (folder / "configs").mkdir(parents=True)
    config = CONFIG | {"model_parallel_size": tp}
    (folder / "configs" / "gmlp.yml").write_text(json.dumps(config))
    for layer, named in tensors.items():
        for rank in range(tp):
            torch.save(named, folder / f"layer_{layer:02d}-model_{rank:02d}-model_states.pt")
    return tensors


def neox_gmlp(t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """GMLPBlock.forward from GPT-NeoX's source on [batch, seq, hidden] (the projection biases
    are never added: skip_bias_add, and the returned bias dropped)."""
    x = F.layer_norm(x, (H,), t["norm.weight"], t["norm.bias"], 1e-5)
    x = F.gelu(x @ t["input_linear.weight"].T)
    n = x.shape[1]
    res, gate = x.chunk(2, dim=-1)
    gate = F.layer_norm(gate, (FF,), t["sgu.norm.weight"], t["sgu.norm.bias"], 1e-5)
    causal = torch.ones(n, n).triu(1).bool()
    weight = t["sgu.proj.weight"][:n, :n].masked_fill(causal, 0.0)
    gate = F.linear(gate.transpose(2, 1), weight, t["sgu.proj.bias"][:n]).transpose(2, 1)
    if "sgu.attn.proj_qkv.weight" in t:
        qkv = x @ t["sgu.attn.proj_qkv.weight"].T + t["sgu.attn.proj_qkv.bias"]
        q, k, v = qkv.chunk(3, dim=-1)
        w = (q @ k.transpose(1, 2) * A**-0.5).masked_fill(causal, torch.finfo(q.dtype).min)
        gate = gate + w.softmax(-1) @ v @ t["sgu.attn.proj_ffn.weight"].T
        gate = gate + t["sgu.attn.proj_ffn.bias"]
    return (gate * res) @ t["output_linear.weight"].T


def test_gmlp_checkpoint_imports_and_computes_with_its_tensors(tmp_path):
    step = tmp_path / "neox" / "global_step5"
    t = neox_checkpoint(step)
    assert main(["convert", "from-gpt-neox", str(step), str(tmp_path / "out")]) == 0
    _, model = load_model(tmp_path / "out")
    ours = model.state_dict()
    assert torch.equal(ours["layers.1.gmlp_norm.weight"], t[3]["norm.weight"])
    assert torch.equal(ours["layers.1.gmlp.sgu.proj.weight"], t[3]["sgu.proj.weight"])
    assert torch.equal(ours["layers.1.gmlp.sgu.attn.proj_ffn.bias"], t[3]["sgu.attn.proj_ffn.bias"])
    assert not any(k.endswith(("input_linear.bias", "output_linear.bias")) for k in ours)
    tokens = torch.randint(0, V, (2, S))
    x = t[0]["word_embeddings.weight"][tokens]
    for layer in (2, 3):  # torchneox's block keeps the residual (docs/migrating-from-gpt-neox.md)
        x = x + neox_gmlp(t[layer], x)
    x = F.layer_norm(x, (H,), t[5]["norm.weight"], t[5]["norm.bias"], 1e-5)
    expected = x @ t[6]["final_linear.weight"].T
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tp, extra, says",
    [
        (2, [], "'gmlp' layers split over 2 tensor ranks do not import"),
    ],
)
def test_what_does_not_import_is_one_line(tmp_path, capsys, tp, extra, says):
    step = tmp_path / "neox" / "global_step5"
    neox_checkpoint(step, tp=tp)
    assert main(["convert", "from-gpt-neox", str(step), str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert err.count("\n") == 1


def test_its_optimizer_state_imports_in_gpt_neox_parameter_order(tmp_path):
    """GMLPBlock's norms and every bias are in GPT-NeoX's no-decay group: each tensor's
    moments land on its parameter; those of the projection biases GPT-NeoX never adds (nor
    torchneox builds) are left out."""
    from tests.interop.test_gpt_neox_rwkv import converted_moments, neox_adam

    step = tmp_path / "neox" / "global_step5"
    layers = neox_checkpoint(step)

    def no_decay(layer: int, name: str) -> bool:
        return name.endswith("bias") or name.split(".")[-2] == "norm"

    optimizer, moments = neox_adam(layers, no_decay)
    torch.save({"optimizer": optimizer, "iteration": 5}, step / "mp_rank_00_model_states.pt")
    out = tmp_path / "out"
    assert main(["convert", "from-gpt-neox", str(step), str(out), "--with-optimizer"]) == 0
    held = converted_moments(out, tmp_path)
    top = {0: "embed.weight", 6: "output.weight"}
    unused = ("input_linear.bias", "output_linear.bias")
    for (layer, name), expected in moments.items():
        if name in unused:
            continue
        if layer in (2, 3):
            module = "gmlp_norm." if name.startswith("norm.") else "gmlp."
            mine = f"layers.{layer - 2}.{module}{name.removeprefix('norm.')}"
        else:
            mine = top.get(layer, "final_norm." + name.removeprefix("norm."))
        for kind, tensor in expected.items():
            assert torch.equal(held[mine][kind], tensor), (mine, kind)
    assert len(held) == len(moments) - 2 * len(unused)
