"""From a base model on the Hugging Face hub's format to an aligned one and back: a tiny Llama
imported from Hugging Face, SFT-trained on chat data preprocessed here, DPO-trained from the
SFT model, exported with its tokenizer and chat template, and generating in `transformers`
from a chat prompt; a reward model exported as a sequence-classification model whose scores
`transformers` computes equal torchneox's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import metric_rows, post_training_data
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main

transformers = pytest.importorskip("transformers")

TRAINING = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "train_iters": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8}},
    "lr_decay_style": "constant",
    "warmup": 0.0,
    "seq_length": 64,
    "num_workers": 0,
    "eval_interval": 100,
    "eval_iters": 1,
    "log_interval": 1,
    "finetune": True,
}


def tiny_llama(folder: Path, tokenizer: Path) -> Path:
    """A randomly initialised 2-layer Llama saved as Hugging Face saves one, with the chat
    tokenizer (tokenizer.json and tokenizer_config.json with its chat template)."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer / name).read_bytes())
    return folder


def run(tmp_path: Path, name: str, keys: dict, load: Path, base_config: Path) -> Path:
    """Train the converted model's config (its model keys) with ``keys`` on top."""
    save = tmp_path / name
    cfg = tmp_path / f"{name}.yml"
    keys = {k: v for k, v in keys.items() if k not in ("tokenizer_type", "vocab_file")}
    cfg.write_text(json.dumps(keys | TRAINING | {"save": str(save), "load": str(load)}))
    assert main(["train", str(base_config), str(cfg), "--set", f"log_dir={save}"]) == 0
    return save


def converted_model_keys(ckpt: Path, tmp_path: Path) -> Path:
    """The converted checkpoint's model and tokenizer keys as a config file of their own."""
    import yaml

    values = yaml.safe_load((ckpt / "global_step0" / "config.yml").read_text())
    keep = {k: v for k, v in values.items() if k not in TRAINING and k != "train_batch_size"}
    path = tmp_path / "model.yml"
    path.write_text(json.dumps(keep))
    return path


def test_hugging_face_base_model_sft_then_dpo_then_back_to_hugging_face(tmp_path):
    data = post_training_data(tmp_path / "chat")
    hf_in = tiny_llama(tmp_path / "hf_base", tmp_path / "chat" / "tokenizer")
    base = tmp_path / "base"
    assert main(["convert", "from-hf", str(hf_in), str(base)]) == 0
    model_cfg = converted_model_keys(base, tmp_path)
    sft = run(tmp_path, "sft", data["sft"], base, model_cfg)
    sft_losses = [r["lm_loss"] for r in metric_rows(sft) if "lm_loss" in r]
    assert sft_losses[-1] < sft_losses[0]
    dpo = run(tmp_path, "dpo", data["dpo"], sft, model_cfg)
    rows = [r for r in metric_rows(dpo) if "lm_loss" in r]
    assert rows[0]["lm_loss"] == pytest.approx(0.6931472, abs=1e-5)  # reference = SFT model
    assert rows[-1]["reward_acc"] >= 0.0 and "chosen_rewards" in rows[-1]
    out = tmp_path / "hf_aligned"
    assert main(["convert", "to-hf", str(dpo), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (
        tok.chat_template
        == json.loads((hf_in / "tokenizer_config.json").read_text())["chat_template"]
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    chat = [{"role": "user", "content": "Speak now."}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert tok.decode(ids[0]).endswith("<|assistant|>")
    generated = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > ids.shape[1]
    # the export computes what the torchneox checkpoint computes
    _, ours = load_model(dpo)
    with torch.no_grad():
        theirs = model(generated).logits
        torch.testing.assert_close(ours(generated), theirs, rtol=1e-4, atol=1e-4)


def test_reward_model_exports_as_sequence_classification_with_the_same_scores(tmp_path):
    data = post_training_data(tmp_path / "chat")
    hf_in = tiny_llama(tmp_path / "hf_base", tmp_path / "chat" / "tokenizer")
    base = tmp_path / "base"
    assert main(["convert", "from-hf", str(hf_in), str(base)]) == 0
    rm = run(tmp_path, "rm", data["rm"], base, converted_model_keys(base, tmp_path))
    out = tmp_path / "hf_rm"
    assert main(["convert", "to-hf", str(rm), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    scorer = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    # a preprocessed reward sample: the chat, then end-of-text twice (the value is read there)
    from torchneox.data.indexed import IndexedDataset

    chosen = IndexedDataset(data["rm"]["pos_train_data_paths"][0])
    _, ours = load_model(rm)
    for i in range(3):
        ids = torch.tensor(chosen[i].astype("int64"))[None]
        with torch.no_grad():
            score = scorer(ids).logits[0, 0]
            value = ours(ids)[0, -1, 0]
        assert score.item() == pytest.approx(value.item(), rel=1e-4, abs=1e-5)
    assert tok.eos_token == "<|endoftext|>"
