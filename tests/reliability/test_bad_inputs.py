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
