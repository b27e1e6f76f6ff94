"""LoRA from a Hugging Face base and back: a tiny random Llama imported, SFT-trained with
adapters by `torchneox train`, exported as a PEFT adapter folder that peft loads onto the
base, and merged into the weights by plain `convert to-hf`; both compute the trained model's
logits, and training changed the adapters and nothing else."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import post_training_data
from tests.interop.test_post_training_export import converted_model_keys, run, tiny_llama
from torchneox.cli import main
from torchneox.train.weights import load_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "attention.wo", "down_proj"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The base folder, its conversion and the LoRA-SFT run from it."""
    tmp = tmp_path_factory.mktemp("lora")
    data = post_training_data(tmp / "chat")
    hf_in = tiny_llama(tmp / "hf_base", tmp / "chat" / "tokenizer")
    base = tmp / "base"
    assert main(["convert", "from-hf", str(hf_in), str(base)]) == 0
    model_cfg = converted_model_keys(base, tmp)
    sft = run(tmp, "sft", data["sft"] | {"lora": LORA}, base, model_cfg)
    return tmp, hf_in, base, sft


def tokens() -> torch.Tensor:
    return torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def test_only_the_adapters_change(trained):
    _, _, base, sft = trained
    _, before = load_model(base)
    _, after = load_model(sft)
    start = before.state_dict()
    names = list(after.state_dict())
    adapters = [n for n in names if ".lora_" in n]
    assert len(adapters) == 2 * 4 * 2  # 2 layers x 4 targets x (A, B)
    for name, tensor in after.state_dict().items():
        if name in adapters:
            if name.endswith("lora_B.weight"):  # zeros at the start, trained since
                assert tensor.abs().max() > 0, name
        else:
            assert torch.equal(tensor, start[name]), name


def test_peft_loads_the_adapter_and_the_merged_export_equals_it(trained, capsys):
    tmp, hf_in, _, sft = trained
    adapter, merged = tmp / "adapter", tmp / "merged"
    assert main(["convert", "to-hf", "--adapter", str(sft), str(adapter)]) == 0
    assert main(["convert", "to-hf", str(sft), str(merged)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj", "o_proj", "down_proj"]
    from safetensors.torch import load_file

    saved = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in saved
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in saved
    _, ours = load_model(sft)
    ids = tokens()
    base = transformers.LlamaForCausalLM.from_pretrained(hf_in)
    with torch.no_grad():  # the adapters matter: the base alone computes something else
        assert (base(ids).logits - ours(ids)).abs().max() > 1e-3
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    plain = transformers.LlamaForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        expected = ours(ids)
        torch.testing.assert_close(with_adapter(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(plain(ids).logits, expected, rtol=0, atol=1e-5)
    assert not any("lora" in k for k in load_file(merged / "model.safetensors"))


def test_adapter_export_of_a_model_without_adapters_is_one_line(trained, capsys):
    tmp, _, base, _ = trained
    assert main(["convert", "to-hf", "--adapter", str(base), str(tmp / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no LoRA adapters" in err, err
    assert not (tmp / "none").exists()
