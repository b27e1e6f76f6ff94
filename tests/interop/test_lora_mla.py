"""LoRA on multi-head latent attention: a tiny random DeepseekV3 imported from Hugging Face,
SFT-trained by `torchneox train` with adapters on every MLA projection (q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj); training changes the adapters alone, and the PEFT
adapter folder that `convert to-hf --adapter` writes (the query and rotary-key B rows in
DeepSeek's interleaved order) makes peft compute the trained model's logits on the base, as
the merged `convert to-hf` export does."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import post_training_data
from tests.interop.test_hf_deepseek import hf_folder
from tests.interop.test_post_training_export import converted_model_keys, run
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
OURS = ("attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b", "attention.wo")


def test_lora_on_mla_trains_its_adapters_and_peft_computes_the_trained_model(tmp_path):
    data = post_training_data(tmp_path / "chat", only=("sft",))
    hf_model, hf_in = hf_folder(tmp_path, eos_token_id=0, bos_token_id=0, pad_token_id=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_in / name).write_bytes((tmp_path / "chat" / "tokenizer" / name).read_bytes())
    base = tmp_path / "base"
    assert main(["convert", "from-hf", str(hf_in), str(base)]) == 0
    lora = {"rank": 4, "alpha": 8, "target_modules": TARGETS}
    sft = run(
        tmp_path, "sft", data["sft"] | {"lora": lora}, base, converted_model_keys(base, tmp_path)
    )
    _, before = load_model(base)
    _, after = load_model(sft)
    start, now = before.state_dict(), after.state_dict()
    adapters = {n for n in now if ".lora_" in n}
    assert adapters == {
        f"layers.{i}.{m}.lora_{x}.weight" for i in range(3) for m in OURS for x in "AB"
    }
    assert all(now[n].abs().max() > 0 for n in adapters if "lora_B" in n)  # trained from zeros
    assert all(torch.equal(t, start[n]) for n, t in now.items() if n not in adapters)

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["convert", "to-hf", "--adapter", str(sft), str(adapter)]) == 0
    assert main(["convert", "to-hf", str(sft), str(merged)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == TARGETS
    ids = torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = after.eval()(ids)
        assert (hf_model(ids).logits - expected).abs().max() > 1e-3  # the adapters matter
        with_adapter = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
        torch.testing.assert_close(with_adapter(ids).logits, expected, rtol=0, atol=1e-5)
        plain = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
        torch.testing.assert_close(plain(ids).logits, expected, rtol=0, atol=1e-5)
