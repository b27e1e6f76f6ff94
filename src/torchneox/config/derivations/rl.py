"""What ``config explain`` says of online reinforcement learning (train_impl reinforce): where
the rollouts come from, the advantage and the loss each sample trains on, and whether a frozen
reference model is kept."""

from __future__ import annotations

from torchneox.base.errors import ConfigError
from torchneox.config.checks.rl import rollouts_in_run
from torchneox.config.derived import Derived
from torchneox.config.load import LoadedConfig

KL_FORMS = {
    "abs": "|log pi - log pi_ref|",
    "mse": "(log pi - log pi_ref)^2 / 2",
    "kl": "log pi - log pi_ref",
    "full": "sum over the vocabulary of pi (log pi - log pi_ref)",
}

SECTION = ("rollouts", "rewards", "advantage", "rl_loss", "reference_model", "rollout_updates")


def for_rank(value, rank: int):
    """GPT-NeoX's addressing of the data servers: a list is indexed by the data-parallel rank;
    one host or port serves every rank."""
    return value[rank] if isinstance(value, list | tuple) else value


def addresses(ips, ports, dp: int) -> list[str]:
    """Each data-parallel rank's data server, host:port ('?' where a list is too short)."""
    out = []
    for rank in range(dp):
        try:
            out.append(f"{for_rank(ips, rank)}:{for_rank(ports, rank)}")
        except IndexError:
            out.append("?")
    return out


def derive_rollouts(loaded: LoadedConfig, out: Derived) -> None:
    cfg = loaded.config
    if cfg.training.train_impl != "reinforce":
        return
    r, dp = cfg.rollout, out["data_parallel_size"]
    if rollouts_in_run(cfg):
        _whole_groups(loaded, out)
        out.put(
            "rollouts",
            r.rollout_prompts,
            f"sampled in the run from the policy as it trains: {r.rollout_generations} "
            f"completion(s) per prompt of {r.rollout_prompts}, up to {r.rollout_max_new_tokens} "
            f"new tokens, temperature {r.rollout_temperature:g}, top_p {r.rollout_top_p:g}"
            + (f", top_k {r.rollout_top_k}" if r.rollout_top_k else ""),
        )
        source = r.reward_function or r.reward_model
        kind = "function" if r.reward_function else "reward model"
        out.put("rewards", source, f"the {kind} {source}, on each completion")
    else:
        servers = addresses(r.online_dataserver_ips, r.online_dataserver_ports, dp)
        shown = ", ".join(f"rank {i}: {a}" for i, a in enumerate(servers))
        out.put(
            "rollouts",
            "data server",
            f"asked of GPT-NeoX data servers (dataset_impl online), one per data-parallel rank "
            f"({shown}); train_data_paths are not read",
        )
        out.put("rewards", "data server", "as the data server sends them")
    _advantage(cfg, out)


def _whole_groups(loaded: LoadedConfig, out: Derived) -> None:
    """Each rank's rows of a step hold whole prompts' groups of completions."""
    mb, gas = out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]
    n = loaded.config.rollout.rollout_generations
    if mb is not None and (mb * gas) % n:
        raise ConfigError(
            f"each rank's samples per step (micro-batch {mb} x {gas} accumulation steps) hold "
            f"whole prompts' groups of {n} completions; make them a multiple of "
            "rollout_generations",
            source=loaded.source("rollout_generations"),
            key="rollout_generations",
        )


def _advantage(cfg, out: Derived) -> None:
    r = cfg.rollout
    if r.reinforce_leave_one_out:
        adv = "rloo", "A = r minus the mean reward of the prompt's other completions"
    elif r.advantage_normalization == "group":
        adv = "group", "A = (r - mean) / (std + 1e-4) over the prompt's completions (GRPO)"
    else:
        adv = "baseline", "A = r minus the mean of up to 100 earlier prompts' mean rewards"
    out.put("advantage", *adv)
    kl = ""
    if r.kl_div_beta > 0:
        kl = f" + {r.kl_div_beta:g} x {KL_FORMS[r.kl_impl]} (kl_impl {r.kl_impl})"
    fp = "fp32" if r.fp32_reinforce else "the training precision"
    out.put(
        "rl_loss",
        "reinforce",
        f"per completion token -log pi(y) A{kl}; summed over the tokens and divided by "
        f"micro-batch x its completion tokens (log-probabilities in {fp})",
    )
    reference = r.kl_div_beta > 0
    out.put(
        "reference_model",
        reference,
        "a frozen copy of the starting policy, for the KL penalty"
        if reference
        else "none: kl_div_beta is 0",
    )
    if r.rollout_updates == 1:
        why = "1: each rollout batch trains one step, with no importance ratio (as GPT-NeoX)"
    else:
        why = (
            f"{r.rollout_updates} steps per rollout batch; every step weighs each token by "
            f"min(rho A, clip(rho, {1 - r.clip_ratio:g}, {1 + r.clip_ratio:g}) A), rho = "
            "pi / pi_sampling"
        )
    out.put("rollout_updates", r.rollout_updates, why)
