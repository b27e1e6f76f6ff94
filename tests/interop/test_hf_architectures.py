"""Every Hugging Face architecture torchneox maps, end to end as a user runs it: converted in,
trained a few steps with `torchneox train`, converted back, and reloaded by transformers to
the logits the trained torchneox checkpoint computes; what cannot be mapped is refused in one
line. (Logits, round trips and greedy generation at import: test_huggingface.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers import BASE, VARIANTS, metric_rows
from tests.interop.test_huggingface import CASES, _hf_model
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.data.indexed import IndexedDatasetWriter

transformers = pytest.importorskip("transformers")

TRAINING = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "train_iters": 3,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8}},
    "lr_decay_style": "constant",
    "warmup": 0.0,
    "num_workers": 0,
    "eval_interval": 100,
    "eval_iters": 1,
    "log_interval": 1,
    "finetune": True,
    "split": "100,0,0",
}
TRAINED = [
    "llama3-rope",
    "llama-linear-rope",
    "llama-yarn-rope",
    "llama-dynamic-rope",
    "qwen2-tied",
    "qwen3",
    "qwen3-tied-yarn",
    "olmo2",
    "mixtral",
    "mistral-window",
    "gelu-new",
]


def random_tokens(prefix, vocab: int) -> str:
    writer = IndexedDatasetWriter(prefix, np.dtype(np.int32))
    rng = np.random.default_rng(0)
    for _ in range(64):
        writer.add_document(rng.integers(1, vocab, 40))
    writer.finish()
    return str(prefix)


@pytest.mark.parametrize("name", TRAINED)
def test_converts_in_trains_and_exports_with_equal_logits(tmp_path, name):
    hf_model, folder = _hf_model(tmp_path, name)
    base = tmp_path / "base"
    assert main(["convert", "from-hf", str(folder), str(base)]) == 0
    run = tmp_path / "run"
    keys = TRAINING | {
        "data_path": random_tokens(tmp_path / "tokens", hf_model.config.vocab_size),
        "load": str(base),
        "save": str(run),
        "log_dir": str(run),
    }
    (tmp_path / "train.yml").write_text(json.dumps(keys))
    config = base / "global_step0" / "config.yml"
    assert main(["train", str(config), str(tmp_path / "train.yml"), "--set", "seq_length=32"]) == 0
    assert len([r for r in metric_rows(run) if "lm_loss" in r]) == 3
    out = tmp_path / "back"
    assert main(["convert", "to-hf", str(run), str(out)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    _, trained = load_model(run)
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 40))
    with torch.no_grad():
        ours = trained.eval()(tokens)
        torch.testing.assert_close(reloaded(tokens).logits, ours, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(hf_model(tokens).logits, ours, atol=1e-3)  # it trained


def test_every_architecture_and_rope_scaling_is_trained():
    assert {CASES[n][0] for n in TRAINED} == {family for family, _ in CASES.values()}
    scalings = {
        (make().to_dict().get("rope_scaling") or {}).get("rope_type") for _, make in CASES.values()
    }
    trained = {
        (CASES[n][1]().to_dict().get("rope_scaling") or {}).get("rope_type") for n in TRAINED
    }
    assert scalings == trained


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        ({"architectures": ["Gemma2ForCausalLM"]}, "architecture 'Gemma2ForCausalLM'"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not mapped"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
    ids=["architecture", "router-jitter", "layer-types", "qwen3-sliding", "activation"],
)
def test_unmapped_options_are_refused_in_one_line(tmp_path, capsys, edit, fragment):
    name = "mixtral" if "router" in fragment else "qwen3"
    _, folder = _hf_model(tmp_path, name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | edit))
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and str(folder / "config.json") in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            "model.layers.0.mlp.extra_proj.weight",
            "model.layers.0.mlp.extra_proj.weight is not mapped",
        ),
        ("model.layers.0.self_attn.q_norm.bias", "unexpected layers.0.attention.q_norm.bias"),
    ],
    ids=["unknown-module", "undeclared-bias"],
)
def test_a_tensor_the_model_does_not_have_is_refused(tmp_path, capsys, extra, fragment):
    """An extra weight (a module no rule names, a bias the config does not declare) is
    refused, not dropped."""
    from safetensors.torch import load_file, save_file

    _, folder = _hf_model(tmp_path, "qwen3")
    weights = load_file(folder / "model.safetensors")
    weights[extra] = torch.zeros(32)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and str(folder) in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", TRAINED)
def test_generate_and_eval_run_on_the_converted_model(tmp_path, capsys, name):
    """`torchneox generate` continues a prompt as transformers does greedily; `torchneox eval`
    gives transformers' loss on the same samples."""
    from tests.helpers import make_chat_tokenizer
    from torchneox.data.gpt_dataset import GPTDataset
    from torchneox.data.indexed import IndexedDataset

    hf_model, folder = _hf_model(tmp_path, name)
    with torch.no_grad():  # the end-of-text (id 0) never the likeliest: continuations run on
        hf_model.get_output_embeddings().weight[0] = 0.0
    hf_model.save_pretrained(folder)
    make_chat_tokenizer(folder)
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "from-hf", str(folder), str(ckpt)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok("thou art the king", return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = hf_model.generate(
            prompt, do_sample=False, max_new_tokens=10, min_new_tokens=10, eos_token_id=None,
            pad_token_id=0,
        )[0, prompt.shape[1] :]  # fmt: skip
    capsys.readouterr()
    flags = ["--prompt", "thou art the king", "--temperature", "0", "--maximum-tokens", "10"]
    assert main(["generate", "--checkpoint", str(ckpt), *flags]) == 0
    assert tok.decode(greedy) in capsys.readouterr().out
    data = random_tokens(tmp_path / "tokens", 77)
    assert main(["eval", "--checkpoint", str(ckpt), "--data-path", data, "--iters", "2",
                 "--batch-size", "2", "--set", "seq_length=32"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ds = IndexedDataset(data)
    seq = 32
    assert result["batches"] == 2 and result["tokens"] == 2 * 2 * seq
    samples = GPTDataset(ds, "eval", np.arange(len(ds), dtype=np.int32), 4, seq, 1234)
    losses = []
    with torch.no_grad():
        for b in range(2):
            rows = torch.from_numpy(np.stack([samples[2 * b], samples[2 * b + 1]])).long()
            logits = hf_model(rows[:, :-1]).logits
            losses.append(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
            )
    assert result["lm_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)


MOE_RUN = (
    BASE
    | VARIANTS["rmsnorm-swiglu-gqa"]
    | {
        "mlp_multiple_of": 8,  # transformers' expert kernels want 16-byte rows
        "no_weight_tying": True,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_router_type": "topk",
        "moe_renormalize_top_k": True,
        "train_micro_batch_size_per_gpu": 2,
        "train_iters": 3,
        "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
        "eval_interval": 100,
        "eval_iters": 1,
        "num_workers": 0,
    }
)


def test_a_torchneox_moe_run_exports_as_mixtral(tmp_path, capsys):
    """A mixture-of-experts model trained in torchneox (not converted from anywhere) comes out
    as Mixtral, computing in transformers what it computes here; with GPT-NeoX's gates, which
    are not renormalised, it is refused in one line naming the key to set."""
    run = tmp_path / "run"
    cfg = tmp_path / "moe.yml"
    data = {"data_path": random_tokens(tmp_path / "tokens", 256), "split": "100,0,0"}
    cfg.write_text(json.dumps(MOE_RUN | data | {"save": str(run), "log_dir": str(run)}))
    assert main(["train", str(cfg)]) == 0
    out = tmp_path / "mixtral"
    assert main(["convert", "to-hf", str(run), str(out)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    _, ours = load_model(run)
    tokens = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(tokens).logits, ours.eval()(tokens), atol=1e-5, rtol=1e-5
        )
    neox = tmp_path / "neox"
    keys = (
        MOE_RUN | data | {"moe_renormalize_top_k": False, "save": str(neox), "log_dir": str(neox)}
    )
    cfg.write_text(json.dumps(keys | {"train_iters": 1}))
    assert main(["train", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["convert", "to-hf", str(neox), str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moe_renormalize_top_k: true" in err, err
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "pythia-14m"])
def test_a_reward_model_converts_in_with_its_scores(tmp_path, capsys, name):
    """*ForSequenceClassification with one label: a reward model (train_impl rm) whose value
    at the last token is transformers' score; a classifier of several labels is refused."""
    family, make = CASES[name]
    config = make()
    config.num_labels = 1
    config.pad_token_id = 0
    cls = getattr(transformers, family.__name__.replace("ForCausalLM", "ForSequenceClassification"))
    torch.manual_seed(0)
    scorer = cls(config).eval()
    folder = tmp_path / "rm"
    scorer.save_pretrained(folder)
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    loaded, ours = load_model(tmp_path / "ckpt")
    assert loaded.config.training.train_impl == "rm" and ours.value_head is not None
    tokens = torch.randint(1, 500, (3, 20))
    with torch.no_grad():
        expected = scorer(tokens).logits[:, 0]
        torch.testing.assert_close(ours.eval()(tokens)[:, -1, 0], expected, atol=1e-5, rtol=1e-5)
    raw = json.loads((folder / "config.json").read_text())
    raw |= {"num_labels": 3, "id2label": {str(i): f"L{i}" for i in range(3)}}
    (folder / "config.json").write_text(json.dumps(raw))
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "classifier")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_labels 3 is a classifier" in err, err
