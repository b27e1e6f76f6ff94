"""`torchneox convert` and `torchneox generate` as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import shared_dir
from torchneox.checkpoint import files as checkpoint_format
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.config.report import render_yaml
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

transformers = pytest.importorskip("transformers")


def char_checkpoint(tmp_path, **keys):
    """A tiny random character-level model saved as a torchneox checkpoint."""
    values = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 64,
        "pos_emb": "rotary",
        "tokenizer_type": "CharLevelTokenizer",
        "make_vocab_size_divisible_by": 64,
    } | keys
    loaded = load_mapping(values, "test")
    model = build_model(model_args(loaded), seed=0)
    return checkpoint_format.save_checkpoint(
        tmp_path / "ckpt", 0, {"model": model.state_dict()}, render_yaml(loaded, derive(loaded))
    ), model


def test_generate_prompt_prints_the_continuation(tmp_path, capsys):
    char_checkpoint(tmp_path)
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--prompt",
                "Hi",
                "--maximum-tokens",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out.encode()) <= 5 * 4 + 1


def test_generate_decode_loops_print_the_same_continuation(tmp_path, capsys):
    char_checkpoint(tmp_path)
    outs = []
    for loop in ("static", "dynamic"):
        argv = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "Hi"]
        assert main([*argv, "--maximum-tokens", "20", "--decode-loop", loop]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(outs[0]) > 1
    argv += ["--recompute", "--decode-loop", "static"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "decode_loop" in err and "recompute" in err


def test_generate_input_file_writes_one_json_line_per_prompt(tmp_path, capsys):
    char_checkpoint(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nsecond\n\nthird one\n")
    out = tmp_path / "out.jsonl"
    status = main(
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--text-gen-type",
            "input-file",
            "--sample-input-file",
            str(prompts),
            "--sample-output-file",
            str(out),
            "--maximum-tokens",
            "4",
        ]
    )
    assert status == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["context"] for r in rows] == ["first prompt", "second", "third one"]
    assert all(isinstance(r["text"], str) for r in rows)


def test_generate_unconditional_from_a_config_file(tmp_path):
    char_checkpoint(tmp_path)
    out = tmp_path / "samples.jsonl"
    cfg = tmp_path / "gen.yml"
    cfg.write_text(
        f'{{"text_gen_type": "unconditional", "num_samples": 3, "maximum_tokens": 6, '
        f'"temperature": 1.0, "top_k": 10, "sample_output_file": "{out}", "tokenizer_type": "CharLevelTokenizer"}}'
    )
    assert main(["generate", str(cfg), "--checkpoint", str(tmp_path / "ckpt"), "--seed", "1"]) == 0
    assert len(out.read_text().splitlines()) == 3


def test_to_hf_refuses_what_hugging_face_cannot_express(tmp_path, capsys):
    char_checkpoint(tmp_path, pos_emb="alibi")
    assert main(["convert", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "pos_emb 'alibi'" in err and err.count("\n") == 1
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_from_hf_errors_are_one_line(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    assert "architecture 'BertModel' is not supported" in capsys.readouterr().err


def test_loading_a_checkpoint_into_a_different_shape_names_the_tensor(tmp_path, capsys):
    char_checkpoint(tmp_path)
    status = main(
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--set",
            "hidden_size=64",
            "--prompt",
            "x",
        ]
    )
    assert status == 2
    err = capsys.readouterr().err
    assert "tensor embed.weight has shape (512, 32) in the checkpoint but (512, 64)" in err


@pytest.mark.skipif(shared_dir() is None, reason="../shared is not on this machine")
def test_hf_round_trip_keeps_the_20b_tokenizer(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(
        vocab_size=50304,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        rotary_pct=0.25,
    )
    hf_dir = tmp_path / "hf"
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_bytes(
        (shared_dir() / "data/tokenizers/gpt_neox_20b/20B_tokenizer.json").read_bytes()
    )
    assert main(["convert", "from-hf", str(hf_dir), str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["eos_token_id"] == 0  # <|endoftext|> of the 20B tokenizer
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (
        hf_dir / "tokenizer.json"
    ).read_bytes()
    for source in (["--checkpoint", str(tmp_path / "ckpt")], ["--hf", str(tmp_path / "back")]):
        assert (
            main(["generate", *source, "--prompt", "The quick brown", "--maximum-tokens", "6"]) == 0
        )
    first, second = capsys.readouterr().out.splitlines()[-2:]
    assert first == second


def test_generate_interactive_reads_prompts_until_an_empty_line(tmp_path, monkeypatch, capsys):
    import io

    char_checkpoint(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nWorld\n\nnever read\n"))
    args = [
        "generate",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--text-gen-type",
        "interactive",
        "--maximum-tokens",
        "3",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "Type a prompt" in captured.err
    assert len(captured.out.splitlines()) >= 2


def test_version(capsys):
    from importlib.metadata import version

    from torchneox.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"torchneox {version('torchneox')}"


def test_generate_fits_the_model_and_cuts_prompts_that_fill_it(tmp_path, capsys):
    """The default 64 new tokens on a 64-position model stop at its last position (as
    GPT-NeoX); a prompt that fills the model keeps its last half, with a warning, and the
    other prompts of the file are completed as usual."""
    from torchneox.data.tokenizers import CharLevelTokenizer
    from torchneox.inference.generate import Sampling, TextGenerator

    _, model = char_checkpoint(tmp_path)
    gen = TextGenerator(model, CharLevelTokenizer(512), Sampling(maximum_tokens=64))
    short, long_ = "Hi", "x" * 100
    texts = gen.complete([short, long_])
    assert len(texts[0].encode()) <= 64 - 2 and len(texts[1].encode()) <= 64 - 32
    assert "prompt 2 has 100 tokens, the model 64 positions: it keeps its last 32" in (
        capsys.readouterr().err
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"first\n{long_}\nthird\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--text-gen-type", "input-file"]
    args += ["--sample-input-file", str(prompts), "--sample-output-file", str(out)]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["context"] for r in rows] == ["first", long_, "third"]
