"""``curriculum_learning``: DeepSpeed's sequence-length curriculum, read and checked once.

The length of training step k (counting from 1; GPT-NeoX asks DeepSpeed's scheduler at its
iteration + 1) is, as DeepSpeed's CurriculumScheduler computes it:

- fixed_root: floor((k / total_curriculum_step)^(1/root_degree) x (max - min) + min), rounded
  down to a multiple of difficulty_step, at most max_difficulty (fixed_linear: root_degree 1);
- fixed_discrete: difficulty[i] for the first i whose max_step[i] >= k, the last one after.

DeepSpeed stops updating once a length reaches max_difficulty; the schedules only grow, so that
changes a length only where a fixed_discrete list comes back down, and ``length`` keeps it too.
Under DPO and KTO every row (chosen and rejected alike) is cut to the length; a reward model
(its value sits at the answer's end) and reinforce (a reward is for a whole completion) refuse
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torchneox.base.errors import did_you_mean
from torchneox.config.checker import Checker
from torchneox.config.numbers import whole
from torchneox.config.refusals import refusal

KEYS = ("enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type")
SCHEDULES = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
}


@dataclass(frozen=True)
class Curriculum:
    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    schedule: dict[str, Any]

    def _scheduled(self, step: int) -> int:
        s = self.schedule
        if self.schedule_type == "fixed_discrete":
            for difficulty, last in zip(s["difficulty"], s["max_step"], strict=False):
                if step <= last:
                    return difficulty
            return s["difficulty"][-1]
        degree = 1 if self.schedule_type == "fixed_linear" else s["root_degree"]
        fraction = (float(step) / s["total_curriculum_step"]) ** (1.0 / degree)
        span = self.max_difficulty - self.min_difficulty
        value = math.floor(fraction * span + self.min_difficulty)
        value -= value % s["difficulty_step"]
        return min(value, self.max_difficulty)

    def length(self, step: int) -> int:
        """The sequence length of training step ``step`` (from 1)."""
        if self.min_difficulty >= self.max_difficulty:  # DeepSpeed never updates it
            return self.min_difficulty
        if self.schedule_type == "fixed_discrete":  # held once max_difficulty is reached
            s = self.schedule
            starts = [1] + [last + 1 for last in s["max_step"]]
            for start, difficulty in zip(starts, s["difficulty"], strict=True):
                if start > step:
                    break
                if difficulty >= self.max_difficulty:
                    return difficulty
        return self._scheduled(step)

    def describe(self) -> str:
        s = self.schedule
        if self.schedule_type == "fixed_discrete":
            steps = ", ".join(
                f"{d} to step {m}" for d, m in zip(s["difficulty"], s["max_step"], strict=False)
            )
            return f"{steps}, then {s['difficulty'][-1]}"
        degree = "" if self.schedule_type == "fixed_linear" else f"^(1/{s['root_degree']})"
        return (
            f"{self.min_difficulty} + (step/{s['total_curriculum_step']}){degree} x "
            f"({self.max_difficulty} - {self.min_difficulty}), down to a multiple of "
            f"{s['difficulty_step']}, at most {self.max_difficulty}"
        )


def curriculum(cfg: Any) -> Curriculum | None:
    """The curriculum of a checked config (curriculum_learning, or data_efficiency's seqlen
    metric); None when neither is on."""
    c = cfg.training.curriculum_learning
    if not c or not c.get("enabled", False):
        c = seqlen_metric(cfg.deepspeed.data_efficiency)
    if not c or not c.get("enabled", False):
        return None
    schedule = {
        k: [whole(x) for x in v] if isinstance(v, list) else whole(v)
        for k, v in c["schedule_config"].items()
    }  # counts each (checked): text such as 1e3 read as the number
    return Curriculum(
        whole(c["min_difficulty"]), whole(c["max_difficulty"]), c["schedule_type"], schedule
    )


NAME = "curriculum_learning"
DE_CURRICULUM = "data_sampling.curriculum_learning"
SEQLEN_METRIC = "seqlen_truncate"
"""DeepSpeed's data_efficiency metric that cuts each sample to the scheduled length (as
Megatron-DeepSpeed applies it): the one that is the same as curriculum_learning's seqlen."""
METRIC_KEYS = ("index_to_sample_path", "index_to_metric_path", "difficulty_type", "clustering_type")
"""Entries of a data_efficiency metric that only DeepSpeed's data analyzer and sampler read."""


def seqlen_metric(de: Any) -> dict[str, Any] | None:
    """data_efficiency's seqlen_truncate metric as a curriculum_learning dict (enabled when
    data_efficiency, its data_sampling and its curriculum_learning all are); None without it."""
    if not isinstance(de, dict):
        return None
    sampling = de.get("data_sampling") or {}
    cur = sampling.get("curriculum_learning") or {} if isinstance(sampling, dict) else {}
    metrics = cur.get("curriculum_metrics") if isinstance(cur, dict) else None
    if not isinstance(metrics, dict) or not isinstance(metrics.get(SEQLEN_METRIC), dict):
        return None
    on = all(bool(d.get("enabled", False)) for d in (de, sampling, cur))
    given = {k: v for k, v in metrics[SEQLEN_METRIC].items() if k not in METRIC_KEYS}
    return {"enabled": on, "curriculum_type": "seqlen", **given}


class _Scoped:
    """A Checker whose failures name the data_efficiency entry the curriculum came from."""

    def __init__(self, ch: Checker, where: str) -> None:
        self.ch, self.c, self.where = ch, ch.c, where

    def fail(self, key: str, message: str, *, path: str | None = None) -> None:
        self.ch.fail("data_efficiency", f"{self.where}: {message}", path=self.where)


def check_curriculum(ch: Checker) -> None:
    """Each mistake in the dict, and the layouts the cut does not run with, in one line."""
    c = ch.c.training.curriculum_learning
    metric = seqlen_metric(ch.c.deepspeed.data_efficiency)
    if metric is not None:
        if c and c.get("enabled", False):
            ch.fail(
                "data_efficiency",
                "its seqlen curriculum and curriculum_learning are both enabled; keep one",
            )
        _check_dict(_Scoped(ch, f"{DE_CURRICULUM}.curriculum_metrics.{SEQLEN_METRIC}"), metric)
    if c is not None:
        _check_dict(ch, c)


def _check_dict(ch: Any, c: Any) -> None:
    _known(ch, c, (*KEYS, "schedule_config"), "")
    if not c.get("enabled", False):
        return
    for name in (*KEYS[1:], "schedule_config"):
        if name not in c:
            ch.fail(NAME, f"needs {name} (DeepSpeed's curriculum requires it)", path=name)
    if c["curriculum_type"] != "seqlen":
        ch.fail(
            NAME,
            f"curriculum_type {c['curriculum_type']!r} is not built; only 'seqlen' (DeepSpeed's "
            "other metrics belong to its data_efficiency library)",
            path="curriculum_type",
        )
    low, high = (_count(ch, c, name, "") for name in ("min_difficulty", "max_difficulty"))
    if low > high:
        ch.fail(NAME, f"min_difficulty {low} is above max_difficulty {high}")
    kind = c["schedule_type"]
    if kind not in SCHEDULES:
        ch.fail(
            NAME,
            f"schedule_type {kind!r} is not one of {', '.join(SCHEDULES)} (custom needs "
            "DeepSpeed's Python API)",
            path="schedule_type",
        )
    _check_schedule(ch, c["schedule_config"], kind, low)
    _check_layout(ch, c)


def _known(ch: Checker, mapping: Any, allowed: tuple[str, ...], where: str) -> None:
    if not isinstance(mapping, dict):
        ch.fail(NAME, f"{where or 'the value'} must be a mapping, got {mapping!r}")
    for name in mapping:
        if name not in allowed:
            hint = did_you_mean(str(name), allowed)
            ch.fail(NAME, f"unknown key {where}{name}{hint}", path=f"{where}{name}")


def _count(ch: Checker, mapping: dict, name: str, where: str) -> int:
    """``mapping[name]``, an integer >= 1 (text such as 1e3, a string to YAML, counts as the
    number, as for a flat key), written back as one."""
    value = whole(mapping[name])
    if value is None or value < 1:
        ch.fail(
            NAME,
            f"{where}{name} must be an integer >= 1, got {mapping[name]!r}",
            path=f"{where}{name}",
        )
    mapping[name] = value
    return value


def _check_schedule(ch: Checker, s: Any, kind: str, low: int) -> None:
    where = "schedule_config."
    _known(ch, s, SCHEDULES[kind], where)
    for name in SCHEDULES[kind]:
        if name not in s:
            ch.fail(NAME, f"schedule_type {kind} needs {where}{name}", path=where + name)
    if kind != "fixed_discrete":
        for name in SCHEDULES[kind]:
            _count(ch, s, name, where)
        if low < s["difficulty_step"]:
            ch.fail(
                NAME,
                f"min_difficulty {low} rounds down to 0 tokens at difficulty_step "
                f"{s['difficulty_step']}; make min_difficulty at least difficulty_step",
            )
        return
    for name in ("difficulty", "max_step"):
        if not isinstance(s[name], list) or not s[name]:
            ch.fail(NAME, f"{where}{name} must be a non-empty list", path=where + name)
        for i in range(len(s[name])):
            _count(ch, s[name], i, f"{where}{name}.")  # type: ignore[arg-type]  (a list index)
    if len(s["difficulty"]) != len(s["max_step"]) + 1:
        ch.fail(
            NAME,
            f"{where}difficulty has {len(s['difficulty'])} lengths for "
            f"{len(s['max_step'])} max_step; it needs one more (the last holds after them)",
        )


def _check_layout(ch: Checker, spec: dict) -> None:
    c = ch.c
    impl = c.training.train_impl
    if impl in ("rm", "reinforce"):  # (DPO and KTO cut both sides of a row alike)
        ch.fail(NAME, f"with train_impl {impl} {refusal('curriculum', impl)}; drop it")
    cp, seq = c.parallel.context_parallel_size, c.model.seq_length
    if cp > 1:  # each rank takes 2 equal chunks of every length the curriculum trains on
        s = spec["schedule_config"]
        if spec["schedule_type"] == "fixed_discrete":
            lengths = [*s["difficulty"], spec["min_difficulty"]]
        else:
            lengths = [s["difficulty_step"], spec["max_difficulty"], spec["min_difficulty"]]
        for n in lengths:
            if n % (2 * cp) and not (seq and n >= seq):
                ch.fail(
                    NAME,
                    f"trains on sequences of {n} tokens, which context_parallel_size {cp} cannot "
                    f"cut into 2 x {cp} equal chunks; use multiples of {2 * cp}",
                )
