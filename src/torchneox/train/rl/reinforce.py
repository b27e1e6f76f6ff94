"""Online REINFORCE (train_impl reinforce): each prompt's completions, their advantages, and
the loss GPT-NeoX trains them with (megatron/training.py ``forward_step``, with the
advantages of megatron/data/online_dataset.py).

Advantages, one per completion, from the rewards r of a prompt's n completions:

- RLOO (``reinforce_leave_one_out``): A_i = r_i - mean_{j != i} r_j;
- otherwise GPT-NeoX's baseline: A_i = r_i - b, b the mean of up to 100 earlier prompts' mean
  rewards (0 before the first), the history then taking this prompt's mean;
- GRPO (``advantage_normalization: group``, beyond GPT-NeoX): A_i = (r_i - mean r) /
  (std r + 1e-4), std the sample standard deviation over the group.

No standard-deviation normalisation otherwise, as GPT-NeoX. The loss of a micro-batch of B
rows, with the completion tokens' mask m (the prompt is labelled -100) and d = log pi - log
pi_ref per token:

    loss = sum_{b,t} m (-log pi(y_bt) A_b + beta KL_bt) / (B * sum m)

KL is, by ``kl_impl``: kl d; abs |d|; mse d^2 / 2; full, the sum over the vocabulary of
pi (log pi - log pi_ref). With ``rollout_updates`` above 1 (beyond GPT-NeoX) the term of A
is PPO's clipped surrogate, -min(rho A, clip(rho, 1 - c, 1 + c) A) with rho = pi / pi_old, the
probability under the policy that sampled the batch: one gradient step equals REINFORCE's,
later steps on the same rollouts stay near it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchneox.parallel.collectives import plain
from torchneox.train.loss import token_logp

HISTORY = 100  # GPT-NeoX's reward buffer: the baseline is the mean of this many prompts' means
GROUP_EPS = 1e-4  # GRPO's (r - mean) / (std + eps)


def advantages(rewards: list[float], mode: str, history: list[float]) -> list[float]:
    """One prompt's completions' advantages (``mode``: rloo, group or baseline); ``history``,
    the baseline's earlier means, is updated in place for the baseline. Computed in float64,
    as GPT-NeoX's numpy does."""
    n = len(rewards)
    if mode == "rloo":
        return [r - _mean(rewards[:i] + rewards[i + 1 :]) for i, r in enumerate(rewards)]
    if mode == "group":
        mean = _mean(rewards)
        std = float(np.std(np.asarray(rewards, dtype=np.float64), ddof=1)) if n > 1 else 0.0
        return [(r - mean) / (std + GROUP_EPS) for r in rewards]
    baseline = _mean(history) if history else 0.0
    history.append(_mean(rewards))
    if len(history) > HISTORY:
        history.pop(0)
    return [r - baseline for r in rewards]


def _mean(values: list[float]) -> float:
    """numpy's mean of float64 values (pairwise summation), as GPT-NeoX's np.mean."""
    return float(np.mean(np.asarray(values, dtype=np.float64)))


def advantage_mode(rollout: Any) -> str:
    if rollout.reinforce_leave_one_out:
        return "rloo"
    return "group" if rollout.advantage_normalization == "group" else "baseline"


def kl_penalty(
    kind: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    logits: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    fp32: bool = True,
) -> torch.Tensor:
    """[B, T] the KL term of each position (``kind``: kl_impl); ``full`` reads the whole
    distributions (vocabulary-parallel logits included: the sum is gathered over the ranks)."""
    if kind == "full":
        assert logits is not None and ref_logits is not None
        own, ref = _log_softmax(logits, fp32), _log_softmax(ref_logits, fp32)
        return plain((own.exp() * (own - ref)).sum(-1))
    d = logp - ref_logp
    if kind == "abs":
        return d.abs()
    if kind == "mse":
        return 0.5 * d.square()
    return d


def _log_softmax(logits: torch.Tensor, fp32: bool) -> torch.Tensor:
    """log_softmax as x - logsumexp(x): on vocabulary-sharded logits under loss_parallel,
    torch's log_softmax has the backward of its cross-entropy pairing only (wrong gradients
    for any other use); this form's are right."""
    x = logits.float() if fp32 else logits
    return x - x.logsumexp(dim=-1, keepdim=True)


def surrogate(
    logp: torch.Tensor, adv: torch.Tensor, old_logp: torch.Tensor | None, clip: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] the policy-gradient term per token (``adv`` [B, 1]) and, with an old policy,
    which tokens were clipped: GPT-NeoX's -log pi A, or PPO's clipped ratio."""
    if old_logp is None:
        return -logp * adv, None
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


@dataclass
class Reinforce:
    kl_impl: str = "mse"
    beta: float = 0.1  # kl_div_beta
    fp32: bool = True  # fp32_reinforce
    clip: float = 0.2  # clip_ratio (with rollout_updates above 1)
    eod_id: int | None = None
    updates: int = 1  # rollout_updates: above 1, the ratio to the sampling policy is clipped

    @classmethod
    def from_config(cls, rollout: Any, eod_id: int | None) -> Reinforce:
        r = rollout
        return cls(
            r.kl_impl, r.kl_div_beta, r.fp32_reinforce, r.clip_ratio, eod_id, r.rollout_updates
        )

    console = ("reward", "reward_std", "kl", "clip_fraction")
    """The metrics the console line shows (every one is in metrics.jsonl and the trackers)."""

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    @property
    def metric_names(self) -> tuple[str, ...]:
        names = ("logp", "reward", "reward_std", "advantage")
        names += ("ref_logp", "kl") if self.needs_reference else ()
        return names + (("clip_fraction",) if self.updates > 1 else ())

    def prepare(self, batch: dict[str, torch.Tensor]) -> Any:
        from torchneox.train.batch import shifted

        prep = shifted(batch["text"], batch["label"], self.eod_id)
        prep.advantages = batch["advantage"].float().reshape(-1)
        prep.raw_rewards = batch["raw_reward"].float().reshape(-1)
        if "old_logp" in batch:
            prep.old_logp = batch["old_logp"].float()
        return prep

    def terms(
        self,
        logits: torch.Tensor,
        prep: Any,
        reference: torch.Tensor | None = None,
        router_stats: Any = None,
        placed: Any = None,
    ) -> Any:
        from torchneox.train.batch import Terms, text_kept

        assert prep.mask is not None and prep.advantages is not None
        prep = text_kept(logits, prep)  # (a soft prompt's model scores the text it kept)
        logp = token_logp(logits, prep.labels, self.fp32)
        adv = prep.advantages[:, None]
        old = prep.old_logp if self.updates > 1 else None  # (a pipeline's target has zeros)
        pg, clipped = surrogate(logp, adv, old, self.clip)
        m: dict[str, torch.Tensor] = {}
        per_token = pg
        if self.needs_reference:
            with torch.no_grad():  # (a pipeline's target carries it)
                ref_logp = prep.reference_logp
                if ref_logp is None:
                    assert reference is not None
                    ref_logp = token_logp(reference, prep.labels, self.fp32)
            kl = kl_penalty(self.kl_impl, logp, ref_logp, logits, reference, self.fp32)
            per_token = pg + self.beta * kl
            m["ref_logp"], m["kl"] = ref_logp.mean(), kl.detach().mean()
        mask = prep.mask.float()
        loss = ((per_token * mask).sum(-1) / mask.sum()).mean()
        rewards = prep.raw_rewards
        m["logp"] = logp.detach().mean()
        m["reward"] = rewards.mean()
        # the micro-batch's sample deviation, as GPT-NeoX (of one row: 0, not NaN)
        m["reward_std"] = rewards.std() if rewards.numel() > 1 else torch.zeros_like(rewards[0])
        m["advantage"] = prep.advantages.mean()
        if clipped is not None:
            m["clip_fraction"] = (clipped.float() * mask).sum() / mask.sum()
        return Terms(loss, loss, metrics=m)
