"""What travels beside the weights, and how the weights are written: the tokenizer with its
config, chat template and generation config both ways; exports in the dtype asked, cut into
safetensors shards with an index past the size asked, loaded by `AutoModelForCausalLM` and
`AutoTokenizer` with no flags; and a Llama-3-shaped base (llama3 rope scaling, Llama 3's chat
specials and no <|endoftext|>) SFT-trained on its own chat template, exported, generating
through transformers' chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.helpers import CHAT_WORDS, make_chat_tokenizer, metric_rows
from tests.interop.test_huggingface import _hf_model
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main

transformers = pytest.importorskip("transformers")

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def llama3_tokenizer(folder: Path) -> Path:
    """Characters plus Llama 3's chat specials; eos is <|eot_id|>, as Llama 3 Instruct's is,
    and there is no <|endoftext|>. A generation_config.json with Llama 3's list of eos ids."""
    specials = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    make_chat_tokenizer(folder, LLAMA3_TEMPLATE, LLAMA3_SPECIALS, specials)
    generation = {"bos_token_id": 0, "eos_token_id": [1, 4], "temperature": 0.6, "top_p": 0.9}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def llama3_base(folder: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=4, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return llama3_tokenizer(folder)  # after: save_pretrained writes a generation_config.json


def test_llama3_base_sft_on_its_chat_template_exports_and_chats_in_transformers(tmp_path, capsys):
    import random

    hf_in = llama3_base(tmp_path / "hf_base")
    rng = random.Random(0)
    chats = []
    for _ in range(40):
        user = " ".join(rng.choice(CHAT_WORDS) for _ in range(2))
        answer = " ".join(rng.choice(CHAT_WORDS) for _ in range(3))
        chats.append({"messages": [{"role": "user", "content": user.capitalize() + "?"},
                                   {"role": "assistant", "content": answer.capitalize() + "."}]})  # fmt: skip
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in chats))
    base = tmp_path / "base"
    assert main(["convert", "from-hf", str(hf_in), str(base)]) == 0
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (base / name).read_bytes() == (hf_in / name).read_bytes()
    prefix = tmp_path / "data" / "sft"
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(jsonl),
                "--output-prefix",
                str(prefix),
                "--tokenizer-path",
                str(base),
                "--jsonl-keys",
                "messages",
            ]
        )
        == 0
    )
    keys = {
        "train_data_paths": [f"{prefix}_messages_document"],
        "train_label_data_paths": [f"{prefix}_messages_label_document"],
        "valid_data_paths": [f"{prefix}_messages_document"],
        "valid_label_data_paths": [f"{prefix}_messages_label_document"],
        "pack_impl": "unpacked",
        "train_micro_batch_size_per_gpu": 4,
        "train_iters": 6,
        "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
        "lr_decay_style": "constant",
        "num_workers": 0,
        "eval_interval": 100,
        "eval_iters": 1,
        "log_interval": 1,
        "finetune": True,
        "load": str(base),
        "save": str(tmp_path / "sft"),
        "log_dir": str(tmp_path / "sft"),
    }
    (tmp_path / "sft.yml").write_text(json.dumps(keys))
    config = base / "global_step0" / "config.yml"
    assert main(["train", str(config), str(tmp_path / "sft.yml"), "--set", "seq_length=64"]) == 0
    sft_losses = [r["lm_loss"] for r in metric_rows(tmp_path / "sft") if "lm_loss" in r]
    assert sft_losses[-1] < sft_losses[0]
    out = tmp_path / "hf_sft"
    assert main(["convert", "to-hf", str(tmp_path / "sft"), str(out)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_in / name).read_bytes(), name
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == [1, 4]
    chat = [{"role": "user", "content": "Speak now?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert tok.decode(ids[0]).startswith("<|begin_of_text|><|start_header_id|>user")
    generated = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert generated.shape[1] > ids.shape[1]
    loaded, ours = load_model(tmp_path / "sft")
    with torch.no_grad():
        torch.testing.assert_close(ours(generated), model(generated).logits, rtol=1e-4, atol=1e-4)
    # `torchneox generate` stops where the generation config says: at any of its eos ids
    from torchneox.data.tokenizers import build_tokenizer
    from torchneox.inference.generate import Sampling, generate, generation_stop_ids

    assert generation_stop_ids(loaded.config.tokenizer.vocab_file) == {1, 4}
    text = "Speak now?"
    ids = build_tokenizer(loaded.config.tokenizer).encode(text)
    whole = generate(ours, [ids], Sampling(maximum_tokens=12))[0]
    # make the second new token one of the eos ids: generation must stop before it
    assert whole[1] not in (whole[0], 1, 4)
    config_file = Path(loaded.config.tokenizer.vocab_file).with_name("generation_config.json")
    config_file.write_text(json.dumps({"eos_token_id": [1, whole[1]]}))
    capsys.readouterr()
    flags = ["--prompt", text, "--temperature", "0", "--maximum-tokens", "12"]
    assert main(["generate", "--checkpoint", str(tmp_path / "sft"), *flags]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(whole[:1])


def test_export_in_bf16_cut_into_shards_with_an_index(tmp_path):
    _, folder = _hf_model(tmp_path, "qwen3")
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "bf16"
    assert (
        main(
            [
                "convert",
                "to-hf",
                str(tmp_path / "ckpt"),
                str(out),
                "--dtype",
                "bf16",
                "--max-shard-size",
                "200KB",
            ]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    assert shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    total = 0
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        size = sum(t.nbytes for t in tensors.values())
        assert size <= 200_000 or len(tensors) == 1, shard  # a larger tensor has a shard alone
        assert {index["weight_map"][n] for n in tensors} == {shard}
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        total += size
    assert index["metadata"]["total_size"] == total
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # transformers loads the shards; in fp32 it computes what the bf16-rounded model computes
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    _, ours = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(p.to(torch.bfloat16))
        tokens = torch.randint(0, 1000, (2, 24))
        torch.testing.assert_close(
            reloaded(tokens).logits, ours.eval()(tokens), atol=1e-5, rtol=1e-5
        )
    # and the sharded export converts back in
    assert main(["convert", "from-hf", str(out), str(tmp_path / "again")]) == 0
    _, again = load_model(tmp_path / "again")
    for (name, a), b in zip(again.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.equal(a.float(), b), name


def test_a_truncated_shard_is_named_in_one_line(tmp_path, capsys):
    _, folder = _hf_model(tmp_path, "llama-gqa")
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "sharded"
    assert (
        main(["convert", "to-hf", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "300KB"])
        == 0
    )
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["convert", "from-hf", str(out), str(tmp_path / "again")]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("torchneox:")]
    assert len(err) == 1 and str(shard) in err[0] and "truncated" in err[0], err
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("size", ["0", "big", "-5MB"])
def test_a_bad_shard_size_is_one_line(tmp_path, capsys, size):
    status = main(
        ["convert", "to-hf", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", size]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "--max-shard-size" in err, err


def test_a_bf16_hub_model_stays_one_bf16_copy_and_comes_back_identical(tmp_path):
    """A bf16 model (as the hub holds them) is kept in bf16: the export loads it in the dtype
    the checkpoint stores (one copy, not an fp32 one) and writes back the same bytes."""
    from safetensors.torch import load_file

    hf_model, folder = _hf_model(tmp_path, "mixtral")
    hf_model.to(torch.bfloat16).save_pretrained(folder)
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    _, stored = load_model(tmp_path / "ckpt", stored_dtype=True)
    assert {p.dtype for p in stored.parameters()} == {torch.bfloat16}
    out = tmp_path / "back"
    assert main(["convert", "to-hf", str(tmp_path / "ckpt"), str(out), "--dtype", "bf16"]) == 0
    original, back = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(original) == set(back)
    for name, tensor in original.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(tensor, back[name]), name


def test_generate_without_the_model_s_tokenizer_says_what_is_missing(tmp_path, capsys):
    """A checkpoint whose config names no tokenizer file, or one that is not here, is refused
    naming its config, the missing file and the option that passes one (it used to ask for a
    GPT-2 tokenizer's vocab_file the user never chose)."""
    _, folder = _hf_model(tmp_path, "llama-gqa")  # no tokenizer in the folder
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "bare")]) == 0
    config = tmp_path / "bare" / "global_step0" / "config.yml"
    capsys.readouterr()
    generate = ["generate", "--prompt", "ab", "--maximum-tokens", "2", "--device", "cpu"]
    assert main([*generate, "--checkpoint", str(tmp_path / "bare")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPT2" not in err, err
    assert f"{config}: no tokenizer file is named or found" in err, err
    assert "--set tokenizer_type=HFTokenizer --set vocab_file=PATH/tokenizer.json" in err
    assert main([*generate, "--hf", str(folder)]) == 2
    assert f"{folder}: no tokenizer file is named or found" in capsys.readouterr().err
    # the config names a tokenizer.json that is gone (a run moved off its cluster)
    make_chat_tokenizer(folder)
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "named")]) == 0
    (tmp_path / "named" / "tokenizer.json").unlink()
    capsys.readouterr()
    assert main([*generate, "--checkpoint", str(tmp_path / "named")]) == 2
    err = capsys.readouterr().err
    missing = tmp_path / "named" / "tokenizer.json"
    assert err.count("\n") == 1, err
    assert f"names the HFTokenizer tokenizer's vocab_file {missing}, which is not here" in err
    assert "pass it with --set vocab_file=PATH" in err
    # and the option named works
    make_chat_tokenizer(tmp_path / "tok")
    vocab = f"vocab_file={tmp_path / 'tok' / 'tokenizer.json'}"
    assert main([*generate, "--checkpoint", str(tmp_path / "named"), "--set", vocab]) == 0


def test_a_config_with_model_type_but_no_architectures_converts(tmp_path):
    """transformers' AutoModelForCausalLM builds a model from model_type alone; so does
    convert from-hf, to the same logits."""
    hf_model, folder = _hf_model(tmp_path, "llama-gqa")
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    _, ours = load_model(tmp_path / "ckpt")
    tokens = torch.arange(12).view(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(
            ours.eval()(tokens), hf_model(tokens).logits, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_a_companion_that_is_not_json_is_named_at_conversion(tmp_path, capsys, name):
    """It was copied along silently (and ignored by generate later)."""
    _, folder = _hf_model(tmp_path, "llama-gqa")
    (folder / name).write_text('{"eos_token": "<|endoftext|>",')
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{folder / name}: is not valid JSON" in err, err
    assert not (tmp_path / "ckpt").exists()


def test_a_folder_with_both_weight_layouts_says_which_it_reads(tmp_path, capsys):
    """model.safetensors beside a sharded index: the single file is read, as transformers
    reads it, and the conversion says so."""
    _, folder = _hf_model(tmp_path, "llama-gqa")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    assert "reading model.safetensors, as transformers does" in capsys.readouterr().err


def test_chat_preprocessing_reads_a_chat_template_jinja_without_tokenizer_config(tmp_path):
    """A tokenizer folder holding tokenizer.json and chat_template.jinja only (transformers
    reads the template from it): preprocess --chat renders with it."""
    tok = make_chat_tokenizer(tmp_path / "tok")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "chat_template.jinja").write_text(config["chat_template"])
    (tok / "tokenizer_config.json").unlink()
    data = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    args = ["preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "d")]
    args += ["--tokenizer-path", str(tok), "--jsonl-keys", "messages"]
    assert main(args) == 0
    assert (tmp_path / "d_messages_document.bin").stat().st_size > 0
