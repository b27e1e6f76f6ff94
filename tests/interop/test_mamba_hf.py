"""Mamba <-> transformers' MambaForCausalLM: equal logits and greedy tokens from a random
transformers model converted in, identical tensors back, and one line for what cannot go."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import BASE, VARIANTS, assert_same_safetensors
from torchneox.base.errors import HFError
from torchneox.checkpoint.weights import load_model
from torchneox.config.load import load_mapping
from torchneox.inference.generate import Sampling, generate
from torchneox.interop import huggingface as convert
from torchneox.models.args import model_args
from torchneox.models.hf.architectures import export_architecture
from torchneox.models.hf.mamba import DEFAULTS, neox_keys

transformers = pytest.importorskip("transformers")


def hf_mamba(tmp_path, **kw):
    """A random tiny MambaForCausalLM saved to a folder (norms and biases randomised too)."""
    config = transformers.MambaConfig(
        **{"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "eos_token_id": 0} | kw
    )
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


CASES = {
    "tied": {},
    "untied-no-conv-bias-expand-3": {
        "tie_word_embeddings": False,
        "use_conv_bias": False,
        "expand": 3,
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_and_round_trip_is_identical(tmp_path, case):
    hf_model, folder = hf_mamba(tmp_path, **CASES[case])
    convert.from_hf(folder, tmp_path / "ckpt")
    _, ours = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.eval()(tokens), hf_model(tokens).logits, atol=1e-5, rtol=1e-5
        )
    convert.to_hf(tmp_path / "ckpt", tmp_path / "back")
    assert_same_safetensors(folder, tmp_path / "back")
    reloaded = transformers.MambaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=0, rtol=0)


def test_greedy_generation_equals_transformers(tmp_path):
    hf_model, folder = hf_mamba(tmp_path)
    convert.from_hf(folder, tmp_path / "ckpt")
    _, ours = load_model(tmp_path / "ckpt")
    prompt = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model.generate(
            prompt, do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0,
            eos_token_id=None,
        )[0, 12:].tolist()  # fmt: skip
    assert generate(ours, [prompt[0].tolist()], Sampling(maximum_tokens=20))[0] == expected


def test_the_defaults_are_mamba_configs():
    conf = transformers.MambaConfig()
    for key, value in DEFAULTS.items():
        assert getattr(conf, key) == (value if key != "time_step_rank" else 48), key


@pytest.mark.parametrize(
    "keys,key,fragment",
    [
        ({"use_bias": True}, "use_bias", "without one on x_proj"),
        ({"state_size": 8}, "state_size", "GPT-NeoX's mamba has 16"),
        ({"time_step_rank": 7}, "time_step_rank", "ceil(hidden_size / 16)"),
        ({"hidden_act": "gelu"}, "hidden_act", "silu"),
    ],
)
def test_what_gpt_neox_mamba_cannot_compute_is_refused(keys, key, fragment):
    with pytest.raises(HFError) as err:
        neox_keys({"hidden_size": 64, "num_hidden_layers": 2} | keys)
    assert err.value.key == key and fragment in str(err.value)


@pytest.mark.parametrize(
    "keys,fragment",
    [
        ({"pos_emb": "learned"}, "pos_emb 'learned' (MambaForCausalLM has no positions"),
        ({"norm": "layernorm"}, "norm 'layernorm' (MambaForCausalLM's norms are rmsnorm)"),
        ({"mamba_use_bias_in_linears": True}, "mamba_use_bias_in_linears"),
        ({"attention_config": [[["mamba", "global"], 1]]}, "mixes mamba with other layers"),
    ],
)
def test_export_refuses_in_one_line(keys, fragment):
    base = BASE | VARIANTS["mamba"] | keys
    args = model_args(load_mapping(base, "test"))
    with pytest.raises(HFError) as err:
        export_architecture(args)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    ok = model_args(load_mapping(BASE | VARIANTS["mamba"], "test"))
    assert export_architecture(ok) == "MambaForCausalLM"
