"""REINFORCE's formulas (train/rl/reinforce.py) against hand computations on fixed
log-probabilities and rewards: the three advantages, the loss of GPT-NeoX's forward_step with
each KL form, and the clipped importance ratio."""

from __future__ import annotations

import math

import pytest
import torch

from torchneox.train.objectives import Prepared
from torchneox.train.rl.reinforce import HISTORY, Reinforce, advantages

# ------------------------------------------------------------------------------ advantages


def test_rloo_is_each_reward_minus_the_mean_of_the_others():
    assert advantages([1.0, 0.0, 0.5], "rloo", []) == pytest.approx([0.75, -0.75, 0.0])
    assert advantages([2.0, 4.0], "rloo", []) == pytest.approx([-2.0, 2.0])


def test_the_baseline_is_the_mean_of_earlier_prompt_means():
    history: list[float] = []
    # first prompt: no history, the baseline is 0
    assert advantages([1.0, 3.0], "baseline", history) == [1.0, 3.0]
    assert history == [2.0]
    # second: the baseline is the first prompt's mean, 2
    assert advantages([0.0, 1.0], "baseline", history) == [-2.0, -1.0]
    assert history == [2.0, 0.5]
    assert advantages([5.0], "baseline", history) == [5.0 - 1.25]


def test_the_baseline_keeps_the_last_hundred_means():
    history: list[float] = []
    for i in range(HISTORY + 1):  # means 0, 1, ..., 100
        advantages([float(i)], "baseline", history)
    assert len(history) == 100 and history[0] == 1.0  # the mean 0 fell out
    (a,) = advantages([0.0], "baseline", history)
    assert a == pytest.approx(-sum(range(1, 101)) / 100)


def test_group_normalisation_divides_by_the_sample_deviation():
    rewards = [1.0, 0.0, 0.0, 1.0]
    std = math.sqrt(sum((r - 0.5) ** 2 for r in rewards) / 3)  # n - 1
    expected = [(r - 0.5) / (std + 1e-4) for r in rewards]
    assert advantages(rewards, "group", []) == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------ the loss

# two rows of four positions over a vocabulary of 3: the first two positions are the prompt
LOGITS = torch.tensor(
    [
        [[0.5, -1.0, 2.0], [1.0, 0.0, -0.5], [0.2, 0.3, -0.1], [-1.0, 1.5, 0.0]],
        [[0.0, 0.0, 1.0], [2.0, -2.0, 0.5], [-0.3, 0.8, 0.1], [0.4, -0.6, 1.2]],
    ]
)
REF = LOGITS.flip(-1) * 0.5
LABELS = torch.tensor([[0, 0, 1, 2], [0, 0, 2, 0]])
MASK = torch.tensor([[False, False, True, True], [False, False, True, True]])
ADV = [0.7, -0.4]
REWARDS = [1.0, 0.2]


def _logp(logits: torch.Tensor, b: int, t: int, v: int) -> float:
    row = [float(x) for x in logits[b, t]]
    return row[v] - math.log(sum(math.exp(x) for x in row))


def _probs(logits: torch.Tensor, b: int, t: int) -> list[float]:
    row = [float(x) for x in logits[b, t]]
    z = sum(math.exp(x) for x in row)
    return [math.exp(x) / z for x in row]


def _prep(old_logp: torch.Tensor | None = None) -> Prepared:
    prep = Prepared(LABELS.clone(), LABELS.clone(), MASK.clone())
    prep.advantages, prep.raw_rewards = torch.tensor(ADV), torch.tensor(REWARDS)
    prep.old_logp = old_logp
    return prep


def _hand_loss(kl_form: str | None, beta: float) -> float:
    count = sum(1 for b in range(2) for t in range(4) if MASK[b, t])
    total = 0.0
    for b in range(2):
        for t in range(4):
            if not MASK[b, t]:
                continue
            v = int(LABELS[b, t])
            lp, ref = _logp(LOGITS, b, t, v), _logp(REF, b, t, v)
            d = lp - ref
            kl = {
                None: 0.0,
                "kl": d,
                "abs": abs(d),
                "mse": 0.5 * d * d,
                "full": sum(
                    p * (math.log(p) - math.log(q))
                    for p, q in zip(_probs(LOGITS, b, t), _probs(REF, b, t), strict=True)
                ),
            }[kl_form]
            total += -lp * ADV[b] + beta * kl
    return total / (2 * count)  # sum(loss x mask) / (batch x total mask count)


def test_reinforce_without_a_reference_is_minus_logp_times_advantage():
    terms = Reinforce(beta=0.0).terms(LOGITS, _prep())
    assert float(terms.loss) == pytest.approx(_hand_loss(None, 0.0), rel=1e-6)
    assert float(terms.metrics["reward"]) == pytest.approx(0.6)
    assert float(terms.metrics["reward_std"]) == pytest.approx(math.sqrt(0.32), rel=1e-6)
    # GPT-NeoX's logp metric: the mean over every position, the prompt's too
    every = [_logp(LOGITS, b, t, int(LABELS[b, t])) for b in range(2) for t in range(4)]
    assert float(terms.metrics["logp"]) == pytest.approx(sum(every) / 8, rel=1e-6)
    assert "kl" not in terms.metrics


@pytest.mark.parametrize("form", ["kl", "abs", "mse", "full"])
def test_each_kl_form_adds_beta_times_its_penalty(form):
    terms = Reinforce(kl_impl=form, beta=0.3).terms(LOGITS, _prep(), reference=REF)
    assert float(terms.loss) == pytest.approx(_hand_loss(form, 0.3), rel=1e-6)


def test_the_loss_has_the_gradient_of_the_formula():
    logits = LOGITS.clone().requires_grad_(True)
    Reinforce(kl_impl="mse", beta=0.3).terms(logits, _prep(), reference=REF).objective.backward()
    check = LOGITS.clone().double().requires_grad_(True)
    logp = torch.log_softmax(check, -1).gather(-1, LABELS[..., None]).squeeze(-1)
    ref = torch.log_softmax(REF.double(), -1).gather(-1, LABELS[..., None]).squeeze(-1)
    per = -logp * torch.tensor(ADV).double()[:, None] + 0.3 * 0.5 * (logp - ref) ** 2
    ((per * MASK).sum(-1) / MASK.sum()).mean().backward()
    torch.testing.assert_close(logits.grad.double(), check.grad, rtol=1e-5, atol=1e-7)


def test_clipping_takes_the_smaller_of_the_ratio_and_its_clip():
    old = torch.tensor([[0.0, 0.0, -1.5, -0.6], [0.0, 0.0, -1.0, -2.5]])
    terms = Reinforce(beta=0.0, clip=0.2, updates=2).terms(LOGITS, _prep(old))
    total, count, clipped = 0.0, 4, 0
    for b in range(2):
        for t in (2, 3):
            ratio = math.exp(_logp(LOGITS, b, t, int(LABELS[b, t])) - float(old[b, t]))
            a = ADV[b]
            kept = min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
            clipped += kept != ratio * a
            total += -kept
    assert float(terms.loss) == pytest.approx(total / (2 * count), rel=1e-6)
    assert float(terms.metrics["clip_fraction"]) == pytest.approx(clipped / count)
    assert 0 < clipped < count  # the fixture clips some tokens, not all


def test_one_step_of_the_clipped_loss_has_reinforces_gradient():
    """At the sampling policy (ratio 1) the clipped surrogate's gradient is REINFORCE's."""
    logits = LOGITS.clone().requires_grad_(True)
    Reinforce(beta=0.0).terms(logits, _prep()).objective.backward()
    plain_grad = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(LOGITS, -1).gather(-1, LABELS[..., None]).squeeze(-1)
    Reinforce(beta=0.0, updates=2).terms(logits, _prep(logp.detach())).objective.backward()
    torch.testing.assert_close(logits.grad, plain_grad)


# ------------------------------------------------------------------ a loss spike rewound


def test_a_rewind_skips_the_rest_of_the_spikes_rollout_batch():
    """With rollout_updates 2 a rollout batch trains 2 steps. A spike rewound in the first of
    them (spike_action rewind: the loader set back where the spike left it, then ``rewound``)
    skips the second too: the next step samples a new batch from the rewound policy, with its
    own sampling log-probabilities, instead of training the policy the rewind threw away."""
    from types import SimpleNamespace

    from torchneox.data.online import Group
    from torchneox.train.rl.rollouts import RolloutBatches

    made = []

    def make(index: int) -> list[Group]:
        made.append(index)
        return [Group([1, 2], [[3 + index], [4 + index]], [1.0, 0.0])]

    rollout = SimpleNamespace(reinforce_leave_one_out=True, advantage_normalization=None)
    batches = RolloutBatches(
        SimpleNamespace(make=make), rollout, micro_batch=2, gas=1, seq_length=4, dp_rank=0,
        dp_size=1, old_logp=lambda micro_batches: [torch.zeros(2, 4)], updates=2,
    )  # fmt: skip
    first = batches.next()
    assert made == [0] and torch.equal(batches.next()[0]["text"], first[0]["text"])
    batches.rewound()  # at a batch's end: nothing to skip
    assert batches.steps == 2 and made == [0]
    batches.next()  # a new batch (index 1); its first step spikes and is rewound
    batches.load_state_dict(batches.state_dict())  # where the spike left the data
    batches.rewound()
    after = batches.next()
    assert made == [0, 1, 2]  # not the rest of batch 1: batch 2, sampled anew
    assert after[0]["text"][0, 2].item() == 3 + 2
