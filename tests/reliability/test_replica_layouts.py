"""Replica groups beside pipeline stages and beside expert parallelism (CPU, gloo), side by side
in one test: 2 groups of 2 processes, every rank's gradients (its stage's, its expert shard's)
averaged with the same rank of the other group. They train as one 4-process run on the same
global batch, bit for bit:
- each group 2 pipeline stages = one run of 2 stages x 2 data-parallel ranks;
- each group 2 expert-parallel ranks under ZeRO-3 (4 experts, 2 on each rank) = one
  hybrid-sharded run of 4 ranks whose experts are split over 2 (an expert shard on ranks 0 and
  2, another on 1 and 3: within a group a shard's gradient is its rank's, across the groups the
  mean of the two, as the one run's mean over the 2 ranks that hold it); DeepSeek-V3's router
  bias moved by the tokens of both groups, as the one run's by its 4 ranks'.
Untied embeddings: tied, the 2 copies' gradients are summed within a group before the groups'
mean, in one run after the data-parallel mean, and the weights differ in their last bits. The
runs are forked from the tests' server (tests/forked.py): no import of torch per run."""

from __future__ import annotations

import os

import pytest
import torch

from tests.forked import Forked
from tests.helpers import losses, weights

torchft = pytest.importorskip("torchft")

KEYS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_iters": 2}
KEYS |= {"hidden_dropout": 0.0, "eval_iters": 0, "num_workers": 0, "no_weight_tying": True}
# DeepSeek-V3's router bias: moved by the load of both groups' tokens, as one run's by its 4 ranks'
BIAS = ["moe_router_type=topk", "moe_router_bias_update_rate=0.01", "zero_optimization.stage=3"]
# each layout: the groups' keys, then the one run's beside them
LAYOUTS = {
    "pp": (["pipe_parallel_size=2"], []),
    "ep": (
        ["moe_num_experts=4", "moe_top_k=2", "expert_parallel_size=2", *BIAS],
        ["zero_optimization={stage: 3, mics_shard_size: 2}"],
    ),
}


def start(config: str, keys: list[str], nproc: int) -> Forked:
    """``torchneox train CONFIG --nproc N --set KEY ...``, forked from the tests' server."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_MANAGER_PORT="0")
    argv = ["train", config, "--nproc", str(nproc), *[a for k in keys for a in ("--set", k)]]
    return Forked(argv, env)


def test_two_groups_of_two_stages_or_expert_ranks_train_as_one_run(make_config, tmp_path):
    from torchft.coordination import LighthouseServer

    config = make_config(**KEYS)
    servers, runs = [], {}
    try:
        for name, (layout, one_run) in LAYOUTS.items():
            server = LighthouseServer(
                bind="[::]:0", min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=1000
            )
            servers.append(server)
            one = tmp_path / name / "one"
            runs[one] = start(config, [*layout, *one_run, f"save={one}", "load=null"], 4)
            for g in (0, 1):
                folder = tmp_path / name / f"g{g}"
                keys = [f"ft_lighthouse={server.address()}", f"ft_replica_group={g}"]
                keys += ["ft_replica_groups=2", "ft_timeout_seconds=30"]
                runs[folder] = start(config, [*layout, *keys, f"save={folder}", "load=null"], 2)
        for folder, run in runs.items():
            result = run.result(timeout=240)
            assert result.returncode == 0, (
                f"{folder}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
            )
    finally:
        for server in servers:
            server.shutdown()
    for name in LAYOUTS:
        one, g0, g1 = (tmp_path / name / f for f in ("one", "g0", "g1"))
        assert losses(g0, "replica_groups") == {1: 2.0, 2: 2.0}, name
        assert losses(g0, "grad_norm") == losses(one, "grad_norm"), name
        # the logged loss: the groups' mean of each group's mean, one mean over 4 ranks in the
        # one run; summed in another order, it may differ in its last bit
        for k, loss in losses(one).items():
            assert losses(g0)[k] == pytest.approx(loss, rel=1e-6, abs=0), (name, k)
        whole, w0, w1 = weights(one), weights(g0), weights(g1)
        assert any(".experts" in n for n in whole) == (name == "ep"), name
        if name == "ep":  # the whole step's load, and the bias it moved (after the last step)
            for key in ("moe_tokens_per_expert", "moe_router_bias"):
                assert losses(g0, key) == losses(one, key) == losses(g1, key), key
            assert any(any(b) for b in losses(one, "moe_router_bias")[2]), "the bias moved"
        for n, tensor in whole.items():
            assert torch.equal(w0[n], tensor), (name, n)
            assert torch.equal(w1[n], tensor), (name, n)
