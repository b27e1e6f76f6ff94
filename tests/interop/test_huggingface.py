"""Logits equal to Hugging Face transformers on random weights, and lossless round trips."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from torchneox.checkpoint.weights import load_model
from torchneox.inference.generate import Sampling, generate
from torchneox.interop import huggingface as convert

transformers = pytest.importorskip("transformers")

VOCAB_20B = 50304  # the GPT-NeoX-20B tokenizer's 50277 ids padded to a multiple of 128


def pythia(layers: int, hidden: int, heads: int, **kw) -> transformers.GPTNeoXConfig:
    base = dict(
        vocab_size=VOCAB_20B,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
    )
    base.update(kw)
    return transformers.GPTNeoXConfig(**base)


def llama(**kw) -> transformers.LlamaConfig:
    base = dict(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _llama_shape(**kw) -> dict:
    """The small Llama's sizes, for the other families' configs."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keys += ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")
    base = llama().to_dict()
    return {k: base[k] for k in keys} | {"tie_word_embeddings": False} | kw


def qwen3(**kw) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(**_llama_shape(**kw))


CASES = {
    "pythia-14m": (transformers.GPTNeoXForCausalLM, lambda: pythia(6, 128, 4)),
    "pythia-70m": (transformers.GPTNeoXForCausalLM, lambda: pythia(6, 512, 8)),
    "sequential-residual": (
        transformers.GPTNeoXForCausalLM,
        lambda: pythia(2, 128, 4, use_parallel_residual=False),
    ),
    "full-rotary": (transformers.GPTNeoXForCausalLM, lambda: pythia(2, 128, 4, rotary_pct=1.0)),
    "tied": (transformers.GPTNeoXForCausalLM, lambda: pythia(2, 128, 4, tie_word_embeddings=True)),
    # the tanh gelu: GPT-NeoX's gelu under bias_gelu_fusion (Pythia's, GPT-J's gelu_new)
    "gelu-new": (transformers.GPTNeoXForCausalLM, lambda: pythia(2, 128, 4, hidden_act="gelu_new")),
    "gelu-pytorch-tanh": (
        transformers.GPTNeoXForCausalLM,
        lambda: pythia(2, 128, 4, hidden_act="gelu_pytorch_tanh"),
    ),
    "llama-gqa": (transformers.LlamaForCausalLM, llama),
    # Qwen2 / Qwen2.5: biases on q, k and v only; small ones tie their embeddings
    "qwen2": (
        transformers.Qwen2ForCausalLM,
        lambda: transformers.Qwen2Config(**(llama().to_dict() | {"model_type": "qwen2"})),
    ),
    "qwen2-tied": (
        transformers.Qwen2ForCausalLM,
        lambda: transformers.Qwen2Config(
            **(llama().to_dict() | {"model_type": "qwen2", "tie_word_embeddings": True})
        ),
    ),
    # Llama 3.1-3.3 (rope_scaling llama3), and linear scaling on both layouts
    "llama3-rope": (
        transformers.LlamaForCausalLM,
        lambda: llama(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama-linear-rope": (
        transformers.LlamaForCausalLM,
        lambda: llama(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    ),
    "pythia-linear-rope": (
        transformers.GPTNeoXForCausalLM,
        lambda: pythia(2, 128, 4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    # dynamic NTK: the 40-token inputs run past the 32 positions it counts from
    "llama-dynamic-rope": (
        transformers.LlamaForCausalLM,
        lambda: llama(
            max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        ),
    ),
    "llama-yarn-rope": (
        transformers.LlamaForCausalLM,
        lambda: llama(
            max_position_embeddings=256,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 16.0,
            },
        ),
    ),
    # Qwen3: each head's queries and keys normalised; heads wider than hidden / heads
    "qwen3": (transformers.Qwen3ForCausalLM, lambda: qwen3(head_dim=32)),
    "qwen3-tied-yarn": (
        transformers.Qwen3ForCausalLM,
        lambda: qwen3(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # OLMo 2: all heads' queries and keys normalised, each sublayer's output normalised
    "olmo2": (
        transformers.Olmo2ForCausalLM,
        lambda: transformers.Olmo2Config(**_llama_shape(), pad_token_id=0, eos_token_id=1),
    ),
    "mixtral": (
        transformers.MixtralForCausalLM,
        lambda: transformers.MixtralConfig(
            **_llama_shape(), num_local_experts=4, num_experts_per_tok=2
        ),
    ),
    "llama-tied": (
        transformers.LlamaForCausalLM,
        lambda: llama(tie_word_embeddings=True, num_key_value_heads=8),
    ),
    "mistral-window": (
        transformers.MistralForCausalLM,
        lambda: transformers.MistralConfig(
            vocab_size=1000,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            max_position_embeddings=256,
        ),
    ),
}


def _hf_model(tmp_path, name):
    cls, make = CASES[name]
    torch.manual_seed(0)
    model = cls(make()).eval()
    with torch.no_grad():  # norms and biases start at 1/0: randomise them so they count
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(tmp_path, name):
    hf_model, folder = _hf_model(tmp_path, name)
    convert.from_hf(folder, tmp_path / "ckpt")
    _, ours = load_model(tmp_path / "ckpt")
    ours.eval()
    tokens = torch.randint(
        0, hf_model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "name",
    [
        "pythia-14m",
        "tied",
        "gelu-new",
        "llama-gqa",
        "llama3-rope",
        "qwen2",
        "qwen2-tied",
        "mistral-window",
        "llama-dynamic-rope",
        "llama-yarn-rope",
        "qwen3",
        "qwen3-tied-yarn",
        "olmo2",
        "mixtral",
    ],
)
def test_round_trip_gives_identical_tensors(tmp_path, name):
    hf_model, folder = _hf_model(tmp_path, name)
    convert.from_hf(folder, tmp_path / "ckpt")
    convert.to_hf(tmp_path / "ckpt", tmp_path / "back")
    original, back = (
        load_file(folder / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    renamed = {"lm_head.weight": "embed_out.weight"} if "GPTNeoX" in type(hf_model).__name__ else {}
    assert {renamed.get(k, k) for k in original} == set(back)
    for key, tensor in original.items():
        assert torch.equal(tensor, back[renamed.get(key, key)]), key
    reloaded = type(hf_model).from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, hf_model.config.vocab_size, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "name, use_cache",
    # (without the cache on the tiny models alone: pythia-70m's 30 uncached forwards are the
    # costliest case and read no other code)
    [(n, c) for n in CASES for c in (True, False) if c or n != "pythia-70m"],
    ids=lambda v: {True: "cache", False: "no-cache"}.get(v, v) if isinstance(v, bool) else v,
)
def test_greedy_generation_equals_transformers(tmp_path, name, use_cache):
    """Token for token, with and without the KV cache (30 new tokens: past the dynamic
    rope's original 32 positions, past Mistral's window)."""
    hf_model, folder = _hf_model(tmp_path, name)
    convert.from_hf(folder, tmp_path / "ckpt")
    _, ours = load_model(tmp_path / "ckpt")
    prompt = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model.generate(
            prompt,
            do_sample=False,
            max_new_tokens=30,
            min_new_tokens=30,
            pad_token_id=0,
            eos_token_id=None,
            use_cache=use_cache,
        )[0, 12:].tolist()
    got = generate(ours, [prompt[0].tolist()], Sampling(maximum_tokens=30, use_cache=use_cache))
    assert got[0] == expected


def test_tanh_gelu_reads_as_bias_gelu_fusion_and_exports_as_gelu_new(tmp_path):
    """A torchneox model trained with bias_gelu_fusion (GPT-NeoX's tanh gelu) exports with the
    hidden_act that computes the same function in transformers."""
    import json

    _, folder = _hf_model(tmp_path, "gelu-pytorch-tanh")
    convert.from_hf(folder, tmp_path / "ckpt")
    loaded, ours = load_model(tmp_path / "ckpt")
    assert loaded.config.model.bias_gelu_fusion is True and ours.args.activation == "gelu_tanh"
    convert.to_hf(tmp_path / "ckpt", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["hidden_act"] == "gelu_new"
    reloaded = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, VOCAB_20B, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.eval()(tokens), reloaded(tokens).logits, atol=1e-5, rtol=1e-5
        )


def test_reads_pytorch_model_bin_folders(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(pythia(2, 64, 4, vocab_size=512)).eval()
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    _, ours = convert.load_hf_model(tmp_path / "hf")
    tokens = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), model(tokens).logits, atol=1e-5, rtol=1e-5)


def test_conversions_never_write_over_what_is_there(tmp_path, capsys):
    """convert from-hf into a run's folder used to repoint its latest; to-hf into a folder
    with files left a stale pytorch_model.bin beside the new weights."""
    from torchneox.cli import main

    _, folder = _hf_model(tmp_path, "tied")
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest").write_text("global_step100\n")
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run}: is not empty" in err and "--force" in err
    assert (run / "latest").read_text() == "global_step100\n"
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    stale = tmp_path / "export"
    stale.mkdir()
    (stale / "pytorch_model.bin").write_bytes(b"old weights")
    assert main(["convert", "to-hf", str(tmp_path / "ckpt"), str(stale)]) == 2
    assert (stale / "pytorch_model.bin").read_bytes() == b"old weights"
    assert main(["convert", "to-hf", str(tmp_path / "ckpt"), str(stale), "--force"]) == 0
    assert sorted(p.name for p in stale.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".*partial*")) and not list(tmp_path.glob(".*old*"))
    transformers.GPTNeoXForCausalLM.from_pretrained(stale)


@pytest.mark.parametrize(
    "extra",
    [
        {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
        {
            "rope_scaling": {"rope_type": "longrope", "factor": 4.0},
            "rope_parameters": {"rope_type": "default"},
        },
    ],
    ids=["longrope-old-spelling", "longrope-beside-default-parameters"],
)
def test_rope_scaling_not_built_is_refused_not_dropped(tmp_path, capsys, extra):
    """A config.json with rope_scaling beside a default rope_parameters converted with exit 0
    and gave logits 0.16 away from transformers'."""
    import json

    from torchneox.cli import main

    _, folder = _hf_model(tmp_path, "llama-gqa")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config | extra))
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("torchneox:")]
    assert len(errors) == 1 and "rope scaling" in errors[0] and "is unbuilt" in errors[0]
    assert str(folder / "config.json") in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name",
    [
        "qwen2",
        "llama3-rope",
        "pythia-linear-rope",
        "qwen3",
        "olmo2",
        "mixtral",
        "llama-dynamic-rope",
    ],
)
def test_explain_counts_the_converted_model(tmp_path, capsys, name):
    """config explain (and estimate, which shares the count) on the config a conversion wrote."""
    from torchneox.config.derive import derive
    from torchneox.config.load import load_config

    _, folder = _hf_model(tmp_path, name)
    convert.from_hf(folder, tmp_path / "ckpt")
    _, ours = load_model(tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "global_step0" / "config.yml"
    counted = derive(load_config([config]))
    assert counted["num_parameters"] == sum(p.numel() for p in ours.parameters())
    from torchneox.cli import main

    capsys.readouterr()  # a converted config has no batch: the estimate asks for one
    assert main(["estimate", str(config), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train_micro_batch_size_per_gpu" in err, err
    batch = ["--set", "train_micro_batch_size_per_gpu=4"]
    assert main(["estimate", str(config), "--gpus", "8", "--json", *batch]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["num_parameters"] == counted["num_parameters"]
    assert sum(estimate["parameters_per_stage"]) == counted["num_parameters"]
