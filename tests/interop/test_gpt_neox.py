"""GPT-NeoX checkpoints: weights to the last logit in every layout, and a run continued exactly."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import shared_dir
from tests.helpers import metric_rows
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main

SHARED = shared_dir()
pytestmark = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
G = SHARED / "golden" / "neox_checkpoints" if SHARED else None
GPT2 = SHARED / "data/tokenizers/gpt2" if SHARED else None
TOKENIZER = [f"vocab_file={GPT2}/vocab.json", f"merge_file={GPT2}/merges.txt"] if SHARED else []
SPLIT_ROWS = (
    "word_embeddings.weight",
    "final_linear.weight",
    "attention.query_key_value.weight",
    "attention.query_key_value.bias",
    "mlp.linear1.weight",
    "mlp.linear1.bias",
)
SPLIT_COLUMNS = ("attention.dense.weight", "mlp.linear2.weight")
QUIRK_BIASES = ("attention.dense.bias", "mlp.linear2.bias")


def convert(src, out, *extra) -> None:
    args = ["convert", "from-gpt-neox", str(src), str(out), *extra]
    for t in TOKENIZER:
        args += ["--set", t]
    assert main(args) == 0


def assert_golden_logits(ckpt) -> None:
    _, model = load_model(ckpt)
    ids = torch.from_numpy(np.load(G / "input/input_ids.npy"))
    with torch.no_grad():
        logits = model.eval()(ids).numpy()
    expected = np.load(G / "logits/logits_pp1_step10.npy")
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)


def test_pp1_checkpoint_logits_equal_gpt_neox(tmp_path):
    convert(G / "pp1", tmp_path / "out", "--step", "10")
    assert_golden_logits(tmp_path / "out")


def _layer_files(step_dir):
    return {
        int(p.name[6:8]): torch.load(p, weights_only=False)
        for p in sorted(step_dir.glob("layer_*-model_00-*"))
    }


def test_pp0_layout(tmp_path):
    """pipe_parallel_size 0 keeps everything in one module dict (sequential.*)."""
    src = G / "pp1" / "global_step10"
    rank = torch.load(src / "mp_rank_00_model_states.pt", weights_only=False)
    rank["module"] = {
        f"sequential.{layer}.{k}": v for layer, t in _layer_files(src).items() for k, v in t.items()
    }
    out = tmp_path / "neox" / "global_step10"
    out.mkdir(parents=True)
    torch.save(rank, out / "mp_rank_00_model_states.pt")
    (tmp_path / "neox" / "latest").write_text("global_step10")
    convert(tmp_path / "neox", tmp_path / "ckpt", "--config", str(G / "configs/tiny_pp0.yml"))
    assert_golden_logits(tmp_path / "ckpt")


def test_qk_layernorm_weights_come_in(tmp_path):
    """use_qk_layernorm: GPT-NeoX's one query/key layernorm per block ([heads, head_dim] weight
    and bias) is the block's attention.qk_norm; the converted model computes with it."""
    src = G / "pp1" / "global_step10"
    out = tmp_path / "neox" / "global_step10"
    (out / "configs").mkdir(parents=True)
    config = (
        (G / "configs/tiny_pp1.yml").read_text().replace("{", "{\n  use_qk_layernorm: true,", 1)
    )
    (out / "configs" / "tiny_pp1.yml").write_text(config)
    shutil.copy(src / "mp_rank_00_model_states.pt", out)
    norms = {}
    for layer, tensors in _layer_files(src).items():
        if "attention.query_key_value.weight" in tensors:
            g = torch.Generator().manual_seed(layer)
            norms[layer] = (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))
            tensors["attention.qk_layernorm.weight"], tensors["attention.qk_layernorm.bias"] = (
                norms[layer]
            )
        torch.save(tensors, out / f"layer_{layer:02d}-model_00-model_states.pt")
    (tmp_path / "neox" / "latest").write_text("global_step10")
    convert(tmp_path / "neox", tmp_path / "ckpt")
    _, model = load_model(tmp_path / "ckpt")
    for layer, (weight, bias) in norms.items():
        qk = model.layers[str(layer - 2)].attention.qk_norm
        assert torch.equal(qk.weight, weight) and torch.equal(qk.bias, bias)
    ids = torch.from_numpy(np.load(G / "input/input_ids.npy"))
    with torch.no_grad():
        logits = model.eval()(ids).numpy()
    assert not np.allclose(logits, np.load(G / "logits/logits_pp1_step10.npy"), atol=1e-3)


def test_tensor_parallel_shards_merge_with_the_bias_quirk(tmp_path):
    """Shards of model_parallel_size 2 laid out as GPT-NeoX writes them. GPT-NeoX adds the
    output biases once per rank with gpt_j_residual, so shards holding b/2 compute b."""
    src = G / "pp1" / "global_step10"
    out = tmp_path / "neox" / "global_step10"
    (out / "configs").mkdir(parents=True)
    shutil.copy(G / "configs/tiny_pp1_mp2.yml", out / "configs")
    for layer, tensors in _layer_files(src).items():
        for r in range(2):
            shard = {}
            for name, t in tensors.items():
                if name.endswith(SPLIT_ROWS):
                    t = t.chunk(2, dim=0)[r]
                elif name.endswith(SPLIT_COLUMNS):
                    t = t.chunk(2, dim=1)[r]
                elif name.endswith(QUIRK_BIASES):
                    t = t / 2
                shard[name] = t.clone()
            torch.save(shard, out / f"layer_{layer:02d}-model_{r:02d}-model_states.pt")
    for r in range(2):
        shutil.copy(src / "mp_rank_00_model_states.pt", out / f"mp_rank_{r:02d}_model_states.pt")
    (tmp_path / "neox" / "latest").write_text("global_step10")
    convert(tmp_path / "neox", tmp_path / "ckpt", "--set", "make_vocab_size_divisible_by=64")
    assert_golden_logits(tmp_path / "ckpt")


@pytest.mark.parametrize("kind", ["sm3", "madgrad_wd", "lamb", "lion"])
def test_the_state_of_an_optimizer_without_adams_moments_is_refused(tmp_path, capsys, kind):
    args = ["convert", "from-gpt-neox", str(G / "pp1"), str(tmp_path / "c"), "--with-optimizer"]
    args += ["--set", f"optimizer={{type: {kind}, params: {{lr: 0.0006}}}}"]
    for t in TOKENIZER:
        args += ["--set", t]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the state of a {kind} run does not import yet" in err[0], err
    assert not (tmp_path / "c").exists()


def test_continuing_the_gpt_neox_run_gives_its_losses(tmp_path):
    convert(G / "pp1", tmp_path / "ckpt", "--step", "10", "--with-optimizer")
    settings = [
        f"data_path={G}/data/shakespeare_text_document",
        *TOKENIZER,
        f"save={tmp_path / 'ckpt'}",
        f"load={tmp_path / 'ckpt'}",
        f"log_dir={tmp_path / 'log'}",
    ]
    status = main(
        ["train", str(G / "configs/tiny_pp1.yml"), *[a for s in settings for a in ("--set", s)]]
    )
    assert status == 0
    rows = metric_rows(tmp_path / "log")
    ours = {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}
    golden = json.loads((G / "losses.json").read_text())["pp1"]
    theirs = {r["iteration"]: r["lm_loss"] for r in golden["train"]}
    assert sorted(ours) == list(range(11, 21))
    for k in range(11, 21):
        assert ours[k] == pytest.approx(theirs[k], rel=1e-4), k
    evals = [r["valid_lm_loss"] for r in rows if "valid_lm_loss" in r] + [
        r["test_lm_loss"] for r in rows if "test_lm_loss" in r
    ]
    assert evals == pytest.approx([e["lm_loss"] for e in golden["eval"][1:]], rel=1e-4)
    batches = np.load(G / "input/train_batches_iter1-20.npy")
    assert (
        main(
            [
                "data",
                "batch",
                str(G / "configs/tiny_pp1.yml"),
                "--iteration",
                "15",
                "--out",
                str(tmp_path / "b.npy"),
                *[a for s in settings for a in ("--set", s)],
            ]
        )
        == 0
    )
    assert np.array_equal(np.load(tmp_path / "b.npy"), batches[14])


def test_clear_errors(tmp_path, capsys):
    def err(*args):
        assert main(["convert", "from-gpt-neox", *map(str, args)]) == 2
        return capsys.readouterr().err

    assert "not a GPT-NeoX checkpoint" in err(tmp_path, tmp_path / "o")
    broken = tmp_path / "broken" / "global_step10"
    shutil.copytree(G / "pp1" / "global_step10", broken)
    (broken / "layer_03-model_00-model_states.pt").unlink()
    assert "layer 3 is missing" in err(
        broken, tmp_path / "o", "--set", TOKENIZER[0], "--set", TOKENIZER[1]
    )
    text = err(
        G / "pp1",
        tmp_path / "o",
        "--step",
        "10",
        "--set",
        "hidden_size=32",
        "--set",
        TOKENIZER[0],
        "--set",
        TOKENIZER[1],
    )
    assert "do not match the config" in text
    (broken / "layer_02-model_00-model_states.pt").write_bytes(b"garbage")
    assert "cannot read it as a torch checkpoint" in err(
        broken, tmp_path / "o", "--set", TOKENIZER[0], "--set", TOKENIZER[1]
    )


def test_imported_checkpoint_exports_to_hugging_face(tmp_path):
    transformers = pytest.importorskip("transformers")
    convert(G / "pp1", tmp_path / "ckpt", "--step", "10")
    assert main(["convert", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    model = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.from_numpy(np.load(G / "input/input_ids.npy"))
    with torch.no_grad():
        logits = model(ids).logits.numpy()
    np.testing.assert_allclose(
        logits, np.load(G / "logits/logits_pp1_step10.npy"), atol=1e-5, rtol=0
    )
    assert (tmp_path / "hf" / "vocab.json").is_file() and (tmp_path / "hf" / "merges.txt").is_file()


def test_imported_checkpoint_evaluates(tmp_path, capsys, monkeypatch):
    convert(G / "pp1", tmp_path / "ckpt", "--step", "10")
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--data-path",
                str(G / "data/shakespeare_text_document"),
                "--iters",
                "2",
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["batches"] == 2 and result["tokens"] == 2 * 4 * 64
    assert (
        10.0 < result["lm_loss"] < 11.0
    )  # the step-10 model of the golden run (its losses are ~10.5)
    # a hub task with no network: one line that says so, not a traceback
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hellaswag" in err and "--include-path" in err


def test_a_vocab_file_left_on_the_cluster_takes_the_weights_vocabulary(tmp_path, capsys):
    """The stored config names its tokenizer at the training cluster's path: the checkpoint
    converts with the vocabulary size its weights have (here 128 rows, not GPT-2's 50304), and
    the note names the missing file and the option to pass it; generate then says the same."""
    step = tmp_path / "neox" / "global_step10"
    shutil.copytree(G / "pp1" / "global_step10", step)
    config = step / "configs" / "tiny_pp1.yml"
    text = config.read_text().replace("./data/gpt2-vocab.json", "/cluster/data/gpt2-vocab.json")
    config.write_text(text.replace("./data/gpt2-merges.txt", "/cluster/data/gpt2-merges.txt"))
    rows = {}
    for name, key in (("layer_00", "word_embeddings.weight"), ("layer_06", "final_linear.weight")):
        path = step / f"{name}-model_00-model_states.pt"
        tensors = torch.load(path, weights_only=False)
        tensors[key] = rows[key] = tensors[key][:128].clone()
        torch.save(tensors, path)
    capsys.readouterr()
    assert main(["convert", "from-gpt-neox", str(step), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "vocab_file /cluster/data/gpt2-vocab.json, which is not here" in err, err
    assert "the vocabulary size its weights have (128)" in err, err
    assert "--set vocab_file=PATH --set merge_file=PATH" in err, err
    loaded, model = load_model(tmp_path / "out")
    assert loaded.config.tokenizer.padded_vocab_size == 128
    assert torch.equal(model.embed.weight, rows["word_embeddings.weight"])
    assert torch.equal(model.output.weight, rows["final_linear.weight"])
    generate = ["generate", "--checkpoint", str(tmp_path / "out"), "--prompt", "a"]
    assert main([*generate, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "vocab_file /cluster/data/gpt2-vocab.json, which is not here" in err, err
