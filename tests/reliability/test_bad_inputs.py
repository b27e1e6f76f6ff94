"""What users type that is wrong, verb by verb: each case must give one line on stderr naming
the option (or file) and what is allowed, exit status 2, no traceback, and write nothing.

A start of the bad-input suite: the numeric options and sampling settings, range-checked where
they are parsed."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchneox.cli import main

PREPROCESS = ["preprocess", "--input", "a.jsonl", "--output-prefix", "o"]
PREPROCESS += ["--tokenizer-type", "CharLevelTokenizer"]

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
        [*PREPROCESS, "--workers", "0"],
        "--workers: must be >= 1, got 0",
    ),
    "preprocess-log-interval-0": (
        [*PREPROCESS, "--log-interval", "0"],
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


def test_an_internal_error_is_a_short_report_not_a_traceback(monkeypatch, capsys, tmp_path):
    from torchneox.config import report

    def broken(*args, **kwargs):
        raise KeyError("nobody expected this")

    monkeypatch.setattr(report, "keys_text", broken)
    assert main(["config", "keys"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "torchneox: internal error: KeyError: 'nobody expected this'" in err
    assert "This is a bug in torchneox" in err and "TORCHNEOX_TRACEBACK=1" in err
    monkeypatch.setenv("TORCHNEOX_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["config", "keys"])


def test_a_corpus_far_too_small_for_train_iters_is_refused_with_the_numbers(
    tmp_path, make_config, capsys
):
    """It used to die in a 24 GiB numpy allocation."""
    cfg = make_config(train_iters=10**9, save=None, load=None)
    assert main(["data", "batch", cfg, "--iteration", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "samples of 32 tokens need" in err and "epochs of it" in err
    assert "lower train_iters (or the batch size, eval_iters), or add data" in err


# ------------------------------------------------------------------------------- preprocess


def _preprocess(tmp_path, *extra, inputs=("a.jsonl",)):
    argv = ["preprocess", "--input", *[str(tmp_path / i) for i in inputs]]
    argv += [
        "--output-prefix",
        str(tmp_path / "out" / "x"),
        "--tokenizer-type",
        "CharLevelTokenizer",
    ]
    return main([*argv, "--append-eod", *extra])


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("torchneox: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("a.csv", "id,text\n1,hello\n", "'.csv' is none of them"),
        ("a", "hello\n", "'no suffix' is none of them"),
        ("a.jsonl", '{"text": ""}\n{"text": ""}\n', "every document is empty"),
        ("a.jsonl.zst", "this is not zstd", "not a readable .zst file"),
    ],
    ids=["csv", "no-suffix", "only-empty-documents", "bad-zst"],
)
def test_preprocess_inputs_it_cannot_use(tmp_path, capsys, name, content, words):
    pytest.importorskip("zstandard")
    (tmp_path / name).write_text(content)
    assert _preprocess(tmp_path, inputs=(name,)) == 2
    assert words in _one_error(capsys)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_preprocess_refuses_to_replace_a_dataset_without_force(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    assert _preprocess(tmp_path) == 0
    before = (tmp_path / "out" / "x_text_document.bin").read_bytes()
    (tmp_path / "a.jsonl").write_text('{"text": "another"}\n')
    capsys.readouterr()
    assert _preprocess(tmp_path) == 2
    assert "x_text_document.bin: already exists; preprocess would replace it" in _one_error(capsys)
    assert (tmp_path / "out" / "x_text_document.bin").read_bytes() == before
    assert _preprocess(tmp_path, "--force") == 0
    assert (tmp_path / "out" / "x_text_document.bin").read_bytes() != before


def test_preprocess_into_a_folder_it_cannot_write(tmp_path, capsys):
    import os

    if os.geteuid() == 0:  # root writes anywhere: block the folder with a file instead
        (tmp_path / "out").write_text("a file where the folder should be")
    else:
        (tmp_path / "out").mkdir()
        (tmp_path / "out").chmod(0o500)
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    assert _preprocess(tmp_path) == 2
    assert "cannot write the dataset there" in _one_error(capsys)


def test_preprocess_on_a_full_disk_leaves_nothing_behind(tmp_path):
    """The partial .bin used to stay and fill the disk (its cleanup failed on the full disk)."""
    import resource
    import signal
    import subprocess
    import sys

    with open(tmp_path / "a.jsonl", "w") as f:
        for _ in range(3000):
            f.write('{"text": "%s"}\n' % ("words and more words " * 20))

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    argv = [sys.executable, "-m", "torchneox", "preprocess", "--input", str(tmp_path / "a.jsonl")]
    argv += [
        "--output-prefix",
        str(tmp_path / "out" / "x"),
        "--tokenizer-type",
        "CharLevelTokenizer",
    ]
    run = subprocess.run(
        argv, capture_output=True, text=True, preexec_fn=small_files, timeout=300, check=False
    )
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [x for x in run.stderr.splitlines() if x.startswith("torchneox: error:")]
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert "writing the dataset failed" in lines[0] and "partial files are removed" in lines[0]
    assert list((tmp_path / "out").iterdir()) == []


def test_train_tokenizer_on_an_empty_file_and_over_an_existing_one(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    argv = [
        "train-tokenizer",
        "--input",
        str(tmp_path / "empty.txt"),
        "--output",
        str(tmp_path / "t.json"),
    ]
    assert main(argv) == 2
    assert "no text to learn a tokenizer from" in _one_error(capsys)
    assert not (tmp_path / "t.json").exists()
    (tmp_path / "t.json").write_text("mine")
    (tmp_path / "words.txt").write_text("some words to learn from\n" * 20)
    argv[2] = str(tmp_path / "words.txt")
    assert main([*argv, "--vocab-size", "300"]) == 2
    assert "t.json: already exists; train-tokenizer would replace it" in _one_error(capsys)
    assert (tmp_path / "t.json").read_text() == "mine"


def test_a_vocab_file_given_to_the_byte_tokenizer_is_warned_about(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    assert _preprocess(tmp_path, "--vocab-file", str(tmp_path / "a.jsonl")) == 0
    assert "CharLevelTokenizer reads no files" in capsys.readouterr().err


# ------------------------------------------------------------------------------ convert


@pytest.fixture
def hf_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.GPTNeoXConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        rotary_pct=0.25,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _edit_config(folder, **changes):
    import json

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("truncated-safetensors", "cannot be read as safetensors"),
        ("config-wider-than-weights", "the weights do not match config.json"),
        ("config-deeper-than-weights", "weights do not match the config (missing layers.2"),
        ("config-not-json", "config.json is not valid JSON"),
        ("no-config", "no config.json: not a Hugging Face model folder"),
        ("no-weights", "no model.safetensors or pytorch_model.bin found"),
    ],
)
def test_from_hf_folders_that_do_not_hold_together(hf_folder, tmp_path, capsys, damage, words):
    weights = hf_folder / "model.safetensors"
    if damage == "truncated-safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "config-wider-than-weights":
        _edit_config(hf_folder, hidden_size=128)
    elif damage == "config-deeper-than-weights":
        _edit_config(hf_folder, num_hidden_layers=3)
    elif damage == "config-not-json":
        (hf_folder / "config.json").write_text("{not json")
    elif damage == "no-config":
        (hf_folder / "config.json").unlink()
    else:
        weights.unlink()
    assert main(["convert", "from-hf", str(hf_folder), str(tmp_path / "out")]) == 2
    assert words in _one_error(capsys)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))


# ------------------------------------------------------------------ one table, every verb

# (argv, words of the one line); paths are relative to an empty folder the test runs in
VERB_CASES = {
    "train-no-such-config": (["train", "nope.yml"], "nope.yml: no such config file"),
    "train-config-is-a-folder": (["train", "."], "is a directory, not a config file"),
    "train-empty-config": (["train", "empty.yml"], "empty.yml: the config file is empty"),
    "train-bad-set": (
        ["train", "model.yml", "--set", "num_layers"],
        "--set: 'num_layers' is not KEY=VALUE",
    ),
    "explain-unknown-key": (
        ["config", "explain", "typo.yml"],
        "hiden_size: unknown key; did you mean hidden_size?",
    ),
    "explain-bad-format": (["config", "explain", "typo.yml", "--format", "xml"], "--format"),
    "generate-no-checkpoint": (
        ["generate", "--checkpoint", "missing", "--prompt", "hi"],
        "missing: no such checkpoint directory",
    ),
    "generate-not-a-checkpoint": (
        ["generate", "--checkpoint", ".", "--prompt", "hi"],
        "not a torchneox checkpoint",
    ),
    "generate-hf-not-a-folder": (
        ["generate", "--hf", "missing", "--prompt", "hi"],
        "no config.json",
    ),
    "generate-both-sources": (
        ["generate", "--checkpoint", "a", "--hf", "b"],
        "not allowed with argument",
    ),
    "generate-no-source": (
        ["generate", "--prompt", "hi"],
        "one of the arguments --checkpoint --hf is required",
    ),
    "generate-bad-mode": (
        ["generate", "--checkpoint", "a", "--text-gen-type", "chat"],
        "invalid choice: 'chat'",
    ),
    "eval-nothing-to-do": (["eval", "--checkpoint", "missing"], "give --tasks T1,T2"),
    "eval-no-checkpoint": (
        ["eval", "--checkpoint", "missing", "--data-path", "d"],
        "missing: no such checkpoint directory",
    ),
    "plot-no-metrics": (["plot", "."], "no metrics.jsonl here"),
    "plot-no-run": (["plot", "missing"], "no metrics.jsonl here"),
    "verify-no-dir": (["checkpoint", "verify", "missing"], "missing: no such checkpoint directory"),
    "to-hf-not-a-checkpoint": (["convert", "to-hf", ".", "out"], "not a torchneox checkpoint"),
    "to-hf-no-checkpoint": (
        ["convert", "to-hf", "missing", "out"],
        "missing: no such checkpoint directory",
    ),
    "from-hf-no-folder": (["convert", "from-hf", "missing", "out"], "no config.json"),
    "from-neox-no-folder": (
        ["convert", "from-gpt-neox", "missing", "out"],
        "missing: no such directory",
    ),
    "from-neox-not-neox": (["convert", "from-gpt-neox", ".", "out"], "not a GPT-NeoX checkpoint"),
    "from-neox-no-step": (
        ["convert", "from-gpt-neox", ".", "out", "--step", "5"],
        "has no global_step5",
    ),
    "preprocess-no-input": (
        [
            "preprocess",
            "--input",
            "nope.jsonl",
            "--output-prefix",
            "o",
            "--tokenizer-type",
            "CharLevelTokenizer",
        ],
        "nope.jsonl: no such file",
    ),
    "preprocess-no-tokenizer-file": (
        [
            "preprocess",
            "--input",
            "empty.yml",
            "--output-prefix",
            "o",
            "--tokenizer-type",
            "HFTokenizer",
        ],
        "vocab_file",
    ),
    "preprocess-unknown-builtin": (
        [
            "preprocess",
            "--builtin",
            "wiki",
            "--output-prefix",
            "o",
            "--tokenizer-type",
            "CharLevelTokenizer",
        ],
        "no built-in corpus 'wiki'",
    ),
    "serve-no-model": (["serve", "nope"], "nope: no such folder"),
    "serve-bad-adapter": (["serve", "empty.yml", "--adapter", "x"], "give NAME=PEFT_FOLDER"),
    "train-tokenizer-no-input": (
        ["train-tokenizer", "--input", "nope.txt", "--output", "t.json"],
        "nope.txt: no such file",
    ),
    "data-batch-no-config": (
        ["data", "batch", "nope.yml", "--iteration", "1"],
        "nope.yml: no such config file",
    ),
    "estimate-unknown-gpu": (["estimate", "model.yml", "--gpus", "8", "--gpu", "tpu9"], "tpu9"),
    "keys-unknown-option": (["config", "keys", "--markdwn"], "unrecognized arguments: --markdwn"),
    "refusals-unknown-option": (
        ["config", "refusals", "--markdwn"],
        "unrecognized arguments: --markdwn",
    ),
    "lighthouse-port": (["lighthouse", "--port", "-5"], "--port must be 0 (any) to 65535, got -5"),
    "kernels-both-actions": (
        ["kernels", "--remeasure", "--clear"],
        "--clear: not allowed with argument --remeasure",
    ),
    "demo-dir-is-a-file": (["demo", "--dir", "empty.yml/x"], "empty.yml: is a file"),
    "demo-bad-set": (["demo", "--set", "hiden_size=3"], "did you mean hidden_size?"),
    "unknown-verb": (["trian", "c.yml"], "invalid choice: 'trian'"),
    "no-verb": ([], "the following arguments are required"),
}


@pytest.mark.parametrize("case", list(VERB_CASES))
def test_every_verb_names_the_mistake_in_one_line(case, tmp_path, monkeypatch, capsys):
    argv, words = VERB_CASES[case]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yml").write_text("# nothing\n")
    (tmp_path / "typo.yml").write_text("{hiden_size: 64}\n")
    (tmp_path / "model.yml").write_text(
        "{num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32,"
        " train_micro_batch_size_per_gpu: 2}\n"
    )
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("torchneox: error: "), (
        captured.err
    )
    assert words in captured.err, captured.err
    assert "Traceback" not in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_benchmark_that_does_not_exist_is_one_line(capfd):
    """bench hands its arguments to benchmarks/run_all.py, whose mistakes are one line too."""
    assert main(["bench", "--only", "nothing_such"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchneox: error: bench: "), err
    assert "invalid choice: 'nothing_such'" in err


@pytest.mark.parametrize(
    "argv, verb",
    [(["--bogus"], ""), (["train", "a.yml", "--bogus"], ""), (["train"], "train: ")],
)
def test_a_usage_mistake_names_the_program_once(capfd, argv, verb):
    """argparse's own mistakes: "torchneox: error: " once, then the verb (not the program's
    name a second time)."""
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"torchneox: error: {verb}") and err.count("torchneox") == 1, err


def _leaf_verbs(parser, prefix=()) -> list[tuple[str, ...]]:
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix]
    return [v for name, sub in subs[0].choices.items() for v in _leaf_verbs(sub, (*prefix, name))]


def test_every_verb_is_tried_with_a_mistake():
    """README and reliability.md promise one line and exit 2 for every verb's mistakes: each verb
    the parser knows (a new one included) must have a case in these tables."""
    from torchneox.cli.parser import build_parser

    tried = [argv for argv, _ in [*VERB_CASES.values(), *OPTION_CASES.values()]]
    tried.append(["bench"])  # test_a_benchmark_that_does_not_exist_is_one_line
    verbs = _leaf_verbs(build_parser())
    assert len(verbs) >= 16
    untried = [v for v in verbs if not any(tuple(a[: len(v)]) == v for a in tried)]
    assert not untried, f"verbs without a bad-input case: {untried}"


def test_the_readme_s_example_mistake_reads_as_shown(tmp_path, monkeypatch, capsys):
    """The README's first example of a mistake, run as it is written."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command, shown = re.search(
        r"\$ torchneox (config explain \S+)\n(torchneox: error: .*)\n", readme
    ).groups()
    monkeypatch.chdir(tmp_path)
    name = command.split()[-1]
    (tmp_path / name).write_text(f"{{{shown.split(': ')[3]}: 64}}\n")
    assert main(command.split()) == 2
    assert capsys.readouterr().err == shown + "\n"


def test_a_run_refused_as_it_starts_leaves_no_save_folder(make_config, tmp_path, capsys):
    """Data that is not there is found after the save folder was checked: the refused run
    leaves neither that folder nor an empty metrics.jsonl behind."""
    save = tmp_path / "fresh_run"
    cfg = make_config(data_path=str(tmp_path / "nothing"), save=str(save), load=None)
    assert main(["train", cfg]) == 2
    assert "nothing.idx: no such file" in capsys.readouterr().err
    assert not save.exists()
