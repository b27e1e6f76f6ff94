"""Rollouts sampled from the training model: in one process they equal ``generate``'s
continuations with the stop token kept; under DDP (ZeRO 0), ZeRO-3 and tensor parallelism
over 2 gloo processes they equal one process's for the same weights (the ranks kept in lockstep)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import BASE, build
from torchneox.config.load import load_mapping
from torchneox.inference.generate import LOCKSTEP_INTERVAL, Sampling, generate, sample_policy
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def _with_stop(generated: list[list[int]], cut: list[list[int]], stop: set[int]):
    """``generate``'s rows with their stop token put back (a row that stopped)."""
    return [
        c + [g[len(c)]] if len(c) < len(g) and g[len(c)] in stop else c
        for c, g in zip(cut, generated, strict=True)
    ]


@pytest.mark.parametrize("loop", ["dynamic", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_process_equals_generate_with_the_stop_kept(temperature, loop):
    _, model = build("neox-rotary")
    s = Sampling(temperature=temperature, maximum_tokens=12, seed=3, decode_loop=loop)
    full = generate(model, PROMPTS, s)
    stop = {full[0][4], full[1][2]}  # rows 0 and 1 stop there, row 2 perhaps too
    s.stop_ids = stop
    cut = generate(model, PROMPTS, s)
    model.train()
    rollouts = sample_policy(model, PROMPTS, s, 0, torch.Generator().manual_seed(3))
    assert model.training  # put back as it was
    assert rollouts == _with_stop(full, cut, stop)
    assert rollouts[0][-1] in stop and rollouts[1][-1] in stop
    assert all(t not in stop for row in rollouts for t in row[:-1])


def test_a_lockstep_that_is_not_done_keeps_the_rank_forwarding():
    """Another rank not done: this one makes idle forwards, asks every LOCKSTEP_INTERVAL
    tokens, and its completions are those of a lone process."""
    _, model = build("neox-rotary")
    s = Sampling(maximum_tokens=3)
    alone = sample_policy(model, PROMPTS, s, 0, None)
    asked, calls = [], [0]
    forward = model.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    def all_done(local_done: bool) -> bool:
        asked.append(local_done)
        return len(asked) == 3

    model.forward = counted
    assert sample_policy(model, PROMPTS, s, 0, None, lockstep=all_done) == alone
    assert asked == [True, True, True]
    assert calls[0] == 3 * LOCKSTEP_INTERVAL


TINY = BASE | {
    "pos_emb": "rotary",
    "norm": "rmsnorm",
    "num_kv_heads": 2,
    "no_weight_tying": True,
    "model_parallel_size": 2,  # the vocabulary padded as for two tensor ranks, in every run
}
# rank 0's prompts leave it fewer positions to fill than rank 1's: it waits for rank 1
RANK_PROMPTS = [[list(range(3, 40)), list(range(20, 50))], [[5, 6, 7], [9, 8]]]
SAMPLINGS = {
    "greedy": {"maximum_tokens": 30, "stop_ids": []},
    "sampled": {"maximum_tokens": 6, "stop_ids": [], "temperature": 1.0, "top_k": 20},
}


@pytest.mark.parametrize("layout", ["zero0", "zero3", "tp2"])
def test_two_processes_equal_one(layout, tmp_path):
    spec = {"model": TINY, "prompts": RANK_PROMPTS, "samplings": SAMPLINGS, "seed": 11}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    script = Path(__file__).with_name("sample_policy_ranks.py")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [*argv, str(script), str(tmp_path / "spec.json"), layout, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    model = build_model(model_args(load_mapping(TINY, "model")), seed=0)
    for r, got in enumerate(ranks):
        prompts = RANK_PROMPTS[0 if layout == "tp2" else r]
        for name, keys in SAMPLINGS.items():
            s = Sampling(**(keys | {"stop_ids": set()}))
            # (the same generator seed; tensor parallelism's sums could flip a sampled token
            # by float noise, but on this model and seed they do not)
            one = sample_policy(model, prompts, s, 0, torch.Generator().manual_seed(11))
            assert got[name] == one, name
        assert got["training"] is True
    assert [len(row) for row in ranks[0]["greedy"]] == [64 - 37] * 2  # the model's positions
    if layout == "tp2":  # one tensor-parallel group: the same prompts, the same tokens
        assert ranks[0]["sampled"] == ranks[1]["sampled"]
