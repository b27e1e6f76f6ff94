"""benchmarks/replica_groups.py's two accounts of a failure, on one failure worked by hand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from replica_groups import failures_per_hour, replica_groups, restart_from_checkpoint

A = argparse.Namespace(
    checkpoint_minutes=60, restart_minutes=30, group_restart_minutes=60, detect=36, groups=4
)


def test_one_failure_by_hand():
    # a failure 1 h 15 min into 10 h: the restart keeps the save at 1 h, loses 15 min of work
    # and 30 min of restart, then trains the remaining 8 h 15 min
    assert restart_from_checkpoint([1.25], 10, A) == pytest.approx((1 + 8.25) / 10)
    # replica groups: every group loses 36 s (0.01 h); one group of 4 is out for an hour
    assert replica_groups([1.25], 10, A) == pytest.approx((10 - 0.01 - 0.25) / 10)
    # a second failure during the restart starts it again
    assert restart_from_checkpoint([1.25, 1.5], 10, A) == pytest.approx((1 + 8.0) / 10)


def test_llama3_rate():
    # 419 interruptions in 54 days on 16,384 GPUs: one every 3.1 hours there
    assert 1 / failures_per_hour(16384) == pytest.approx(54 * 24 / 419)
