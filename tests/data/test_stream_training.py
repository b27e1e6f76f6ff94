"""Training on streamed raw text: a jsonl + parquet mix in one process, with ZeRO-3 on two and
with two pipeline stages; each run killed (or stopped) and resumed in its layout equals the
run never stopped, bit for bit, also when the loader's worker count changes;
another data-parallel size on resume is refused in one line (test_stream.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from tests.data.test_stream import documents, write_jsonl
from tests.forked import run_cli
from tests.helpers import losses, train, trained_once, weights

STEPS = 6


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("mix")
    write_jsonl(folder / "a.jsonl", documents(60, seed=1))
    table = pa.table({"text": documents(60, seed=2)})
    pq.write_table(table, folder / "b.parquet", row_group_size=20)
    return [str(folder / "a.jsonl"), str(folder / "b.parquet")]


def config(tmp_path, mix, name: str, **keys) -> str:
    cfg = (
        {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "seq_length": 16,
            "pos_emb": "rotary",
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "train_iters": STEPS,
            "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
            "precision": "fp32",
            "seed": 1234,
            "hidden_dropout": 0.0,  # two stages draw dropout masks apart from one process
            "no_weight_tying": True,  # as two pipeline stages need
            "tokenizer_type": "CharLevelTokenizer",
            "make_vocab_size_divisible_by": 64,
            "train_data_paths": mix,
            "valid_data_paths": mix[:1],
            "train_data_weights": [2, 1],
            "stream_shuffle_buffer": 8,
            "num_workers": 0,
            "eval_interval": 2,
            "eval_iters": 1,
            "log_interval": 1,
            "checkpoint_factor": 2,
            "save": str(tmp_path / name),
            "load": str(tmp_path / name),
        }
        | keys
    )
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def assert_same(resumed, whole) -> None:
    assert losses(resumed) == losses(whole)  # exact, every step
    assert losses(resumed, "grad_norm") == losses(whole, "grad_norm")
    a, b = weights(resumed), weights(whole)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_killed_and_resumed_with_other_workers_equals_the_whole_run(tmp_path, mix):
    whole = trained_once(config(tmp_path, mix, "whole"))
    killed = config(tmp_path, mix, "killed")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHNEOX_FAULT="kill@step.start:5")
    died = run_cli(["train", killed], env, timeout=300)
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    train(killed, "num_workers=2")  # from step 4's checkpoint, tokenized by two workers
    assert_same(tmp_path / "killed", whole)


def resumed_from(folder, step: int, into):
    """A copy of a finished run's folder as if it had died after saving ``step``."""
    shutil.copytree(folder, into)
    for later in into.glob("global_step*"):
        if int(later.name.removeprefix("global_step")) > step:
            shutil.rmtree(later)
    (into / "latest").write_text(f"global_step{step}\n")
    rows = (into / "metrics.jsonl").read_text().splitlines()
    kept = [r for r in rows if json.loads(r).get("iteration", 0) <= step]
    (into / "metrics.jsonl").write_text("".join(f"{r}\n" for r in kept))
    return into


LAYOUTS = {
    "zero3": ["zero_optimization.stage=3"],
    # two stages read the one data-parallel rank's stream
    "pp2": ["pipe_parallel_size=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_resumed_equal_the_whole_run(tmp_path, mix, layout):
    """Resumed from the whole run's step-4 checkpoint (what a kill after it leaves), steps 5-6
    and the final weights equal the whole run's (another data-parallel size is refused:
    tests/data/test_stream.py)."""
    whole = config(tmp_path, mix, "whole")
    train(whole, *LAYOUTS[layout], nproc=2)
    resumed_from(tmp_path / "whole", 4, tmp_path / "resumed")
    again = config(tmp_path, mix, "resumed")
    train(again, *LAYOUTS[layout], "num_workers=1", nproc=2)  # each rank's own tokenizer
    assert_same(tmp_path / "resumed", tmp_path / "whole")


def test_a_spike_rewound_skips_the_streams_batches(tmp_path, mix, monkeypatch, capsys):
    """The loss-spike guard on streamed text (one process, in this one): a spike at step 4 (the
    loss and gradients x 1000, the guards' fault hook) rewinds to step 2's checkpoint; the
    stream goes back with it and then on past the batches of steps 3-4. Steps 3-5 trained again
    and the weights equal those of a run whose stream simply lacked those batches, bit for
    bit."""
    from torchneox.base import faults
    from torchneox.config.load import load_config
    from torchneox.train.trainer import Trainer

    monkeypatch.setattr(faults, "_fired", set())
    monkeypatch.setenv(faults.ENV, "spike@step.backward:4")
    keys = {"train_iters": 5, "eval_iters": 0, "checkpoint_factor": 2}
    guarded = config(tmp_path, mix, "guarded", **keys, spike_action="rewind", spike_window=2)
    trainer = Trainer(load_config([guarded]), device="cpu")
    trainer.run()
    said = capsys.readouterr().out
    assert "skipping the 2 batch(es) of steps 3-4 (rewind 1 of 3" in said, said[-2000:]
    got = losses(tmp_path / "guarded"), losses(tmp_path / "guarded", "grad_norm")
    assert losses(tmp_path / "guarded", "skipped_batches")[5] == 2

    monkeypatch.delenv(faults.ENV)
    plain = config(tmp_path, mix, "plain", **keys, save=None, load=None)
    reference = Trainer(load_config([plain]), device="cpu")
    want: tuple[dict, dict] = ({}, {})
    for step in range(1, 6):
        if step == 3:  # the stream simply lacks the 2 batches the spike's steps read
            reference.train_loader.next()
            reference.train_loader.next()
        out = reference.train_step()
        want[0][step], want[1][step] = out["lm_loss"], out["grad_norm"]
    assert got == want
    for a, b in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert trainer.train_loader.state_dict() == reference.train_loader.state_dict()
