"""What users type that is wrong, verb by verb: each case must give one line on stderr naming
the option (or file) and what is allowed, exit status 2, no traceback, and write nothing.

A start of the bad-input suite: the numeric options and sampling settings, range-checked where
they are parsed."""

from __future__ import annotations

import pytest

from torchneox.cli import main

# (verb and arguments, words the one line must contain)
OPTION_CASES = {
    "train-nproc-0": (["train", "c.yml", "--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
    "train-nproc-negative": (["train", "c.yml", "--nproc", "-1"], "--nproc: must be >= 1"),
    "train-nproc-word": (["train", "c.yml", "--nproc", "two"], "--nproc: expected an integer"),
    "train-load-step-negative": (
        ["train", "c.yml", "--load-step", "-3"],
        "--load-step: must be >= 0",
    ),
    "explain-world-size-0": (
        ["config", "explain", "c.yml", "--world-size", "0"],
        "--world-size: must be >= 1",
    ),
    "generate-temperature-negative": (
        ["generate", "--checkpoint", "x", "--temperature", "-1"],
        "--temperature: must be >= 0, got -1",
    ),
    "generate-temperature-nan": (
        ["generate", "--checkpoint", "x", "--temperature", "nan"],
        "--temperature: must be a finite number",
    ),
    "generate-temperature-inf": (
        ["generate", "--checkpoint", "x", "--temperature", "inf"],
        "--temperature: must be a finite number",
    ),
    "generate-top-p-2": (
        ["generate", "--checkpoint", "x", "--top-p", "2"],
        "--top-p: must be <= 1",
    ),
    "generate-top-p-negative": (
        ["generate", "--checkpoint", "x", "--top-p", "-0.1"],
        "--top-p: must be >= 0",
    ),
    "generate-top-k-negative": (
        ["generate", "--checkpoint", "x", "--top-k", "-1"],
        "--top-k: must be >= 0",
    ),
    "generate-maximum-tokens-negative": (
        ["generate", "--checkpoint", "x", "--maximum-tokens", "-5"],
        "--maximum-tokens: must be >= 1, got -5",
    ),
    "generate-maximum-tokens-0": (
        ["generate", "--checkpoint", "x", "--maximum-tokens", "0"],
        "--maximum-tokens: must be >= 1",
    ),
    "generate-num-samples-negative": (
        ["generate", "--checkpoint", "x", "--num-samples", "-2"],
        "--num-samples: must be >= 1",
    ),
    "generate-seed-word": (
        ["generate", "--checkpoint", "x", "--seed", "abc"],
        "--seed: expected an integer",
    ),
    "preprocess-workers-0": (
        [
            "preprocess",
            "--input",
            "a.jsonl",
            "--output-prefix",
            "o",
            "--tokenizer-type",
            "CharLevelTokenizer",
            "--workers",
            "0",
        ],
        "--workers: must be >= 1, got 0",
    ),
    "preprocess-log-interval-0": (
        [
            "preprocess",
            "--input",
            "a.jsonl",
            "--output-prefix",
            "o",
            "--tokenizer-type",
            "CharLevelTokenizer",
            "--log-interval",
            "0",
        ],
        "--log-interval: must be >= 1",
    ),
    "train-tokenizer-vocab-0": (
        ["train-tokenizer", "--input", "a.txt", "--output", "t.json", "--vocab-size", "0"],
        "--vocab-size: must be >= 1",
    ),
    "data-batch-iteration-0": (
        ["data", "batch", "c.yml", "--iteration", "0"],
        "--iteration: must be >= 1",
    ),
    "eval-batch-size-0": (
        ["eval", "--checkpoint", "x", "--batch-size", "0"],
        "--batch-size: must be >= 1",
    ),
    "eval-iters-negative": (
        ["eval", "--checkpoint", "x", "--iters", "-1"],
        "--iters: must be >= 1",
    ),
    "eval-limit-0": (["eval", "--checkpoint", "x", "--limit", "0"], "--limit: must be > 0"),
    "eval-fewshot-negative": (
        ["eval", "--checkpoint", "x", "--num-fewshot", "-1"],
        "--num-fewshot: must be >= 0",
    ),
    "estimate-gpus-0": (["estimate", "c.yml", "--gpus", "0"], "--gpus: must be >= 1"),
    "estimate-nodes-0": (
        ["estimate", "c.yml", "--gpus", "8", "--nodes", "0"],
        "--nodes: must be >= 1",
    ),
    "estimate-mfu-0": (["estimate", "c.yml", "--gpus", "8", "--mfu", "0"], "--mfu: must be > 0"),
    "estimate-mfu-over-1": (
        ["estimate", "c.yml", "--gpus", "8", "--mfu", "1.5"],
        "--mfu: must be <= 1",
    ),
    "convert-step-negative": (
        ["convert", "from-gpt-neox", "a", "b", "--step", "-1"],
        "--step: must be >= 0",
    ),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_bad_options_are_one_line_and_write_nothing(case, tmp_path, monkeypatch, capsys):
    argv, words = OPTION_CASES[case]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("torchneox: error: ")
    assert words in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_output_files_in_missing_folders_are_made_whole(tmp_path, make_config, capsys):
    """plot --out, data batch --out: the folder is made and the file appears whole."""
    cfg = make_config(train_iters=2, save=str(tmp_path / "r"), load=None)
    assert main(["train", cfg]) == 0
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path / "r"), "--out", str(tmp_path / "new" / "loss.png")]) == 0
    assert (tmp_path / "new" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    out = tmp_path / "deeper" / "still" / "b"
    assert main(["data", "batch", cfg, "--iteration", "1", "--out", str(out)]) == 0
    import numpy as np

    assert np.load(out).shape[0] == 4
    assert not list(tmp_path.rglob(".*partial*"))


def test_a_metrics_file_cut_by_a_kill_still_plots_and_resumes_cleanly(tmp_path, make_config):
    import json

    cfg = make_config(train_iters=2, save=str(tmp_path / "r"), load=str(tmp_path / "r"))
    assert main(["train", cfg]) == 0
    metrics = tmp_path / "r" / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"iteration": 3, "lm_lo')  # killed mid-line
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path / "r"), "--out", str(tmp_path / "a.png")]) == 0
    assert main(["train", cfg, "--set", "train_iters=3"]) == 0  # resumes, appends
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line whole
    assert [r["iteration"] for r in rows if "lm_loss" in r] == [1, 2, 3]


def test_tokenizer_files_of_the_wrong_kind_and_unknown_types(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "tok.json").write_text("not json at all")
    base = [
        "preprocess",
        "--input",
        str(tmp_path / "a.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
    ]
    for extra, words in [
        (
            ["--tokenizer-type", "HFTokenizr"],
            "unknown tokenizer type 'HFTokenizr'; did you mean HFTokenizer?",
        ),
        (
            ["--tokenizer-type", "HFTokenizer", "--vocab-file", str(tmp_path / "tok.json")],
            "cannot be read as a tokenizer.json",
        ),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("o*"))


def test_a_device_this_machine_lacks_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["generate", "--checkpoint", "x", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device: cuda: this machine has no CUDA device" in err and err.count("\n") == 1
