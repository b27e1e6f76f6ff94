"""inter_document_attention_masking in training, on a model of an attention layer and a mamba
layer (which restarts its convolution and scan at every document): on 2 processes (ZeRO 1
and 3, tensor parallel, context parallel: the mamba layer's state passed between the ranks'
chunks and cut at documents) and pipeline stages (each micro-batch's documents beside its tokens on
every stage) it equals one process; it changes what a packed sample learns; off, nothing changes (with pipeline stages
and context parallelism together: tests/parallel/test_context_parallel.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import DP_KEYS, assert_same_training, losses, one_process, train

MASKED = "inter_document_attention_masking=true"


@pytest.fixture(scope="module")
def config(make_module_config):
    keys = DP_KEYS | {"seq_length": 64, "no_weight_tying": True}
    keys |= {"attention_config": [[["global", "mamba"], 1]]}
    return make_module_config(train_micro_batch_size_per_gpu=2, train_iters=4, **keys)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory, MASKED)


@pytest.mark.parametrize(
    "layout",
    [
        ["zero_optimization.stage=1"],
        ["zero_optimization.stage=3"],
        ["model_parallel_size=2", "train_micro_batch_size_per_gpu=4"],
        # each micro-batch's documents go to every stage beside the tokens
        ["pipe_parallel_size=2", "train_micro_batch_size_per_gpu=4"],
        # the mamba layer runs each rank's chunks and passes its state on, cut at documents
        ["context_parallel_size=2", "train_micro_batch_size_per_gpu=4"],
    ],
    ids=["zero1", "zero3", "tp2", "pp2", "cp2"],
)
def test_two_processes_equal_one(config, tmp_path, baseline, layout):
    out = tmp_path / "two"
    train(config, f"save={out}", "load=null", MASKED, *layout, nproc=2)
    assert_same_training(out, baseline)


def test_masking_changes_training_and_off_changes_nothing(config, tmp_path, baseline):
    mb = "train_micro_batch_size_per_gpu=4"
    train(config, f"save={tmp_path / 'plain'}", "load=null", mb)
    train(
        config,
        f"save={tmp_path / 'off'}",
        "load=null",
        mb,
        "inter_document_attention_masking=false",
    )
    plain, off = losses(tmp_path / "plain"), losses(tmp_path / "off")
    assert plain == off  # bitwise
    assert all(abs(plain[k] - baseline[0][k]) > 1e-4 for k in (2, 3, 4))


def test_eval_masks_documents_as_training_did(config, tmp_path, tiny_data):
    """`torchneox eval --data-path` on a checkpoint trained with masking masks too (the
    checkpoint's config says so); unmasked, the same model gives another loss."""
    import json

    run = tmp_path / "masked"
    train(config, f"save={run}", "load=null", "train_micro_batch_size_per_gpu=4", MASKED)
    results = []
    for flag in ([], ["--set", "inter_document_attention_masking=false"]):
        args = [sys.executable, "-m", "torchneox", "eval", "--checkpoint", str(run)]
        args += ["--data-path", str(tiny_data), "--iters", "2", "--batch-size", "4", *flag]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1])["lm_loss"])
    masked, unmasked = results
    assert masked == masked and unmasked == unmasked and abs(masked - unmasked) > 1e-4
