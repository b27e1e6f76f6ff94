"""Each post-training loss equals an independent reference on the same log-probabilities: the
per-token log-probabilities trl computes (its selective_log_softmax), DPO's loss as its paper
writes it, KTO's as trl's KTO trainer computes it (where GPT-NeoX's batch-half form coincides),
and the reward model's Bradley-Terry loss; the reference model never trains."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import post_training_data
from torchneox.config.load import load_config
from torchneox.train.loss import token_logp
from torchneox.train.objectives import DPO, KTO, Prepared, RewardModel, shifted

V, T = 11, 7


def logits_and_labels(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, T, V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (rows, T), generator=g)
    return logits, labels


def test_token_log_probabilities_equal_trl_s():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    logits, labels = logits_and_labels(3)
    theirs = trl_utils.selective_log_softmax(logits.detach(), labels)
    assert torch.allclose(token_logp(logits.detach().clone(), labels, True), theirs, atol=1e-6)


def test_dpo_loss_is_the_paper_s():
    """-log sigmoid(beta * ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))))."""
    policy, labels = logits_and_labels(4)
    ref, _ = logits_and_labels(4, seed=1)
    mask = torch.rand(4, T, generator=torch.Generator().manual_seed(2)) > 0.3
    terms = DPO(beta=0.3).terms(policy, Prepared(labels, labels, mask), ref)

    def seq_logp(logits):  # each answer's log-probability: its labelled tokens' log-probs summed
        lp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
        return (lp * mask).sum(-1)

    pi, r = seq_logp(policy), seq_logp(ref)
    want = -F.logsigmoid(0.3 * ((pi[:2] - r[:2]) - (pi[2:] - r[2:]))).mean()
    assert terms.loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert terms.metrics["chosen_rewards"].item() == pytest.approx(
        (0.3 * (pi[:2] - r[:2])).mean().item(), rel=1e-5
    )
    free = DPO(beta=0.3, reference_free=True).terms(policy, Prepared(labels, labels, mask), None)
    want_free = -F.logsigmoid(0.3 * (pi[:2] - pi[2:])).mean()
    assert free.loss.item() == pytest.approx(want_free.item(), rel=1e-6)
    # the gradient flows into the policy only
    terms.loss.backward()
    assert policy.grad is not None and policy.grad.abs().sum() > 0


@pytest.mark.parametrize("first_reward", [1.0, -1.0])
def test_kto_loss_equals_trl_s_where_the_two_forms_meet(first_reward):
    """A micro-batch of 2 rows whose every position carries the row's reward (no padding):
    GPT-NeoX's halves are one row each, and its loss is trl's KTO loss, the KL reference point
    of each row taken from the other row (trl: the mismatched completions)."""
    policy, labels = logits_and_labels(2)
    ref, _ = logits_and_labels(2, seed=1)
    mask = torch.ones(2, T, dtype=torch.bool)
    rewards = torch.tensor([[first_reward] * T, [-first_reward] * T])
    prep = Prepared(labels, labels, mask, rewards)
    beta, wd, wu = 0.2, 1.0, 1.5
    terms = KTO(beta, wd, wu).terms(policy, prep, ref)

    def seq(logits):
        return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)

    logratio = (seq(policy) - seq(ref)).sum(-1)  # per row
    kl = logratio.clamp(min=0).detach()  # trl clamps the KL estimate at 0
    losses = []
    for row, other in ((0, 1), (1, 0)):
        desirable = rewards[row, 0] > 0
        z = logratio[row] - kl[other]
        loss = 1 - torch.sigmoid(beta * z) if desirable else 1 - torch.sigmoid(beta * -z)
        losses.append((wd if desirable else wu) * loss)
    # GPT-NeoX weighs each half by 0.5 and averages over the rows of a half (one here)
    want = 0.5 * (losses[0] + losses[1])
    assert terms.loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert terms.metrics["kl"].item() == pytest.approx((logratio.sum() / mask.sum()).item())
    # a micro-batch without a labelled token (a curriculum's cut) logs a kl of 0, not NaN
    empty = KTO(beta, wd, wu).terms(policy, Prepared(labels, labels, ~mask, rewards), ref)
    assert empty.metrics["kl"].item() == 0.0


def test_reward_model_loss_is_bradley_terry_at_the_labelled_position():
    values = torch.randn(4, T, 1, requires_grad=True)
    mask = torch.zeros(4, T, dtype=torch.bool)
    at = [3, 6, 2, 5]
    for row, pos in enumerate(at):
        mask[row, pos] = True
    terms = RewardModel(z_weight=0.01).terms(values, Prepared(mask.long(), mask.long(), mask))
    v = torch.stack([values[r, p, 0] for r, p in enumerate(at)])
    pos, neg = v[:2], v[2:]
    want = -F.logsigmoid(pos - neg).mean() + (0.01 * (pos**2 + neg**2)).mean()
    assert terms.loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert terms.metrics["accuracy"].item() == ((pos - neg) > 0).float().mean().item()


def test_a_reward_sample_with_two_labelled_positions_is_refused():
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[:, 2:4] = True
    with pytest.raises(
        Exception, match="a sample has 2; preprocess the pairs with --chat --for-rm"
    ):
        RewardModel().terms(torch.randn(2, T, 1), Prepared(mask.long(), mask.long(), mask))


def test_labels_are_the_label_dataset_s_and_masked_positions_read_as_0():
    tokens = torch.tensor([[5, 6, 7, 8, 0]])
    labels = torch.tensor([[-100, -100, 7, 8, -100]])
    prep = shifted(tokens, labels, None)
    assert prep.inputs.tolist() == [[5, 6, 7, 8]]
    assert prep.labels.tolist() == [[0, 7, 8, 0]] and prep.mask.tolist() == [[0, 1, 1, 0]]


def test_the_reference_model_never_trains(tmp_path):
    """DPO's reference: no gradients, not in the optimizer, in eval mode, unchanged by steps."""
    from torchneox.train.trainer import Trainer

    data = post_training_data(tmp_path)
    values = data["dpo"] | {
        "num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 64,
        "train_micro_batch_size_per_gpu": 2, "train_iters": 2, "num_workers": 0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "eval_interval": 100,
        "eval_iters": 0, "make_vocab_size_divisible_by": 64,
    }  # fmt: skip
    (tmp_path / "dpo.yml").write_text(json.dumps(values))
    trainer = Trainer(load_config([tmp_path / "dpo.yml"]))
    ref = trainer.parts.reference
    assert ref is not None and not ref.training
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert all(not p.requires_grad and id(p) not in optimized for p in ref.parameters())
    trainer.train_step()
    trainer.train_step()
    assert all(p.grad is None for p in ref.parameters())
    assert all(torch.equal(before[k], v) for k, v in ref.state_dict().items())
    policy = dict(trainer.model.named_parameters())
    assert any(not torch.equal(policy[k], before[k]) for k in before)  # the policy moved
