"""GPT-NeoX's configs/mamba (ea7aefd, their keys in tests/neox_configs/mamba): each
explains, and one trains from the CLI scaled down with --set, its loss falling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import metric_rows
from torchneox.cli import main
from torchneox.models.mixers.mamba import kernels_installed

NEOX_MAMBA = Path(__file__).parents[1] / "neox_configs" / "mamba"
CONFIGS = sorted(NEOX_MAMBA.glob("*.yml"))
LAYERS = {"130M": 24, "370M": 48, "790M": 48, "1.4B": 48, "2.8B": 64}


def test_the_five_configs_are_there():
    assert len(CONFIGS) == 5


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_gpt_neox_mamba_config_explains(path, capsys):
    assert main(["config", "explain", str(path)]) == 0
    out = capsys.readouterr().out
    layers = LAYERS[path.stem.removeprefix("mamba-")]
    assert f"{layers} mamba layers" in out
    assert "no layer of attention_config is an attention layer" in out
    # the fusion keys are set: what runs instead where the kernels are missing, in one line
    assert "mamba_inner_func_fusion" in out


@pytest.mark.parametrize(
    "layers",
    ["[[[mamba], 2]]", "[[[mamba, global], 1]]"],  # a mix: its attention needs heads dividing 64
    ids=["mamba", "mamba-global"],
)
def test_gpt_neox_mamba_config_trains_scaled_down(tmp_path, tiny_data, capsys, layers):
    run = tmp_path / "run"
    local = {
        "data_path": str(tiny_data),
        "tokenizer_type": "CharLevelTokenizer",
        "save": str(run),
        "load": str(run),
        "log_dir": str(run),
        "num_workers": 0,
    }
    (tmp_path / "local.yml").write_text(json.dumps(local))
    settings = [
        "num_layers=2",
        f"attention_config={layers}",
        "hidden_size=64",
        "num_attention_heads=4",
        "seq_length=64",
        "max_position_embeddings=64",
        "train_iters=20",
        "lr_decay_iters=20",
        "warmup=0.1",
        "optimizer.params.lr=0.003",
        "train_micro_batch_size_per_gpu=4",
        "log_interval=1",
        "eval_interval=1000",
        "eval_iters=1",
        "checkpoint_factor=1000",
        "checkpoint_activations=false",
    ]
    config = NEOX_MAMBA / "mamba-130M.yml"
    args = ["train", str(config), str(tmp_path / "local.yml")]
    assert main(args + [a for s in settings for a in ("--set", s)]) == 0
    out = capsys.readouterr()
    # the config asks for mamba-ssm's fused kernels: what runs instead, in one line
    said = [line for line in (out.out + out.err).splitlines() if line.startswith("mamba: ")]
    kernels = torch.cuda.is_available() and kernels_installed()
    assert len(said) == 1 and ("kernels on CUDA" if kernels else "run instead") in said[0], said
    losses = [r["lm_loss"] for r in metric_rows(run) if "lm_loss" in r and "iteration" in r]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
