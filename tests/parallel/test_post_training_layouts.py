"""Post-training in every layout: SFT with label masks, DPO and KTO with their frozen reference
model, and a reward model each give, on 2 processes (data parallel at every ZeRO stage, tensor
parallel, pipeline parallel, context parallel, experts split over the ranks), the losses,
metrics, gradients and weights of one process, and so does a reward model on 2 pipeline stages x
2 context ranks; a stopped run (DPO through 2 pipeline stages x 2 context ranks among them)
resumes like one never stopped, its reference model included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import (
    assert_resumes_bitwise,
    assert_same_training,
    losses,
    metric_rows,
    post_training_data,
    reference,
    train,
)

METRICS = {
    "sft": (),
    "dpo": ("chosen_rewards", "rejected_rewards", "reward_acc", "margins", "ref_pos", "chosen_neg"),
    "kto": ("kl", "policy_logp", "ref_logp", "policy_rewards", "reward_acc"),
    "rm": ("pos_values", "neg_values", "margin", "accuracy"),
}
MODEL = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "pos_emb": "rotary",
    "norm": "rmsnorm",
    "activation": "swiglu",
    "no_weight_tying": True,
    "use_bias_in_norms": False,
    "use_bias_in_attn_linear": False,
    "use_bias_in_mlp": False,
    "make_vocab_size_divisible_by": 64,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "train_iters": 3,
    # eps 1e-6: an element whose gradient is float noise (~1e-9, summed in another order by
    # each layout) moves by lr * g / (|g| + eps), which stays far below the tolerance
    "optimizer": {"type": "Adam", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-6}},
    "lr_decay_style": "constant",
    "warmup": 0.0,
    "weight_decay": 0.1,
    "gradient_clipping": 1.0,
    "precision": "fp32",
    "seed": 1234,
    "num_workers": 0,
    "eval_interval": 3,
    "eval_iters": 1,
    "log_interval": 1,
    "dpo_beta": 0.5,
}
# without the balancing loss: it sees the whole batch across ranks (one process with the
# ranks' micro-batches as one), which tests/parallel/test_expert_parallel.py holds, while
# here the micro-batches stay as they are (KTO pairs halves of one, SFT averages over one)
MOE = {"moe_num_experts": 2, "moe_top_k": 1, "moe_aux_loss_coeff": 0.0}
# adapters on the frozen base (a reward model's value head trained beside them)
LORA = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["attention.wq", "attention.wv"]}}
# 2 processes: the same micro-batches as one process with 2 accumulation steps (KTO pairs the
# halves of each micro-batch, so the micro-batch stays 2 in every layout)
# (ZeRO-2 runs ZeRO-1's code, FSDP2 keeping the gathered weights through backward: its parity
# is tests/parallel/test_data_parallel.py's)
LAYOUTS = {
    "zero0": ["gradient_accumulation_steps=1", "zero_optimization.stage=0"],
    "zero1": ["gradient_accumulation_steps=1", "zero_optimization.stage=1"],
    "zero3": ["gradient_accumulation_steps=1", "zero_optimization.stage=3"],
    "tp2": ["model_parallel_size=2"],
    # each tensor rank's slice of the positions, gathered whole before the value head
    "tp2-sp": ["model_parallel_size=2", "sequence_parallel=true"],
    "pp2": ["pipe_parallel_size=2"],  # 2 stages, the reference's split as the policy's
    # each rank's part of every sequence, the outputs (the reference's too) gathered whole
    "cp2": ["context_parallel_size=2"],
    # ... through 2 stages (4 processes): the last stage gathers them, the target stays whole
    "pp2 cp2": ["pipe_parallel_size=2", "context_parallel_size=2"],
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("post_training")
    data = post_training_data(folder)
    out = {}
    for name, keys in data.items():
        for variant, extra in (("", {}), ("_moe", MOE), ("_lora", LORA)):
            path = folder / f"{name}{variant}.yml"
            path.write_text(json.dumps(MODEL | keys | extra))
            out[path.stem] = str(path)
    return out


@pytest.fixture(scope="module")
def one_process(configs, tmp_path_factory):
    """Each objective's one-process run (computed once, when a test first asks)."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            out = tmp_path_factory.mktemp(f"one_{name}") / "run"
            train(configs[name], f"save={out}", "load=null", f"log_dir={out}")
            cache[name] = (reference(out), metric_rows(out))
        return cache[name]

    return get


def assert_same_metrics(out: Path, rows: list[dict], names: tuple[str, ...]) -> None:
    ours = metric_rows(out)
    for key in (*names, *(f"valid_{n}" for n in names)):
        theirs = {r["iteration"]: r[key] for r in rows if key in r}
        got = {r["iteration"]: r[key] for r in ours if key in r}
        assert theirs and sorted(got) == sorted(theirs), key
        for k in got:
            assert got[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-5), (key, k)


# Not the whole product (the suite's budget): every objective under two or three layouts and
# every layout under one to three objectives, the stopped runs below adding DPO and KTO at
# ZeRO-3 and DPO through stages; what differs between objectives is the loss and its
# reference model, between layouts how the batch and the weights are split, and each pairing
# of a kind of loss with a kind of split is held once
CASES = [
    ("sft", "zero0"), ("sft", "tp2"), ("sft", "pp2"),
    ("dpo", "zero1"), ("dpo", "tp2"),
    ("kto", "zero3"), ("kto", "pp2"),
    ("rm", "zero3"), ("rm", "tp2-sp"), ("rm_lora", "pp2"),
    # context parallelism: the outputs gathered whole for a sum over a sequence (DPO's; KTO's
    # alike) and, through pipeline stages, for a reward model's last position (DPO through
    # stages: the stopped run below; SFT under CP is language modelling with a loss mask:
    # test_context_parallel's)
    ("dpo", "cp2"), ("rm", "pp2 cp2"),
]  # fmt: skip


@pytest.mark.parametrize("objective, layout", CASES)
def test_two_processes_equal_one(configs, one_process, tmp_path, objective, layout):
    baseline, rows = one_process(objective)
    out, layout_keys = tmp_path / "run", LAYOUTS[layout]
    nproc = 4 if layout == "pp2 cp2" else 2
    # stopped after step 2, it resumes on 2 tensor ranks (2 stages) to the bit
    resumed = layout == "tp2-sp" or objective == "rm_lora"
    saves = ["checkpoint_factor=2"] * resumed
    cfg = configs[objective]
    train(cfg, f"save={out}", "load=null", f"log_dir={out}", *layout_keys, *saves, nproc=nproc)
    assert_same_training(out, baseline)
    assert_same_metrics(out, rows, METRICS[objective.removesuffix("_lora")])
    assert objective.endswith("_lora") == any(".lora_B." in n for n in baseline[2])
    if resumed:
        assert_resumes_bitwise(cfg, out, 2, layout_keys, nproc=2)


@pytest.mark.parametrize("objective", ["dpo", "kto"])  # a reference model; KTO's paired halves
def test_mixture_of_experts_split_over_two_processes_equals_one(
    configs, one_process, tmp_path, objective
):
    """The experts split over 2 ranks (expert parallel, data parallel around it); the
    reference model's experts are split as the policy's are."""
    baseline, rows = one_process(f"{objective}_moe")
    out = tmp_path / "run"
    split = ["gradient_accumulation_steps=1", "expert_parallel_size=2"]
    train(
        configs[f"{objective}_moe"], f"save={out}", "load=null", f"log_dir={out}", *split, nproc=2
    )
    assert_same_training(out, baseline)
    assert_same_metrics(out, rows, METRICS[objective])


STOPPED_UNDER = {
    "zero3": (["gradient_accumulation_steps=1", "zero_optimization.stage=3"], 2),
    # 2 stages x 2 context ranks: each rank's stages run its part of every sequence, the
    # policy's and the reference's outputs gathered whole on the last stage
    "pp2 cp2": (["pipe_parallel_size=2", "context_parallel_size=2"], 4),
}


@pytest.mark.parametrize(
    "objective, layout", [("dpo", "zero3"), ("kto", "zero3"), ("dpo", "pp2 cp2")]
)
def test_a_stopped_run_resumes_like_one_never_stopped_reference_included(
    configs, tmp_path, objective, layout
):
    """Stopped at step 2 (ZeRO 3 on 2 processes, or 2 pipeline stages x 2 context ranks) and
    resumed on one: steps 1-2 equal one process's, and the reference model comes back from
    the checkpoint (not from the policy of step 2), so steps 3-4, their rewards and the final
    weights equal those of a run never stopped."""
    cfg, four = configs[objective], "train_iters=4"
    whole = tmp_path / "whole"
    train(cfg, f"save={whole}", "load=null", f"log_dir={whole}", four)
    moved = tmp_path / "moved"
    keys, nproc = STOPPED_UNDER[layout]
    first = [four, "exit_interval=2", *keys]
    train(cfg, f"save={moved}", "load=null", f"log_dir={moved}", *first, nproc=nproc)
    train(cfg, f"save={moved}", f"load={moved}", f"log_dir={moved}", four)
    assert_same_training(moved, reference(whole))  # every step's loss and gradient norm
    key = METRICS[objective][0]
    for k in (1, 2, 3, 4):
        assert losses(moved, key)[k] == pytest.approx(losses(whole, key)[k], rel=1e-4, abs=1e-6)
