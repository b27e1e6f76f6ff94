"""Training straight from a Hugging Face folder (``load``) and into one (``save_hf``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import losses, weights
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.interop import huggingface as convert
from torchneox.models.hf import architectures as hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **SHAPE,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    ),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            **SHAPE,
            intermediate_size=128,
            max_position_embeddings=64,
            rotary_pct=0.5,
            tie_word_embeddings=False,
        )
    ),
}
TRAINING = {  # what the run sets besides the model: the folder gives the model
    "seq_length": 32,
    "train_iters": 3,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8}},
    "lr_decay_style": "constant",
    "precision": "fp32",
    "seed": 7,
    "tokenizer_type": "CharLevelTokenizer",
    "split": "90,8,2",
    "num_workers": 0,
    "eval_interval": 1000,
    "eval_iters": 1,
    "log_interval": 1,
    "hidden_dropout": 0.0,
}


def hf_folder(tmp_path: Path, family: str, shards: bool = False) -> Path:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    with torch.no_grad():  # norms and biases away from their initial values too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = tmp_path / f"hf-{family}"
    model.save_pretrained(folder, max_shard_size="40KB" if shards else "5GB")
    return folder


def write_config(path: Path, **keys) -> str:
    path.write_text(json.dumps(TRAINING | keys))
    return str(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_load_hf_folder_trains_as_convert_then_train(tmp_path, tiny_data, family):
    folder = hf_folder(tmp_path, family, shards=family == "llama")
    if family == "llama":  # sharded: the index names each file
        assert (folder / "model.safetensors.index.json").is_file()
    # convert, then train from the converted checkpoint with the keys convert derived
    converted = tmp_path / "converted"
    convert.from_hf(folder, converted)
    keys = hf.neox_config_from_hf(hf.read_config(folder)) | {"seq_length": 32}
    old = write_config(
        tmp_path / "old.yml",
        **keys,
        data_path=str(tiny_data),
        load=str(converted),
        save=str(tmp_path / "old"),
    )
    assert main(["train", old]) == 0
    # straight from the folder: no model keys given
    new = write_config(
        tmp_path / "new.yml", data_path=str(tiny_data), load=str(folder), save=str(tmp_path / "new")
    )
    assert main(["train", new]) == 0
    got, want = losses(tmp_path / "new"), losses(tmp_path / "old")
    assert sorted(got) == [1, 2, 3] and got == want  # bitwise
    ours, theirs = weights(tmp_path / "new"), weights(tmp_path / "old")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_save_hf_loads_in_transformers_with_the_trained_logits(tmp_path, tiny_data, capsys):
    folder = hf_folder(tmp_path, "llama")
    out = tmp_path / "run" / "hf"
    cfg = write_config(
        tmp_path / "c.yml",
        data_path=str(tiny_data),
        load=str(folder),
        save=str(tmp_path / "run"),
        save_hf=str(out),
    )
    assert main(["train", cfg]) == 0
    assert f"wrote the Hugging Face folder {out}" in capsys.readouterr().out
    _, model = load_model(tmp_path / "run")  # the last checkpoint: the trained weights
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens).float(), theirs(tokens).logits, atol=1e-5, rtol=1e-5
        )
    trained = theirs.model.layers[0].self_attn.q_proj.weight
    start = transformers.AutoModelForCausalLM.from_pretrained(folder).model.layers[0]
    assert not torch.equal(trained, start.self_attn.q_proj.weight)  # it did train
    # the same command again, one step further: it resumes from save's checkpoint (the folder
    # gave only the first weights), and save_hf replaces the folder this run wrote without
    # --force (save records it); another run's save_hf over it would need --force
    before = (out / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "run" / "save_hf.json").read_text()) == {
        "save_hf": str(out.resolve())
    }
    assert main(["train", cfg, "--set", "train_iters=4"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    assert (out / "model.safetensors").read_bytes() != before


def test_config_explain_shows_the_folder_and_its_keys(tmp_path, tiny_data, capsys):
    folder = hf_folder(tmp_path, "llama")
    cfg = write_config(tmp_path / "c.yml", data_path=str(tiny_data), load=str(folder))
    assert main(["config", "explain", cfg]) == 0
    text = capsys.readouterr().out
    assert f"model: the Hugging Face folder {folder} (LlamaForCausalLM)" in text
    assert "num_layers 2" in text and "num_kv_heads 2" in text and "hidden_size 32" in text


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_errors_are_one_line(tmp_path, tiny_data, capsys):
    folder = hf_folder(tmp_path, "llama")
    capsys.readouterr()  # (transformers' progress bars)
    data = str(tiny_data)
    # a folder of weights without config.json
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    cfg = write_config(tmp_path / "a.yml", data_path=data, load=str(bare))
    err = one_line_error(capsys, ["train", cfg])
    assert "no config.json: not a Hugging Face model folder" in err and str(bare) in err
    # a value out of range in config.json is named by config.json's key
    (bare / "config.json").write_text(
        json.dumps(json.loads((folder / "config.json").read_text()) | {"num_hidden_layers": -2})
    )
    err = one_line_error(capsys, ["train", cfg])
    assert f"{bare / 'config.json'}: num_hidden_layers (torchneox's num_layers): must be" in err
    # a key the user's file sets that the folder contradicts
    cfg = write_config(tmp_path / "b.yml", data_path=data, load=str(folder), hidden_size=64)
    err = one_line_error(capsys, ["config", "explain", cfg])
    assert "hidden_size" in err and "is 64 here but 32 in" in err and "b.yml" in err
    # save_hf naming a folder that holds something
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cfg = write_config(tmp_path / "c.yml", data_path=data, load=str(folder), save_hf=str(taken))
    err = one_line_error(capsys, ["train", cfg])
    assert str(taken) in err and "is not empty" in err and "--force" in err
    assert (taken / "keep.txt").read_text() == "mine"
    # save_hf over the checkpoints, even with --force
    cfg = write_config(
        tmp_path / "d.yml", data_path=data, load=str(folder), save=str(taken), save_hf=str(taken)
    )
    err = one_line_error(capsys, ["train", cfg, "--force"])
    assert "save_hf" in err and "would replace the checkpoints in save" in err
    assert (taken / "keep.txt").read_text() == "mine"
    # a soft prompt has no place in a Hugging Face folder: refused before training
    prompt = {"enabled": True, "n_tokens": 2}
    cfg = write_config(
        tmp_path / "e.yml", data_path=data, load=str(folder), save=str(tmp_path / "e"),
        save_hf=str(tmp_path / "e_hf"), soft_prompt_tuning=prompt,
    )  # fmt: skip
    err = one_line_error(capsys, ["train", cfg])
    assert "save_hf: cannot hold a soft prompt (soft_prompt_tuning)" in err, err
    assert not (tmp_path / "e").exists() and not (tmp_path / "e_hf").exists()
