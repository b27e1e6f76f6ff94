"""Config group of online reinforcement learning (train_impl reinforce): GPT-NeoX's REINFORCE
keys, its data-server addresses, and torchneox's rollouts sampled in the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchneox.config.fields import extension, key, no_effect

NO_WEIGHT_SERVER = (
    "torchneox does not send CUDA IPC handles to a vLLM server: rollouts sampled in the run "
    "(rollout_prompts) come from the current policy itself; a data server samples with its own "
    "weights"
)


@dataclass
class RolloutConfig:
    """Online reinforcement learning (train_impl reinforce): rollouts, rewards, advantages."""

    fp32_reinforce: bool = key(True, "REINFORCE: the log-probabilities in fp32.")
    kl_impl: Literal["abs", "mse", "kl", "full"] = key(
        "mse",
        "REINFORCE's KL penalty per token, from d = log pi - log pi_ref: abs |d|, mse d^2/2, "
        "kl d, or full (the sum over the vocabulary of pi (log pi - log pi_ref)).",
    )
    kl_div_beta: float = key(
        0.1, "Weight of REINFORCE's KL penalty; above 0 a frozen reference model is kept.", ge=0
    )
    reinforce_leave_one_out: bool = key(
        False,
        "RLOO: a completion's advantage is its reward minus the mean reward of the other "
        "completions of its prompt (else minus the mean of up to 100 earlier prompts' means).",
    )
    online_dataserver_ips: str | list[str] = key(
        "localhost",
        "Address of the data server (dataset_impl online), or one per data-parallel rank.",
    )
    online_dataserver_ports: int | list[int] = key(
        10000, "Port of the data server, or one per data-parallel rank."
    )
    online_dataserver_timeout: float = extension(
        600.0,
        "Seconds a data server may take to answer (or to accept) before the run stops saying so.",
        gt=0,
    )
    serve_model_weights: bool = no_effect(
        False,
        "Serve the weights to the online generation server (GPT-NeoX: CUDA IPC handles to vLLM).",
        NO_WEIGHT_SERVER,
    )
    weight_server_port: int | list[int] = no_effect(
        6000, "Port(s) the weights are served on.", NO_WEIGHT_SERVER
    )
    rollout_prompts: str | None = extension(
        None,
        "JSON-lines prompts ({prompt: text} or chat {messages: [...]}) the run samples its "
        "rollouts from, with the policy as it trains; set, it is used instead of a data server.",
    )
    rollout_generations: int = extension(
        4, "Completions sampled per prompt (a group: RLOO and GRPO compare within it).", ge=1
    )
    rollout_max_new_tokens: int = extension(64, "Tokens a completion may have at most.", ge=1)
    rollout_temperature: float = extension(
        1.0, "Sampling temperature of the rollouts (0: greedy).", ge=0
    )
    rollout_top_p: float = extension(
        1.0,
        "Nucleus sampling of the rollouts: the smallest set of tokens reaching top_p.",
        gt=0,
        le=1,
    )
    rollout_top_k: int = extension(0, "Sample the rollouts among the top_k tokens (0: all).", ge=0)
    reward_function: str | None = extension(
        None,
        "The reward of a completion: 'package.module:function' or 'file.py:function', called "
        "with the prompts' and the completions' texts (and the prompt records), returning floats.",
    )
    reward_model: str | None = extension(
        None,
        "The reward of a completion: a torchneox reward-model checkpoint (train_impl rm), its "
        "value at the completion's end.",
    )
    advantage_normalization: Literal["none", "group"] = extension(
        "none",
        "none: GPT-NeoX's baselines (reinforce_leave_one_out); group: GRPO's "
        "(r - mean) / (std + 1e-4) over each prompt's completions.",
    )
    rollout_updates: int = extension(
        1,
        "Optimizer steps taken on each rollout batch; above 1 the steps after the first weigh "
        "each token by the importance ratio to the sampling policy, clipped to clip_ratio.",
        ge=1,
    )
    clip_ratio: float = extension(
        0.2, "With rollout_updates above 1: the ratio is clipped to [1 - clip, 1 + clip].", gt=0
    )
