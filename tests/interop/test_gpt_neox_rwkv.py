"""A GPT-NeoX checkpoint of RWKV-6 layers, written here in GPT-NeoX's layout with the
parameter names and shapes of its megatron/model/rwkv/v6/rwkv.py (RWKVResidualLayerPipe:
ln1, ln2, att.*, ffn.*), converts: every tensor lands where the model computes with it."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import shared_dir
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main

SHARED = shared_dir()
pytestmark = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
G = SHARED / "golden" / "neox_checkpoints" if SHARED else None
GPT2 = SHARED / "data/tokenizers/gpt2" if SHARED else None

H, D, HEADS, FFN, VOCAB = 64, 64, 4, 224, 50304  # ffn: int(3.5 x 64) // 32 x 32


def neox_rwkv_layer(g: torch.Generator) -> dict[str, torch.Tensor]:
    shapes = {
        "ln1.weight": (H,),
        "ln1.bias": (H,),
        "ln2.weight": (H,),
        "ln2.bias": (H,),
        **{f"att.time_maa_{m}": (1, 1, H) for m in "xwkvrg"},
        "att.time_maa_w1": (H, 32 * 5),
        "att.time_maa_w2": (5, 32, H),
        "att.time_decay": (1, 1, D),
        "att.time_decay_w1": (H, 64),
        "att.time_decay_w2": (64, D),
        "att.time_faaaa": (HEADS, D // HEADS),
        "att.receptance.weight": (D, H),
        "att.key.weight": (D, H),
        "att.value.weight": (D, H),
        "att.output.weight": (H, D),
        "att.gate.weight": (D, H),
        "att.ln_x.weight": (D,),
        "att.ln_x.bias": (D,),
        "ffn.time_maa_k": (1, 1, H),
        "ffn.time_maa_r": (1, 1, H),
        "ffn.key.weight": (FFN, H),
        "ffn.receptance.weight": (H, H),
        "ffn.value.weight": (H, FFN),
    }
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in shapes.items()}


OURS = {"ln1.": "time_mix_norm.", "ln2.": "channel_mix_norm.", "att.ln_x.": "time_mix.out_norm."}


def ours(name: str) -> str:
    for theirs, mine in (*OURS.items(), ("att.", "time_mix."), ("ffn.", "channel_mix.")):
        if name.startswith(theirs):
            return mine + name.removeprefix(theirs)
    raise AssertionError(name)


def write_checkpoint(folder, extra: dict | None = None) -> dict[int, dict[str, torch.Tensor]]:
    step = folder / "global_step10"
    (step / "configs").mkdir(parents=True)
    config = (G / "configs/tiny_pp1.yml").read_text()
    config = config.replace("{", '{\n  "attention_config": [[["rwkv"], 2]],', 1)
    (step / "configs" / "tiny_rwkv.yml").write_text(config)
    shutil.copy(G / "pp1" / "global_step10" / "mp_rank_00_model_states.pt", step)
    g = torch.Generator().manual_seed(0)
    layers = {
        0: {"word_embeddings.weight": torch.randn(VOCAB, H, generator=g) * 0.02},
        2: neox_rwkv_layer(g),
        3: neox_rwkv_layer(g) | (extra or {}),
        5: {"norm.weight": torch.rand(H, generator=g) + 0.5, "norm.bias": torch.zeros(H)},
        6: {"final_linear.weight": torch.randn(VOCAB, H, generator=g) * 0.02},
    }
    for layer, tensors in layers.items():
        torch.save(tensors, step / f"layer_{layer:02d}-model_00-model_states.pt")
    (folder / "latest").write_text("global_step10")
    return layers


def convert(src, out) -> int:
    args = ["convert", "from-gpt-neox", str(src), str(out)]
    for t in (f"vocab_file={GPT2}/vocab.json", f"merge_file={GPT2}/merges.txt"):
        args += ["--set", t]
    return main(args)


def test_gpt_neox_rwkv_checkpoint_imports(tmp_path):
    layers = write_checkpoint(tmp_path / "neox")
    assert convert(tmp_path / "neox", tmp_path / "ckpt") == 0
    _, model = load_model(tmp_path / "ckpt")
    params = dict(model.named_parameters())
    for i in (0, 1):
        for name, tensor in layers[i + 2].items():
            assert torch.equal(params[f"layers.{i}.{ours(name)}"], tensor), name
    assert torch.equal(params["output.weight"], layers[6]["final_linear.weight"])
    with torch.no_grad():
        logits = model.eval()(torch.randint(0, 50000, (2, 16)))
    assert logits.shape == (2, 16, VOCAB) and logits.isfinite().all()


def test_a_tensor_the_rwkv_layer_does_not_have_is_named_in_one_line(tmp_path, capsys):
    write_checkpoint(tmp_path / "neox", extra={"att.time_first": torch.zeros(HEADS, 16)})
    assert convert(tmp_path / "neox", tmp_path / "ckpt") == 2
    err = capsys.readouterr().err
    assert err.count("torchneox: error:") == 1 and "Traceback" not in err
    line = err.splitlines()[-1]
    assert "weights do not match the config: layers.1.time_mix.time_first is not in" in line


def neox_adam(layers: dict, no_decay) -> tuple[dict, dict]:
    """FusedAdam's state as a GPT-NeoX run saves it: index i holds the moments of the i-th
    tensor of get_params_for_weight_decay_optimization's groups, the decayed ones first, then
    those ``no_decay(layer, name)`` names, each in module order (``layers`` lists each layer's
    tensors in that order). Returns it and the moments by (layer, name)."""
    decay, plain = [], []
    for layer in sorted(layers):
        for name in layers[layer]:
            (plain if no_decay(layer, name) else decay).append((layer, name))
    g = torch.Generator().manual_seed(7)
    moments = {
        (layer, name): {
            kind: torch.rand(layers[layer][name].shape, generator=g)
            for kind in ("exp_avg", "exp_avg_sq")
        }
        for layer, name in decay + plain
    }
    state = {i: {"step": 3, **moments[key]} for i, key in enumerate(decay + plain)}
    groups = [
        {"weight_decay": 0.1, "params": list(range(len(decay)))},
        {"weight_decay": 0.0, "params": list(range(len(decay), len(state)))},
    ]
    return {"state": state, "param_groups": groups}, moments


def converted_moments(ckpt, tmp_path) -> dict[str, dict[str, torch.Tensor]]:
    """The Adam moments a converted checkpoint holds, by torchneox's parameter name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from torchneox.checkpoint.files import resolve

    dcp_to_torch_save(resolve(ckpt), tmp_path / "flat.pt")
    return torch.load(tmp_path / "flat.pt", weights_only=False)["optimizer"]["state"]


def test_its_optimizer_state_imports_in_gpt_neox_parameter_order(tmp_path):
    """RWKV's ln1 and ln2 are LayerNorms (no decay); its ln_x is a GroupNorm, whose weight
    GPT-NeoX decays; time_maa_*, time_decay* and time_faaaa decay: each tensor's moments
    land on the parameter they belong to."""
    layers = write_checkpoint(tmp_path / "neox")
    step = tmp_path / "neox" / "global_step10"
    states = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)

    def no_decay(layer: int, name: str) -> bool:
        return name.endswith("bias") or name.startswith(("ln1.", "ln2.", "norm."))

    states["optimizer"], moments = neox_adam(layers, no_decay)
    torch.save(states, step / "mp_rank_00_model_states.pt")
    args = ["convert", "from-gpt-neox", str(tmp_path / "neox"), str(tmp_path / "ckpt")]
    args += ["--with-optimizer", "--set", f"vocab_file={GPT2}/vocab.json"]
    assert main([*args, "--set", f"merge_file={GPT2}/merges.txt"]) == 0
    held = converted_moments(tmp_path / "ckpt", tmp_path)
    top = {0: "embed.weight", 5: "final_norm.", 6: "output.weight"}
    for (layer, name), expected in moments.items():
        if layer in (2, 3):
            mine = f"layers.{layer - 2}.{ours(name)}"
        else:
            mine = top[layer] + (name.removeprefix("norm.") if layer == 5 else "")
        for kind, tensor in expected.items():
            assert torch.equal(held[mine][kind], tensor), (mine, kind)
    assert len(held) == len(moments)
