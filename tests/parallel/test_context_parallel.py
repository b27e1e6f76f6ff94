"""Context parallelism (``context_parallel_size``): every sample's sequence split over ranks in
load-balanced chunks, attention over the gathered keys and values. With 2 and 4 context ranks,
alone, with data parallelism (each ZeRO stage), with tensor and with pipeline parallelism, training equals
one process over several steps; with document masking too (through pipeline stages with the loss
mask, the z-loss and MTP as well); checkpoints resume across layouts;
what cannot run beside it is refused in one line (config/refusals.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import (
    DP_KEYS,
    assert_resumes_bitwise,
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    one_process,
    reference,
    train,
    trained_once,
)
from torchneox.parallel.context_parallel import chunk_positions

KEYS = DP_KEYS | {"no_weight_tying": True, "eval_interval": 2, "eval_iters": 1}


def test_chunks_pair_early_with_late_and_cover_the_sequence():
    parts = [chunk_positions(16, 4, r, torch.device("cpu")).tolist() for r in range(4)]
    assert parts[0] == [0, 1, 14, 15] and parts[3] == [6, 7, 8, 9]
    assert sorted(x for part in parts for x in part) == list(range(16))


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(train_micro_batch_size_per_gpu=1, train_iters=3, **KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


# (the suite's budget: CP x TP without SP is in cp2-pp2-tp2, CP x PP alone in the interleaved
# resume below, 4 context ranks in test_checkpoints_resume_across_layouts' one-to-cp4,
# ZeRO-3 beside CP its cp2-zero3 and the hybrid and pipelined cases here, DDP beside CP the data
# parallelism of ZeRO-1's case)
@pytest.mark.parametrize(
    ("cp", "others", "nproc"),
    [
        (2, ["train_micro_batch_size_per_gpu=4"], 2),
        (2, ["zero_optimization.stage=1", "train_micro_batch_size_per_gpu=2"], 4),
        # x data parallel 4, ZeRO-3 within 2 groups of 2 data-parallel ranks (4 with their
        # context ranks), replicated across them
        (2, ["zero_optimization={stage: 3, mics_shard_size: 2}"], 8),
        (
            2,
            ["model_parallel_size=2", "sequence_parallel=true", "train_micro_batch_size_per_gpu=4"],
            4,
        ),
        (2, ["pipe_parallel_size=2", "pipeline_schedule=gpipe", "zero_optimization.stage=3",
          "train_micro_batch_size_per_gpu=2"], 8),
        (2, ["pipe_parallel_size=2", "model_parallel_size=2", "train_micro_batch_size_per_gpu=4"], 8),
    ],
    ids=[
        "cp2", "cp2-dp2-zero1", "cp2-dp4-zero3-hybrid", "cp2-tp2-sp",
        "cp2-pp2-gpipe-dp2-zero3", "cp2-pp2-tp2",
    ],
)  # fmt: skip
def test_equals_one_process(config, tmp_path, baseline, cp, others, nproc):
    out = tmp_path / "cp"
    run = train(
        config, f"save={out}", "load=null", f"context_parallel_size={cp}", *others, nproc=nproc
    )
    said = f"context parallel: each sample's 32 tokens split over {cp} ranks ({32 // cp} each"
    assert said in run.stdout + run.stderr
    assert_same_training(out, baseline)


CURRICULUM = (
    "curriculum_learning={enabled: true, curriculum_type: seqlen, min_difficulty: 8, "
    "max_difficulty: 32, schedule_type: fixed_discrete, "
    "schedule_config: {difficulty: [8, 16, 32], max_step: [1, 2]}}"
)
VARIANTS = {
    # documents: positions restart and attention stays inside each, the loss skips EOD inputs;
    # ALiBi and a sliding window under them, with curriculum learning's growing length (each
    # cut into the ranks' chunks)
    "documents-alibi-window": [
        *("inter_document_attention_masking=true", "eod_mask_loss=true"),
        *("pos_emb=alibi", "sliding_window_width=12", "lm_z_loss=0.01", CURRICULUM),
    ],
    # top-k routing is per token (sinkhorn balances the tokens a rank holds, as in GPT-NeoX);
    # MLA gathers its latents and rotary keys, each rotated at its own chunk's positions
    "moe-mla": [
        *("moe_num_experts=4", "moe_top_k=2", "moe_router_type=topk", "moe_aux_loss_coeff=0.01"),
        *("mla_kv_lora_rank=24", "mla_q_lora_rank=32", "mla_qk_nope_head_dim=12"),
        *("mla_qk_rope_head_dim=8", "mla_v_head_dim=16", "rotary_pct=1.0"),
    ],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_options_equal_one_process(config, tmp_path, variant):
    keys = VARIANTS[variant]
    one, out = tmp_path / "one", tmp_path / "cp"
    mb = "train_micro_batch_size_per_gpu=4"  # the same micro-batches: their masked means agree
    train(config, f"save={one}", "load=null", mb, *keys)
    cp = ["context_parallel_size=2", mb, *keys]
    resumed = variant == "moe-mla"  # stopped after step 2, it resumes on 2 context ranks
    train(config, f"save={out}", "load=null", *cp, *["checkpoint_factor=2"] * resumed, nproc=2)
    assert_same_training(out, reference(one))
    if resumed:
        assert_resumes_bitwise(config, out, 2, cp, nproc=2)
    for extra in ("moe_aux_loss", "z_loss"):  # the extra terms, each over the whole batch
        want = losses(one, extra)
        assert losses(out, extra) == pytest.approx(want, rel=1e-5)
        assert bool(want) == (
            extra
            in {"moe-mla": "moe_aux_loss", "documents-alibi-window": "z_loss"}.get(variant, "")
        )
    if CURRICULUM in keys:
        assert losses(out, "curriculum_seqlen") == {1: 8, 2: 16, 3: 32}


@pytest.mark.parametrize(
    ("first", "first_nproc", "then", "then_nproc"),
    [
        (["context_parallel_size=2"], 2, ["train_micro_batch_size_per_gpu=4"], 1),
        (["train_micro_batch_size_per_gpu=4"], 1, ["context_parallel_size=4"], 4),
        (["context_parallel_size=2", "zero_optimization.stage=3", "train_micro_batch_size_per_gpu=2"], 4,
         ["context_parallel_size=2", "model_parallel_size=2"], 4),
    ],
    ids=["cp2-to-one", "one-to-cp4", "cp2-zero3-to-cp2-tp2"],
)  # fmt: skip
def test_checkpoints_resume_across_layouts(
    make_config, tmp_path, first, first_nproc, then, then_nproc
):
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=4, train_iters=6, **KEYS)
    assert_resumes_like_whole(cfg, tmp_path, [], first, first_nproc, then, then_nproc)


def test_interleaved_pipeline_stages_with_documents_and_mtp_equal_and_resume_as_one_process(
    make_config, tmp_path
):
    """Two stages per pipeline rank, each running under the rank's part of the sequence, with
    what the stages' split carries besides the tokens: the documents (each stage gathers the
    keys' documents of every micro-batch), the loss mask (eod_mask_loss), lm_z_loss's term and
    MTP's tokens ahead (the last stage reads them from the whole target). Every step, its
    z-loss and MTP loss and the evaluation equal one process's, stopped at step 3 and resumed
    on two stages under zbv, whose V puts the first and the last stage on the first rank: the
    last stage's copy of the embedding (MTP's tokens ahead) is loaded, its gradient added to
    the first stage's and its values refreshed after each step."""
    features = {
        "inter_document_attention_masking": True,
        "eod_mask_loss": True,
        "lm_z_loss": 0.01,
        "mtp_num_layers": 1,
    }
    cfg = make_config(
        "long.yml", train_micro_batch_size_per_gpu=4, train_iters=6, num_layers=4, **KEYS,
        **features,
    )  # fmt: skip
    first = [
        "context_parallel_size=2",
        "pipe_parallel_size=2",
        "pipeline_schedule=interleaved_1f1b",
    ]
    then = ["pipe_parallel_size=2", "pipeline_schedule=zbv"]
    moved = assert_resumes_like_whole(cfg, tmp_path, [], first, 4, then, 2)
    whole = trained_once(cfg)
    for key in ("lm_loss", "z_loss", "mtp_loss_1"):
        want, got = losses(whole, key), losses(moved, key)
        assert sorted(got) == list(range(1, 7)) and all(want.values()), key
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-5), (key, k)
    # the evaluation of step 2, through the stages (the next token only, its mask applied)
    want, got = losses(whole, "valid_lm_loss")[2], losses(moved, "valid_lm_loss")[2]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize(
    ("keys", "nproc", "said"),
    [
        (["seq_length=36"], 4, "seq_length 36 must be a multiple of 2 x context_parallel_size = 8"),
        (["model_parallel_size=3"], 8, "world size 8 is not divisible by pipeline stages 1 x "
         "model_parallel_size 3 x context_parallel_size 4"),
    ],
    ids=["seq-length", "world"],
)  # fmt: skip
def test_what_does_not_run_is_one_line(config, keys, nproc, said):
    args = [sys.executable, "-m", "torchneox", "train", config, "--nproc", str(nproc)]
    for key in ["context_parallel_size=4", "train_micro_batch_size_per_gpu=4", "load=null", *keys]:
        args += ["--set", key]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    lines = [x for x in run.stderr.splitlines() if x.startswith("torchneox:")]
    assert run.returncode == 2 and len(lines) == 1 and said in lines[0], run.stderr
    assert "context_parallel_size" in lines[0]
