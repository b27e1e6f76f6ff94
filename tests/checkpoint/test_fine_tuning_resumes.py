"""A fine-tuning run rerun after a kill resumes: when ``save`` holds the run's own checkpoint, the
same command continues from it (its optimizer, data position and reference model with it), and
``load`` (a converted checkpoint, a Hugging Face folder, or a trained checkpoint under
``finetune: true``) is only where a fresh run starts. Each objective, killed at the start of
step 4 and rerun, gives the unstopped run's steps 3 and 4 bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.forked import run_cli
from tests.helpers import metric_rows, post_training_data, train
from tests.parallel.test_post_training_layouts import MODEL
from tests.train.rl.test_reinforce_run import EXAMPLE, tiny
from torchneox.cli import main

LORA = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["attention.wq", "mlp.down"]}}
# one checkpoint, at step 2 (and the end's); killed as step 5 starts, steps 1-4 done: the rerun
# redoes steps 3 and 4 from the checkpoint, which the killed run did without a stop
RUN = {
    "train_iters": 5,
    "lr_decay_iters": 5,
    "checkpoint_factor": 1000,
    "extra_save_iters": [2],
    "eval_interval": 100,
}
KILL = "kill@step.start:5"


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """The objectives' configs (as JSON files) and the bases they start from: a checkpoint
    trained one step, its Hugging Face folder and that folder converted back."""
    folder = tmp_path_factory.mktemp("bases")
    data = post_training_data(folder)
    out: dict[str, str] = {}
    for name, keys in (*data.items(), ("lora", data["sft"] | LORA)):
        path = folder / f"{name}.yml"
        path.write_text(json.dumps(MODEL | keys | RUN))
        out[name] = str(path)
    trained, hf, converted = folder / "trained", folder / "hf", folder / "converted"
    train(out["sft"], f"save={trained}", "load=null", "train_iters=1")
    assert main(["convert", "to-hf", str(trained), str(hf)]) == 0
    assert main(["convert", "from-hf", str(hf), str(converted)]) == 0
    out |= {"trained": str(trained), "hf": str(hf), "converted": str(converted)}
    # online RL: the shipped example's model, trained one step, as its own two bases
    rl_trained, rl_hf, rl_converted = folder / "rl", folder / "rl_hf", folder / "rl_converted"
    train(str(EXAMPLE), f"save={rl_trained}", *tiny(train_iters=1, lr_decay_iters=1))
    assert main(["convert", "to-hf", str(rl_trained), str(rl_hf)]) == 0
    assert main(["convert", "from-hf", str(rl_hf), str(rl_converted)]) == 0
    out |= {"rl_hf": str(rl_hf), "rl_converted": str(rl_converted)}
    return out


def command(bases: dict[str, str], objective: str, base: str, save: Path) -> list[str]:
    """``torchneox train`` of ``objective`` starting from ``base`` and saving into ``save``."""
    if objective == "reinforce":
        sets = tiny(**RUN, load=bases[f"rl_{base}"] if base != "none" else None)
        config = str(EXAMPLE)
    else:
        sets = [f"load={bases[base]}"]
        config = bases[objective]
        if base == "trained":
            sets.append("finetune=true")
    return ["train", config, *[a for s in (*sets, f"save={save}") for a in ("--set", s)]]


def run(argv: list[str], nproc: int, fault: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCHNEOX_FAULT", None)
    if fault:
        env["TORCHNEOX_FAULT"] = fault
    return run_cli([*argv, "--nproc", str(nproc)] if nproc > 1 else argv, env, timeout=300)


def assert_resumes_bitwise(bases, tmp_path, objective: str, base: str, *layout: str) -> None:
    """Killed as step 5 starts, rerun: steps 3 and 4, redone from the checkpoint of step 2,
    equal to the bit those the killed run did without a stop (step 4's through the restored
    optimizer state too)."""
    nproc = 2 if layout else 1
    sets = [a for s in layout for a in ("--set", s)]
    out = tmp_path / "killed"
    argv = [*command(bases, objective, base, out), *sets]
    killed = run(argv, nproc, KILL)
    unstopped = {r["iteration"]: r for r in metric_rows(out) if "lm_loss" in r}
    assert killed.returncode != 0 and sorted(unstopped) == [1, 2, 3, 4], killed.stderr[-3000:]
    again = run(argv, nproc)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert f"resuming this run from its own checkpoint {out}" in said, said
    assert "global_step2" in said
    rows = [r for r in metric_rows(out) if "lm_loss" in r]
    steps = [r["iteration"] for r in rows]
    assert steps.count(1) == 1 and steps[-3:] == [3, 4, 5], steps  # not started over
    redone = {r["iteration"]: r for r in rows[-3:]}
    for step in (3, 4):  # bit for bit
        for key in ("lm_loss", "grad_norm"):
            assert redone[step][key] == unstopped[step][key], (step, key, redone, unstopped)


OBJECTIVES = ("sft", "lora", "dpo", "kto", "rm", "reinforce")
ONE_PROCESS = [(o, b) for o in OBJECTIVES for b in ("converted", "hf")]
ONE_PROCESS.append(("sft", "trained"))  # finetune: true over a checkpoint with an optimizer


@pytest.mark.parametrize("objective, base", ONE_PROCESS)
def test_a_killed_fine_tuning_run_resumes_bitwise(bases, tmp_path, objective, base):
    assert_resumes_bitwise(bases, tmp_path, objective, base)


ZERO3 = ("gradient_accumulation_steps=1", "zero_optimization.stage=3")


ZERO3_CASES = [(o, b) for o in OBJECTIVES for b in ("converted", "hf")]


@pytest.mark.parametrize("objective, base", ZERO3_CASES)
def test_under_zero3_on_two_processes_too(bases, tmp_path, objective, base):
    """Every objective, from each kind of base, resumed as a sharded run."""
    assert_resumes_bitwise(bases, tmp_path, objective, base, *ZERO3)


def test_a_run_without_load_resumes_its_own_checkpoint(bases, tmp_path):
    """The shipped reinforce_tiny has no ``load``: rerun, it continues (it used to start over)."""
    assert_resumes_bitwise(bases, tmp_path, "reinforce", "none")


def test_a_fine_tuning_run_with_nothing_to_start_from_is_still_refused(bases, tmp_path):
    """No checkpoint in load and none of the run's own in save: one line, exit 2."""
    argv = ["train", bases["dpo"], "--set", f"load={tmp_path / 'empty'}"]
    assert main([*argv, "--set", f"save={tmp_path / 'out'}"]) == 2
