"""Generation: the KV cache changes nothing, batched (left-padded) prompts equal one at a time,
stop tokens end a row, sampling is seeded, and top-k / top-p keep what they should."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import build
from torchneox.inference.generate import Sampling, filter_logits, generate


@pytest.mark.parametrize(
    "variant", ["neox-rotary", "alibi", "learned", "window", "rmsnorm-swiglu-gqa", "mla"]
)
def test_generation_with_cache_equals_without(variant):
    _, model = build(variant)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    with_cache = generate(model, prompts, Sampling(maximum_tokens=12))
    without = generate(model, prompts, Sampling(maximum_tokens=12, use_cache=False))
    assert with_cache == without
    assert all(len(c) == 12 for c in with_cache)


def test_batched_prompts_equal_one_at_a_time():
    _, model = build("neox-rotary")
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    batched = generate(model, prompts, Sampling(maximum_tokens=10))
    alone = [generate(model, [p], Sampling(maximum_tokens=10))[0] for p in prompts]
    assert batched == alone


def test_stop_token_ends_a_row():
    _, model = build("neox-rotary")
    first = generate(model, [[5, 6, 7]], Sampling(maximum_tokens=10))[0]
    stop = first[3]
    cut = generate(model, [[5, 6, 7]], Sampling(maximum_tokens=10, stop_ids={stop}))[0]
    assert cut == first[: first.index(stop)]


def test_sampling_is_seeded():
    _, model = build("neox-rotary")
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9, maximum_tokens=15, seed=4)
    assert generate(model, [[1, 2, 3]], s) == generate(model, [[1, 2, 3]], s)
    other = Sampling(temperature=1.0, maximum_tokens=15, seed=5)
    assert generate(model, [[1, 2, 3]], s) != generate(model, [[1, 2, 3]], other)


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 0.0)).tolist() == [[False, False, True, True]]
    # 0.5 + 0.3 reaches 0.8: the rest is dropped
    assert torch.isinf(filter_logits(logits, 0, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.1)).tolist() == [[False, True, True, True]]


@pytest.mark.parametrize(
    "variant", ["neox-rotary", "alibi", "learned", "window", "rmsnorm-swiglu-gqa", "mla"]
)
def test_static_decode_loop_equals_the_dynamic_one(variant):
    """The fixed-shape loop (a StaticKVCache attended over in full, the stop check every
    STOP_CHECK_INTERVAL tokens) gives today's tokens, padded prompts and stop tokens included."""
    _, model = build(variant)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    dynamic = generate(model, prompts, Sampling(maximum_tokens=40, decode_loop="dynamic"))
    static = generate(model, prompts, Sampling(maximum_tokens=40, decode_loop="static"))
    assert static == dynamic
    assert all(len(c) == 40 for c in static)
    stop = dynamic[1][3]
    stops = {"stop_ids": {stop}, "maximum_tokens": 40}
    cut = generate(model, prompts, Sampling(**stops, decode_loop="static"))
    assert cut == generate(model, prompts, Sampling(**stops, decode_loop="dynamic"))
    assert cut[1] == dynamic[1][: dynamic[1].index(stop)]
    seeded = {"temperature": 1.0, "top_k": 20, "maximum_tokens": 20, "seed": 3}
    assert generate(model, prompts, Sampling(**seeded, decode_loop="static")) == generate(
        model, prompts, Sampling(**seeded, decode_loop="dynamic")
    )


def test_static_decode_loop_reads_back_only_at_stop_checks(monkeypatch):
    """No host synchronisation per token: the only read back inside the loop is the stop
    check, once every STOP_CHECK_INTERVAL tokens."""
    from torchneox.inference import generate as gen

    _, model = build("neox-rotary")
    assert model.args.max_positions == 64  # 3 prompt tokens leave room for 61
    reads = []
    for name in ("__bool__", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, f=real: reads.append(1) or f(t))
    counts = {}
    for n in (20, 61):
        reads.clear()
        out = generate(model, [[5, 6, 7]], Sampling(maximum_tokens=n, decode_loop="static"))
        assert len(out[0]) == n
        counts[n] = len(reads)
    # one read before decoding (whether any prompt is padded), then one per stop check
    assert counts == {20: 1, 61: 1 + 60 // gen.STOP_CHECK_INTERVAL} == {20: 1, 61: 2}


def _char_checkpoint(folder, **extra):
    """A tiny random character-level model saved as a torchneox checkpoint (``extra``: more
    model keys)."""
    from torchneox.checkpoint import files as checkpoint_format
    from torchneox.config.derive import derive
    from torchneox.config.load import load_mapping
    from torchneox.config.report import render_yaml
    from torchneox.models.args import model_args
    from torchneox.models.transformer import build_model

    keys = {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16}
    keys |= {"tokenizer_type": "CharLevelTokenizer", "make_vocab_size_divisible_by": 64}
    keys |= extra
    loaded = load_mapping(keys, "test")
    state = {"model": build_model(model_args(loaded), seed=0).state_dict()}
    checkpoint_format.save_checkpoint(folder, 0, state, render_yaml(loaded, derive(loaded)))


def test_a_prompt_file_without_a_mode_is_read_not_ignored(tmp_path, monkeypatch):
    """It used to open the interactive prompt, reading standard input instead of the file."""
    import io
    import json

    from torchneox.cli import main

    _char_checkpoint(tmp_path / "ckpt")
    (tmp_path / "p.txt").write_text("the quick\nbrown fox\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    out = tmp_path / "out.jsonl"
    args = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--maximum-tokens", "3"]
    assert (
        main(
            [
                *args,
                "--sample-input-file",
                str(tmp_path / "p.txt"),
                "--sample-output-file",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["context"] for r in rows] == ["the quick", "brown fox"]


def test_a_binary_prompt_file_is_one_line_naming_it(tmp_path, capsys):
    from torchneox.cli import main

    _char_checkpoint(tmp_path / "ckpt")
    prompts = tmp_path / "prompts.bin"
    prompts.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--text-gen-type", "input-file"]
    args += ["--sample-input-file", str(prompts), "--sample-output-file", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{prompts}: sample_input_file: not UTF-8 text (invalid start byte at byte 0)" in err
    assert not out.exists()


def test_maximum_tokens_past_the_positions_is_said_and_cut(tmp_path, capsys):
    """The model has 16 positions: asked for 100 tokens, it says so once (and stops at the last
    position, as GPT-NeoX does)."""
    from torchneox.cli import main

    _char_checkpoint(tmp_path / "ckpt")
    args = ["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "abcd"]
    assert main([*args, "--maximum-tokens", "100", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("maximum_tokens 100 is past the model's 16 positions") == 1
    assert main([*args, "--maximum-tokens", "5"]) == 0
    assert "past the model" not in capsys.readouterr().err
