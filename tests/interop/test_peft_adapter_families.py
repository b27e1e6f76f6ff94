"""`convert to-hf --adapter` beyond the Llama family: a GPTNeoX (its q, k and v adapters as one
adapter of the fused query_key_value), a Mamba (in_proj, x_proj, dt_proj, out_proj) and a
reward model (its value head as the score layer PEFT saves whole). Each adapter, loaded by
peft onto the Hugging Face base it was trained from, computes the torchneox model's outputs."""

from __future__ import annotations

import json

import pytest
import torch

from tests.interop.test_huggingface import pythia
from torchneox.checkpoint.files import save_checkpoint
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.report import render_yaml
from torchneox.interop.huggingface import from_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def hf_models() -> dict:
    """The tiny random Hugging Face bases, each with the lora key its run trains."""
    llama = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_labels=1, pad_token_id=95,
    )  # fmt: skip
    neox = pythia(2, 32, 4, vocab_size=96, max_position_embeddings=64)
    mamba = transformers.MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2)
    return {
        "gpt-neox": (
            transformers.GPTNeoXForCausalLM(neox),
            ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "mlp.up"],
        ),
        "gpt-neox-k-only": (transformers.GPTNeoXForCausalLM(neox), ["attention.wk"]),
        "mamba": (
            transformers.MambaForCausalLM(mamba),
            ["in_proj", "x_proj"],
        ),
        "reward-model": (
            transformers.LlamaForSequenceClassification(llama),
            ["q_proj", "v_proj", "down_proj"],
        ),
    }


def trained_checkpoint(tmp_path, hf_dir, targets: list[str], folder: str = "lora"):
    """The base converted in, with adapters on ``targets`` drawn at random (B too, and a
    reward model's value head moved), as a run would have trained them."""
    if not (tmp_path / "base").is_dir():
        from_hf(hf_dir, tmp_path / "base")
    lora = {"rank": 2, "alpha": 6, "target_modules": targets}
    loaded, model = load_model(tmp_path / "base", [f"lora={json.dumps(lora)}"])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name or name == "value_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    yaml = render_yaml(loaded, derive(loaded))
    save_checkpoint(tmp_path / folder, 0, {"model": model.state_dict()}, yaml)
    return model.eval()


@pytest.mark.parametrize("case", ["gpt-neox", "gpt-neox-k-only", "mamba", "reward-model"])
def test_peft_puts_the_exported_adapter_on_the_hf_base_and_computes_ours(tmp_path, case, capsys):
    torch.manual_seed(0)
    hf_model, targets = hf_models()[case]
    hf_model.save_pretrained(tmp_path / "hf")
    ours = trained_checkpoint(tmp_path, tmp_path / "hf", targets)
    assert main(["convert", "to-hf", "--adapter", str(tmp_path / "lora"), str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    ids = torch.randint(0, 95, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(ids)[:, -1, :] if case == "reward-model" else ours(ids)
        base = hf_model.eval()(ids).logits
        assert (base - expected).abs().max() > 1e-3  # the adapters change what it computes
        adapted = peft.PeftModel.from_pretrained(hf_model, tmp_path / "a").eval()
        torch.testing.assert_close(adapted(ids).logits, expected, rtol=0, atol=1e-5)
    if case == "gpt-neox":  # q, k, v stacked into rank 6, alpha 18: the scale kept
        assert config["target_modules"] == [
            "query_key_value", "dense", "dense_h_to_4h",
        ]  # fmt: skip
        assert config["rank_pattern"] == {"query_key_value": 6}
        assert config["alpha_pattern"] == {"query_key_value": 18}
    if case == "reward-model":
        assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    if case == "mamba":  # transformers reads dt_proj.weight itself: refused in one line
        trained_checkpoint(tmp_path, tmp_path / "hf", ["dt_proj", "out_proj"], "dt")
        out = tmp_path / "b"
        capsys.readouterr()
        assert main(["convert", "to-hf", "--adapter", str(tmp_path / "dt"), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot write an adapter of mamba.dt_proj" in err, err
        assert not out.exists()


def test_adapters_on_moe_experts_are_refused_in_one_line(tmp_path, capsys):
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "hf")
    trained_checkpoint(tmp_path, tmp_path / "hf", ["q_proj", "up_proj"])
    out = tmp_path / "a"
    capsys.readouterr()
    assert main(["convert", "to-hf", "--adapter", str(tmp_path / "lora"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--adapter cannot write the adapters of the MoE experts (mlp.up)" in err, err
    assert not out.exists()
