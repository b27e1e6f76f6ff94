"""The dry run (train --dry-run): every rank of a layout built on the fake process group, its
shards equal to what estimate computes, and the collectives of every group agreed on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torchneox
from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.estimate.dry_run import check_agreement, dry_run, render, sample_ranks
from torchneox.estimate.rehearsal import Collective, RankReport
from torchneox.estimate.search import estimate

TINY = str(Path(torchneox.__file__).parent / "configs" / "tiny_cpu.yml")
UNTIED = ["no_weight_tying=true", "train_micro_batch_size_per_gpu=2"]


def _loaded(*sets: str):
    return load_config([TINY], [*UNTIED, *sets])


def _assert_holds_estimate(run) -> None:
    """Every rank stepped; the first shard rank of each stage holds exactly estimate's bytes
    (torch gives it the rounded-up share), the others no more."""
    assert not run.problems, run.problems
    for r in run.ranks:
        assert r.stepped, (r.rank, r.step)
        first = r.coordinates["dp"] == r.coordinates["tp"] == r.coordinates["cp"] == 0
        for part in ("parameters", "gradients", "optimizer"):
            got, want = r.bytes[part], r.expected[part]
            assert got == want if first or not want else 0 < got <= want, (r.rank, part, got)
        # building: the shards and the largest weight drawn whole, as estimate's build line
        assert 0 < r.bytes["build"] <= r.expected["build"], (r.rank, r.bytes, r.expected)
        assert r.bytes["build"] == r.expected["build"] or not first


@pytest.mark.parametrize(
    "world,sets",
    [
        (8, ["pipe_parallel_size=2", "model_parallel_size=2", "zero_optimization.stage=1"]),
        (4, ["model_parallel_size=2", "zero_optimization.stage=3"]),
        (4, ["context_parallel_size=2", "zero_optimization.stage=2"]),
        (4, ["zero_optimization.stage=3", "zero_optimization.mics_shard_size=2"]),
        (
            8,
            [
                *("pipe_parallel_size=2", "context_parallel_size=2", "zero_optimization.stage=1"),
                # tied: the last stage trains a copy of the embedding; a soft prompt: only it
                # trains, on the first stage; the second stage's layers share the first's
                *("no_weight_tying=false", 'soft_prompt_tuning={"enabled": true, "n_tokens": 4}'),
                "num_unique_layers=2",
            ],
        ),
    ],
    ids=[
        "pp2-tp2-dp2-zero1",
        "tp2-dp2-zero3",
        "cp2-dp2-zero2",
        "hybrid-2x2",
        "pp2-cp2-tied-prompt",
    ],
)
def test_every_rank_builds_agrees_and_holds_estimates_bytes(world, sets):
    loaded = _loaded(*sets)
    run = dry_run(loaded, world, ranks="all", workers=2)
    assert [r.rank for r in run.ranks] == list(range(world))
    _assert_holds_estimate(run)
    assert run.groups_checked > 0
    # the estimate verb's most loaded rank holds what that stage's heaviest rehearsed one does
    out = estimate(loaded, world)
    est, stage = out["resident_bytes"], out["heaviest_stage"]
    ranks = [r for r in run.ranks if r.coordinates["pp"] == stage]
    heaviest = max(ranks, key=lambda r: r.bytes["parameters"])
    assert heaviest.bytes["parameters"] == est["parameter_shard"]
    assert heaviest.bytes["optimizer"] == est["optimizer"]


def test_a_change_to_the_training_step_reaches_the_dry_run(monkeypatch):
    """The dry run steps through the trainer's own step (train/step.py): a collective added to
    the update, or a failure in the gradient half, is what it reports (its ranks are forked
    from this process, so they run the patched step)."""
    import torch

    from torchneox.train import step as step_module

    update = step_module.Update.__call__

    def with_a_new_collective(self, iteration, lr, loss):
        torch.distributed.all_reduce(torch.ones(7))
        return update(self, iteration, lr, loss)

    monkeypatch.setattr(step_module.Update, "__call__", with_a_new_collective)
    loaded = _loaded("zero_optimization.stage=3")
    run = dry_run(loaded, 2, ranks="all", workers=2)
    assert all(r.stepped for r in run.ranks)
    added = [Collective("all_reduce", (0, 1), ((7,),))]
    assert all([c for c in r.collectives if c.shapes == ((7,),)] == added for r in run.ranks)

    def broken(self, iteration, micro_batches):
        raise RuntimeError("a step that no longer runs")

    monkeypatch.setattr(step_module.Gradients, "__call__", broken)
    run = dry_run(loaded, 2, ranks="all", workers=2)
    assert [r.step for r in run.ranks] == ["stopped, RuntimeError: a step that no longer runs"] * 2


@pytest.mark.parametrize("cp", [1, 2])
def test_pipeline_ranks_hold_their_stages_and_exchange_activations(cp):
    loaded = _loaded("pipe_parallel_size=2", "model_parallel_size=2", f"context_parallel_size={cp}")
    run = dry_run(loaded, 8 * cp, ranks=f"0,{8 * cp - 1}", workers=2)
    first, last = run.ranks
    assert (first.stages, first.layers, first.holds) == ([0], [0, 1], ["embedding"])
    assert (last.stages, last.layers, last.holds) == ([1], [2, 3], ["head"])
    sends = [c for c in first.collectives if c.op == "p2p"]
    hidden = (2, 128 // cp, 128)  # micro-batch x this rank's part of the sequence x width
    assert [c.shapes for c in sends] == [(hidden,), (hidden,)]  # activations out, gradients in
    assert {c.group for c in sends} == {(0, 4 * cp), (4 * cp, 0)}
    # context parallel: each of the stage's 2 layers gathers its keys and values stacked
    # [2, micro-batch, local heads, local sequence, head size] over the context ranks (0, 2)
    gathers = [c for c in first.collectives if c.op == "all_gather" and len(c.shapes[0]) == 5]
    assert [(c.group, c.shapes) for c in gathers] == [((0, 2), ((2, 2, 2, 64, 32),))] * (
        2 if cp > 1 else 0
    )


def test_the_default_sample_is_the_ends_of_every_axis():
    loaded = _loaded("pipe_parallel_size=2", "model_parallel_size=2")
    run = dry_run(loaded, 16, workers=2)
    # mesh (pp 2, dp 4, tp 2): ranks at pp in {0,1} x dp in {0,3} x tp in {0,1}
    assert [r.rank for r in run.ranks] == [0, 1, 6, 7, 8, 9, 14, 15]
    assert sample_ranks(run.layout) == [0, 1, 6, 7, 8, 9, 14, 15]
    _assert_holds_estimate(run)


def test_a_disagreement_names_the_ranks_and_the_collective():
    def report(rank, calls):
        return RankReport(rank, 0, {}, [0], [], [], 0, {}, {}, [], "", collectives=calls)

    a = Collective("all_gather", (0, 1), ((8,), (16,)))
    b = Collective("all_gather", (0, 1), ((8,), (32,)))
    checked, problems = check_agreement([report(0, [a, a]), report(1, [a, b])])
    assert checked == 1
    assert problems == [
        "ranks 0 and 1 disagree on collective 2 of the group of ranks 0, 1: "
        "all_gather [(8,), (16,)] vs all_gather [(8,), (32,)]"
    ]
    _, missing = check_agreement([report(0, [a]), report(1, [])])
    assert "all_gather [(8,), (16,)] vs nothing (rank 1 made 0)" in missing[0]


def test_cli_reports_ranks_files_and_nodes(tmp_path, capsys):
    sets = [*UNTIED, "model_parallel_size=4", f"save={tmp_path}/ck"]
    argv = ["train", TINY, *[f"--set={s}" for s in sets], "--dry-run", "--world-size", "8"]
    assert main([*argv, "--nodes", "4", "--ranks", "0,5"]) == 0
    text = capsys.readouterr().out
    assert "rank 0 (node 0): pp 0 dp 0 cp 0 tp 0" in text
    assert "rank 5 (node 2): pp 0 dp 1 cp 0 tp 1" in text
    assert f"writes {tmp_path}/ck/global_step800/__5_0.distcp" in text
    assert "tensor-parallel groups span 2 node(s)" in text
    assert "keep model_parallel_size within one node's GPUs" in text
    assert "every rehearsed rank built and holds what estimate computes" in text
    assert not (tmp_path / "ck").exists()  # nothing written


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--dry-run", "--world-size", "4", "--ranks", "9"], "--ranks '9': ranks run from 0 to 3"),
        (["--dry-run", "--world-size", "6", "--nodes", "4"], "does not split over --nodes 4"),
        (["--world-size", "4"], "--world-size is for a dry run: add --dry-run"),
        (["--dry-run", "--world-size", "3"], "model_parallel_size"),
    ],
)
def test_cli_refuses_in_one_line(flags, message, capsys):
    sets = [*UNTIED, "model_parallel_size=2"]
    assert main(["train", TINY, *[f"--set={s}" for s in sets], *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert captured.out == ""


def _as_gloo_runs_it(c: Collective) -> tuple[str, tuple]:
    """A recorded collective as torch's flight recorder names it on gloo: by its input; FSDP's
    reduce-scatter runs there as an all-reduce of the whole gradient (gloo has none)."""
    if c.op == "reduce_scatter":
        return "all_reduce", c.shapes[-1]
    return c.op, c.shapes[-1] if c.op == "all_gather" else c.shapes[0]


@pytest.mark.parametrize(
    "keys",
    [{"zero_optimization": {"stage": 3}}, {"model_parallel_size": 2, "no_weight_tying": True}],
    ids=["dp2-zero3", "tp2"],
)
def test_the_rehearsed_step_calls_the_collectives_a_real_step_calls(keys, make_config, tmp_path):
    """A real two-process step on gloo, its collectives read from torch's flight recorder,
    against the dry run of the same config: the same operations in the same order on the
    same shapes, on each rank."""
    import json
    import os
    import subprocess
    import sys

    cfg = make_config(**keys, train_micro_batch_size_per_gpu=2, num_workers=0)
    out = tmp_path / "flight"
    out.mkdir()
    script = Path(__file__).with_name("flight_step.py")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [*argv, str(script), cfg, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rehearsed = dry_run(load_config([cfg]), 2, ranks="all", workers=2)
    assert not rehearsed.problems and all(r.stepped for r in rehearsed.ranks)
    for r in rehearsed.ranks:
        real = json.loads((out / f"rank{r.rank}.json").read_text())
        real = [(name.split(":")[-1], tuple(sizes[0]) if sizes else ()) for name, sizes in real]
        assert [_as_gloo_runs_it(c) for c in r.collectives] == real
        assert len(real) > 4


@pytest.mark.parametrize(
    "optimizer,world,sets",
    [
        ("{type: sm3, params: {lr: 0.1, momentum: 0.5}}", 4, ["model_parallel_size=2"]),
        ("{type: madgrad_wd, params: {lr: 0.01}}", 2, []),
        ("{type: lamb, params: {lr: 0.01}}", 2, []),
        ("{type: muon, params: {lr: 0.01}}", 4, ["model_parallel_size=2"]),
    ],
    ids=["sm3-tp2-dp2", "madgrad_wd-dp2", "lamb-dp2", "muon-tp2-dp2"],
)
def test_the_other_optimizers_hold_estimates_bytes(optimizer, world, sets):
    """SM3's accumulators (one number per row, column, ... of each shard) and momentum buffer,
    MADGRAD's three tensors with momentum, LAMB's two moments, muon's momentum buffer per
    hidden matrix and AdamW's two moments for the rest: each rank's state after a step on its
    ZeRO-3 shards is what estimate counts."""
    loaded = _loaded(*sets, "zero_optimization.stage=3", f"optimizer={optimizer}")
    run = dry_run(loaded, world, ranks="all", workers=2)
    _assert_holds_estimate(run)


def test_explain_estimate_and_the_dry_run_say_the_replica_groups(capsys):
    pytest.importorskip("torchft")  # a replica group's dry run checks that it is installed
    ft = ["ft_lighthouse=http://h:29510", "ft_replica_groups=4", "ft_replica_group=1"]
    group, alone = _loaded("zero_optimization.stage=3", *ft), _loaded("zero_optimization.stage=3")
    said = "replica groups: 4 (torchft, lighthouse http://h:29510), this run is group 1, each 2"
    # each group's memory is one group's layout: the estimate is the run without groups'
    est = estimate(group, 2)
    assert est["memory_per_rank_bytes"] == estimate(alone, 2)["memory_per_rank_bytes"]
    assert est["replica_groups"].startswith(said) and "8 in all" in est["replica_groups"]
    run = dry_run(group, 2, ranks="0", workers=1)
    assert not run.problems and run.replicas == est["replica_groups"]
    assert said in render(run)
    args = ["config", "explain", TINY, "--world-size", "2", "--json"]
    assert main([*args, *[a for k in [*UNTIED, *ft] for a in ("--set", k)]]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert explained["replica_groups"] == 4
    assert explained["replicated_batch_size"] == 4 * explained["train_batch_size"]
    assert "data-parallel ranks 2..3 of 8" in explained["reasons"]["replicated_batch_size"]
