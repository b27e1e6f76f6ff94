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
