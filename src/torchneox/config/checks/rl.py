"""Checks of online reinforcement learning (train_impl reinforce): where the rollouts come
from, where their rewards come from, and the layouts the sampler runs in."""

from __future__ import annotations

from torchneox.config.checker import Checker
from torchneox.config.refusals import refusal


def rollouts_in_run(c) -> bool:
    """Whether the rollouts are sampled in the run (rollout_prompts), else asked of data servers."""
    return c.training.train_impl == "reinforce" and bool(c.rollout.rollout_prompts)


def check_reinforce(ch: Checker) -> None:
    c = ch.c
    r, impl = c.rollout, c.training.train_impl
    if impl != "reinforce":
        if c.data.dataset_impl == "online":
            ch.fail(
                "dataset_impl",
                f"online datasets hold REINFORCE's rollouts; train_impl {impl!r} reads "
                "train_data_paths (use gpt2, or train_impl reinforce)",
            )
        return
    if not r.rollout_prompts and c.data.dataset_impl != "online":
        ch.fail(
            "train_impl",
            "reinforce trains on rollouts: set rollout_prompts (a JSON-lines prompt file, sampled "
            "in the run) with reward_function or reward_model, or dataset_impl: online (GPT-NeoX's "
            "data servers, online_dataserver_ips/ports)",
        )
    if r.reinforce_leave_one_out and r.advantage_normalization == "group":
        ch.fail(
            "advantage_normalization",
            "group (GRPO) and reinforce_leave_one_out (RLOO) are two baselines; choose one",
        )
    if c.parallel.pipe_parallel_size > 1:
        _check_pipeline(ch)
    if r.rollout_prompts:
        _check_sampling(ch)


def _check_pipeline(ch: Checker) -> None:
    """Through a pipeline, reinforce trains on served rollouts or rollouts sampled through the
    stages, with the reference's log-probabilities of the labels (a pipeline pass of its own)."""
    r = ch.c.rollout
    if r.kl_impl == "full" and r.kl_div_beta > 0:
        ch.fail(
            "kl_impl",
            "full reads the reference's whole distributions, which a pipeline does not pass "
            "between its stages; use kl, abs or mse, or pipe_parallel_size 1",
        )
    if r.rollout_updates > 1:
        ch.fail(
            "rollout_updates",
            "more than one step per rollout batch does not run through a pipeline here; use 1, "
            "or pipe_parallel_size 1",
        )


def _check_sampling(ch: Checker) -> None:
    c = ch.c
    r = c.rollout
    if bool(r.reward_function) == bool(r.reward_model):
        ch.fail(
            "reward_function" if r.reward_function else "rollout_prompts",
            "rollouts sampled in the run need one source of rewards: set reward_function "
            "('module:function' or 'file.py:function') or reward_model (a reward-model "
            "checkpoint), not both",
        )
    n = r.rollout_generations
    if n < 2 and (r.reinforce_leave_one_out or r.advantage_normalization == "group"):
        key = "reinforce_leave_one_out" if r.reinforce_leave_one_out else "advantage_normalization"
        ch.fail(
            "rollout_generations",
            f"{key} compares the completions of a prompt with each other: sample at least 2 "
            "per prompt",
        )
    if c.parallel.sequence_parallel:
        ch.fail(
            "sequence_parallel",
            f"reinforce {refusal('reinforce', 'tp2 sp')}; turn it off",
        )
    if c.model.seq_length and r.rollout_max_new_tokens >= c.model.seq_length:
        ch.fail(
            "rollout_max_new_tokens",
            f"a completion of up to {r.rollout_max_new_tokens} tokens leaves no room for a "
            f"prompt in seq_length {c.model.seq_length}; lower it",
        )
