"""The dry run of a model mixing mamba and attention layers: every rank of a pipeline x ZeRO-3
layout builds, steps on fake tensors, agrees on its collectives and holds estimate's bytes."""

from __future__ import annotations

from tests.estimate.test_dry_run import _assert_holds_estimate, _loaded
from torchneox.estimate.dry_run import dry_run


def test_a_mamba_mix_rehearses_under_pipeline_and_zero3():
    mix = "attention_config=[[[mamba, global], 2]]"
    loaded = _loaded(mix, "pipe_parallel_size=2", "zero_optimization.stage=3")
    run = dry_run(loaded, 4, ranks="all", workers=2)
    assert [r.rank for r in run.ranks] == [0, 1, 2, 3]
    _assert_holds_estimate(run)
    assert run.groups_checked > 0
