"""The estimator's parameter, gradient and optimizer bytes per rank equal what training
processes hold under layer weight sharing (each shared tensor once) and a soft prompt
(gradients and optimizer state for the prompt alone)."""

from __future__ import annotations

import pytest

from tests.estimate.test_memory import probe
from torchneox.config.load import load_config
from torchneox.estimate.search import estimate

CASES = {
    "shared-dp2-zero3": (2, ["num_unique_layers=2", "zero_optimization.stage=3"]),
    "prompt-dp2-zero0": (
        2,
        ['soft_prompt_tuning={"enabled": true, "n_tokens": 4}', "zero_optimization.stage=0"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimated_bytes_per_rank_equal_the_processes(make_config, tmp_path, case):
    nproc, overrides = CASES[case]
    cfg = make_config(
        num_layers=4,
        train_batch_size=8,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        hidden_size=48,
        num_attention_heads=4,
        no_weight_tying=True,
        hidden_dropout=0.0,
        num_workers=0,
    )
    measured = probe(cfg, tmp_path / "probe", nproc, overrides)
    measured.pop("activations")
    est = estimate(load_config([cfg], overrides), gpus=nproc, gpu="h100")
    assert est["resident_bytes"] == measured
