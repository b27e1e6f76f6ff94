"""No verb writes into, over or around its own input, with or without --force: an output that is
an input, holds one (an input lies inside the output folder) or lies inside an input folder is
refused in one line naming both, exit 2, and the input is left byte for byte as it was. Paths
are compared resolved (symlinks, '..', relative paths)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import BASE
from torchneox.checkpoint import files as checkpoint_format
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.config.report import render_yaml
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or the file itself) with its bytes."""
    path = Path(path)
    if path.is_file():
        return {".": path.read_bytes()}
    return {
        str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
    }


def save_run(folder: Path, steps=(2, 6)) -> Path:
    """A run's save folder with checkpoints at ``steps`` (a tiny model, saved directly) and a
    metrics.jsonl."""
    loaded = load_mapping(BASE | {"pos_emb": "rotary"}, "tiny")
    model = build_model(model_args(loaded), seed=0)
    yaml_text = render_yaml(loaded, derive(loaded))
    for step in steps:
        checkpoint_format.save_checkpoint(folder, step, {"model": model.state_dict()}, yaml_text)
    rows = [{"iteration": i, "lm_loss": 5.0 - i / 10} for i in range(1, 7)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def originals(tmp_path_factory, tiny_data):
    """A run, its Hugging Face export, a GPT-NeoX-shaped folder, a corpus and a dataset: made
    once; each test works on its own copy."""
    root = tmp_path_factory.mktemp("originals")
    run = save_run(root / "run")
    assert main(["convert", "to-hf", str(run), str(root / "hf")]) == 0
    neox = root / "neox" / "global_step1"
    neox.mkdir(parents=True)
    (neox / "mp_rank_00_model_states.pt").write_bytes(b"not read: refused before")
    (root / "neox" / "latest").write_text("global_step1\n")
    (root / "corpus.txt").write_text("the model reads tokens\nand learns\n" * 20)
    for ext in (".bin", ".idx"):
        shutil.copyfile(f"{tiny_data}{ext}", root / f"data{ext}")
        shutil.copyfile(f"{tiny_data}{ext}", root / f"data_ref{ext}")
    config = BASE | {
        "pos_emb": "rotary",
        "train_micro_batch_size_per_gpu": 2,
        "train_iters": 1,
        "train_data_paths": [str(root / "data")],
        "valid_data_paths": [str(root / "data_ref")],
        "test_data_paths": [str(root / "data")],
        "num_workers": 0,
    }
    (root / "c.yml").write_text(json.dumps(config))
    (root / "prompts.txt").write_text("the model\nreads\n")
    return root


@pytest.fixture
def here(originals, tmp_path, monkeypatch):
    """A copy of the originals, the working directory (so relative paths are relative to it);
    the config's data paths point at the copy."""
    root = tmp_path / "w"
    shutil.copytree(originals, root, symlinks=True)
    cfg = json.loads((root / "c.yml").read_text())
    for key in ("train_data_paths", "valid_data_paths", "test_data_paths"):
        cfg[key] = [str(root / Path(p).name) for p in cfg[key]]
    (root / "c.yml").write_text(json.dumps(cfg))
    os.symlink(root / "run", root / "link")  # the run, reached through a link
    monkeypatch.chdir(root)
    return root


GEN = ["generate", "--checkpoint", "run", "--text-gen-type", "input-file"]

# (the command, what it reads (kept byte for byte), the output and input the line names, how)
CASES = {
    # the data loss: the export replaced the whole run folder
    "to-hf step into its run": (
        ["convert", "to-hf", "run/global_step6", "run", "--force"],
        "run", "run", "run/global_step6",
    ),
    "to-hf run into itself": (["convert", "to-hf", "run", "run", "--force"], "run", "run", "run"),
    "to-hf into its checkpoint": (
        ["convert", "to-hf", "run/global_step6", "run/global_step6/hf", "--force"],
        "run", "run/global_step6/hf", "run/global_step6",
    ),
    "to-hf over another checkpoint of its run": (
        ["convert", "to-hf", "run", "run/global_step2", "--force"],
        "run", "run/global_step2", "run",
    ),
    "to-hf through a link": (
        ["convert", "to-hf", "link/global_step6", "run", "--force"],
        "run", "run", "link/global_step6",
    ),
    "to-hf through dot-dot": (
        ["convert", "to-hf", "run", "run/global_step6/..", "--force"],
        "run", "run/global_step6/..", "run",
    ),
    # the data loss: the HF folder's weights and config deleted
    "from-hf into itself": (["convert", "from-hf", "hf", "hf", "--force"], "hf", "hf", "hf"),
    "from-hf inside its folder": (
        ["convert", "from-hf", "hf", "hf/ckpt", "--force"], "hf", "hf/ckpt", "hf",
    ),
    "from-hf around its folder": (
        ["convert", "from-hf", "hf", ".", "--force"], "hf", ".", "hf",
    ),
    "from-gpt-neox into itself": (
        ["convert", "from-gpt-neox", "neox", "neox", "--force"], "neox", "neox", "neox",
    ),
    "from-gpt-neox around its step": (
        ["convert", "from-gpt-neox", "neox/global_step1", "neox", "--force"],
        "neox", "neox", "neox/global_step1",
    ),
    "preprocess over its input": (
        ["preprocess", "--input", "data_text_document.bin", "--output-prefix", "data",
         "--tokenizer-type", "CharLevelTokenizer", "--force"],
        "data_text_document.bin", "data_text_document.bin", "data_text_document.bin",
    ),
    "generate over its prompts": (
        [*GEN, "--sample-input-file", "prompts.txt", "--sample-output-file", "prompts.txt",
         "--force"],
        "prompts.txt", "prompts.txt", "prompts.txt",
    ),
    "generate into its checkpoint": (
        [*GEN, "--sample-input-file", "prompts.txt", "--sample-output-file",
         "run/global_step6/samples.txt", "--force"],
        "run", "run/global_step6/samples.txt", "run",
    ),
    "generate over its config": (
        [*GEN[:1], "c.yml", *GEN[1:], "--sample-input-file", "prompts.txt",
         "--sample-output-file", "c.yml", "--force"],
        "c.yml", "c.yml", "c.yml",
    ),
    "plot over its metrics": (
        ["plot", "run/metrics.jsonl", "--out", "run/metrics.jsonl", "--force"],
        "run", "run/metrics.jsonl", "run/metrics.jsonl",
    ),
    "plot over its run's metrics": (
        ["plot", "run", "--out", "run/metrics.jsonl", "--force"],
        "run", "run/metrics.jsonl", "run/metrics.jsonl",
    ),
    "plot over its run's checkpoint pointer": (
        ["plot", "run", "--out", "run/latest", "--force"], "run", "run/latest", "run/latest",
    ),
    "plot into its run's checkpoint": (
        ["plot", "run", "--out", "run/global_step6/loss.png", "--force"],
        "run", "run/global_step6/loss.png", "run/global_step6",
    ),
    "data batch over its config": (
        ["data", "batch", "c.yml", "--iteration", "1", "--out", "c.yml", "--force"], "c.yml", "c.yml", "c.yml",
    ),
    "data batch over its data": (
        ["data", "batch", "c.yml", "--iteration", "1", "--out", "data.bin", "--force"],
        "data.bin", "data.bin", "data.bin",
    ),
    "train-tokenizer over its input": (
        ["train-tokenizer", "--input", "corpus.txt", "--output", "corpus.txt",
         "--vocab-size", "300", "--force"],
        "corpus.txt", "corpus.txt", "corpus.txt",
    ),
    "train into the Hugging Face folder it loads": (
        ["train", "c.yml", "--set", "load=hf", "--set", "save=hf"], "hf", "hf", "hf",
    ),
    "train around its config": (["train", "c.yml", "--set", "save=."], "c.yml", ".", "c.yml"),
    "precompute over another dataset": (
        ["generate", "c.yml", "--checkpoint", "run", "--text-gen-type", "precompute",
         "--set", "precompute_model_name=ref"],
        "data_ref.bin", "data_ref.bin", "data_ref.bin",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_no_verb_writes_into_over_or_around_its_input(here, capsys, case):
    argv, kept, output, source = CASES[case]
    before = snapshot(here / kept)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchneox: error: "), err
    assert "internal error" not in err
    assert output in err, err
    assert f"its input {source}" in err or f"its input {here / source}" in err, err
    assert "--force" in err  # what --force does and does not replace
    assert snapshot(here / kept) == before
    assert not list(here.glob(".*partial*")) and not list(here.glob("*.partial-*"))


def test_precompute_model_name_is_a_plain_name(here, capsys):
    """A name with a path in it wrote outside the dataset's folder."""
    for name in ("../x", "sub/x", "..", ""):
        argv = ["config", "explain", "c.yml", "--set", f"precompute_model_name={name}"]
        if name == "":
            continue
        capsys.readouterr()
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "precompute_model_name" in err and "letters" in err, err
    before = snapshot(here)
    argv = ["generate", "c.yml", "--checkpoint", "run", "--text-gen-type", "precompute"]
    assert main([*argv, "--set", "precompute_model_name=../escaped"]) == 2
    assert snapshot(here) == before and not (here.parent / "escaped.bin").exists()


def test_a_conversion_killed_between_its_renames_gets_the_old_output_back(here, capsys):
    """kill -9 after the old output was moved aside and before the new one took its place: the
    next conversion to the same folder puts the old one back (and asks before replacing it),
    and removes the dead writer's partial folder."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = child.pid
    before = snapshot(here / "hf")
    (here / "hf").rename(here / f".hf.old-{dead}")
    (here / f".hf.partial-{dead}").mkdir()
    (here / f".hf.partial-{dead}" / "model.safetensors").write_bytes(b"half")
    capsys.readouterr()
    assert main(["convert", "to-hf", "run", "hf"]) == 2  # the old export is back: not replaced
    assert "is not empty" in capsys.readouterr().err
    assert snapshot(here / "hf") == before
    assert not list(here.glob(".hf.*"))
