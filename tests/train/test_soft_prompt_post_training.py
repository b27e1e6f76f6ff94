"""soft_prompt_tuning under the post-training objectives: DPO trains the prompt alone against a
reference that carries the prompt's initial values (ln 2 at the first step; a resumed run reads
that reference back and continues to the bit), its loss on the prompted pairs equal to a hand
computation on the text the model kept; KTO, a reward model and
REINFORCE read their rewards, values and log-probabilities at the kept positions, and only the
prompt (a reward model: and its value head) gets a gradient; context parallelism's layout of
[prompt, text] comes back to the text alone."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import BASE, post_training_data
from torchneox.base.errors import DataError
from torchneox.config.load import load_config, load_mapping
from torchneox.data.loader import stack
from torchneox.models.args import model_args
from torchneox.models.params import SOFT_PROMPT, VALUE_HEAD
from torchneox.models.transformer import build_model
from torchneox.train.batch import past_prompt, shifted, text_kept
from torchneox.train.objectives import KTO, RewardModel
from torchneox.train.rl.reinforce import Reinforce
from torchneox.train.soft_prompt import before_text

PROMPT = {"enabled": True, "n_tokens": 4, "init_range": 0.25}
SEQ, N = 12, 4  # the unit tests' model: 12 positions, 8 of them text


def logp_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


def assert_only_trained(model, trained: tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        if name in trained:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_dpo_tunes_the_prompt_alone_against_the_prompt_it_started_from(tmp_path):
    values = post_training_data(tmp_path, only=("dpo",))["dpo"] | {
        "num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 64,
        "max_position_embeddings": 64, "pos_emb": "rotary", "train_micro_batch_size_per_gpu": 2,
        "train_iters": 3, "num_workers": 0, "eval_interval": 100, "eval_iters": 0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "make_vocab_size_divisible_by": 64,
        "dpo_beta": 0.5, "soft_prompt_tuning": PROMPT, "precision": "fp32",
        "save": str(tmp_path / "run"),
    }  # fmt: skip
    (tmp_path / "dpo.yml").write_text(json.dumps(values))
    from torchneox.train.trainer import Trainer

    trainer = Trainer(load_config([tmp_path / "dpo.yml"]))
    model, ref = trainer.model, trainer.parts.reference
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert torch.equal(ref.soft_prompt.weight, start[SOFT_PROMPT])  # the initial prompt
    first = trainer.train_step()
    assert first["lm_loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    trainer.train_step()
    trainer.save()  # stopped after step 2, resumed below: step 3 to the bit, the reference's
    third = trainer.train_step()  # prompt read back as it started, not the trained one
    for name, param in model.named_parameters():
        assert torch.equal(param, start[name]) != (name == SOFT_PROMPT), name
    assert torch.equal(ref.soft_prompt.weight, start[SOFT_PROMPT])  # the reference stays
    resumed = Trainer(load_config([tmp_path / "dpo.yml"]))
    assert resumed.iteration == 2
    assert torch.equal(resumed.parts.reference.soft_prompt.weight, start[SOFT_PROMPT])
    assert resumed.train_step()["lm_loss"] == third["lm_loss"]
    assert torch.equal(resumed.model.soft_prompt.weight, model.soft_prompt.weight)

    # the loss on the prompted pairs by hand: chosen rows, then rejected, 60 text positions
    batch = stack([trainer.train_loader.samples[i] for i in range(2)])
    prep = trainer.step.gradients.objective.prepare(batch)
    model.zero_grad()
    logits = model(prep.inputs)
    with torch.no_grad():
        ref_logits = ref(prep.inputs)
    assert logits.shape[1] == ref_logits.shape[1] == 64 - 4
    mask, labels = prep.mask[:, :60].float(), prep.labels[:, :60]
    assert mask.sum(-1).min() > 0  # every answer is scored within the kept text

    def summed(out):
        s = (logp_of(out, labels) * mask).sum(-1)
        return s[:2], s[2:]

    (pc, pr), (rc, rr) = summed(logits), summed(ref_logits)
    by_hand = -F.logsigmoid(0.5 * ((pc - pr) - (rc - rr))).mean()
    terms = trainer.step.gradients.objective.terms(logits, prep, ref_logits)
    assert terms.loss.item() == pytest.approx(by_hand.item(), rel=1e-5, abs=1e-7)
    assert abs(by_hand.item() - math.log(2)) > 1e-4  # the trained prompt moved the margin
    terms.objective.backward()
    assert_only_trained(model, (SOFT_PROMPT,))


def prompted(value_head: bool = False):
    keys = {"pos_emb": "rotary", "seq_length": SEQ, "max_position_embeddings": SEQ}
    args = model_args(load_mapping(BASE | keys | {"soft_prompt_tuning": PROMPT}, "x"))
    model = build_model(dataclasses.replace(args, value_head=value_head)).eval()
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():  # the policy's prompt trained away from the reference's
        model.soft_prompt.weight.add_(0.1 * torch.randn_like(model.soft_prompt.weight))
    return model, reference


def test_kto_reads_rewards_and_log_ratios_on_the_kept_text():
    torch.manual_seed(0)
    model, reference = prompted()
    tokens = torch.randint(0, 100, (4, SEQ + 1))
    rewards = torch.tensor([0.5, -0.5, 0.5, -0.5])[:, None].expand(4, SEQ + 1).clone()
    kto = KTO(beta=0.5)
    prep = kto.prepare({"text": tokens, "reward": rewards})
    logits = model(prep.inputs)
    with torch.no_grad():
        ref_logits = reference(prep.inputs)
    terms = kto.terms(logits, prep, ref_logits)
    keep = SEQ - N
    labels = tokens[:, 1 : keep + 1]  # the kept text's next tokens
    ratio = (logp_of(logits, labels) - logp_of(ref_logits, labels)).sum(-1)
    r = rewards[:, 0]  # (each row's reward, the same at every kept position)
    kl1, kl2 = (ratio[:2].clamp(min=0).mean().detach(), ratio[2:].clamp(min=0).mean().detach())
    half1 = 1 - torch.sigmoid(0.5 * r[:2] * (ratio[:2] - kl2))
    half2 = 1 - torch.sigmoid(0.5 * r[2:] * (ratio[2:] - kl1))
    by_hand = (0.5 * half1 + 0.5 * half2).mean()
    assert terms.loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    terms.objective.backward()
    assert_only_trained(model, (SOFT_PROMPT,))


def test_a_reward_model_reads_the_value_at_its_labelled_kept_position():
    torch.manual_seed(1)
    model, _ = prompted(value_head=True)
    tokens = torch.randint(0, 100, (4, SEQ + 1))
    labels = torch.full_like(tokens, -100)
    at = [3, 5, 7, 6]  # each sample's one labelled token (label index t+1: position t)
    for row, t in enumerate(at):
        labels[row, t + 1] = tokens[row, t + 1]
    batch = {"pos": tokens[:2], "neg": tokens[2:], "pos_label": labels[:2], "neg_label": labels[2:]}
    rm = RewardModel()
    prep = rm.prepare(batch)
    values = model(prep.inputs)
    assert values.shape == (4, SEQ - N, 1)
    terms = rm.terms(values, prep)
    picked = values[torch.arange(4), torch.tensor(at), 0]
    assert terms.loss.item() == pytest.approx(-F.logsigmoid(picked[:2] - picked[2:]).mean().item())
    terms.objective.backward()
    assert_only_trained(model, (SOFT_PROMPT, VALUE_HEAD))  # the head trains beside the prompt
    labels[0, 4], labels[0, 11] = -100, tokens[0, 11]  # past the 8 positions kept
    with pytest.raises(DataError, match="n_tokens cut a sample's off"):
        rm.terms(values, rm.prepare(batch | {"pos_label": labels[:2]}))


def test_reinforce_scores_the_kept_completion_tokens():
    torch.manual_seed(2)
    model, reference = prompted()
    tokens = torch.randint(0, 100, (2, SEQ + 1))
    label = tokens.clone()
    label[:, :3] = -100  # the prompt's tokens
    old = torch.randn(2, SEQ)  # the sampling policy's, over every label position
    batch = {"text": tokens, "label": label, "old_logp": old}
    batch |= {"advantage": torch.tensor([1.0, -0.5]), "raw_reward": torch.tensor([1.0, 0.0])}
    policy = Reinforce(kl_impl="kl", beta=0.1, fp32=True, clip=0.2, eod_id=None, updates=2)
    prep = policy.prepare(batch)
    logits = model(prep.inputs)
    with torch.no_grad():
        ref_logits = reference(prep.inputs)
    terms = policy.terms(logits, prep, ref_logits)
    keep = SEQ - N
    mask = (label[:, 1 : keep + 1] >= 0).float()
    own = logp_of(logits, tokens[:, 1 : keep + 1])
    ratio = torch.exp(own - old[:, :keep])
    adv = batch["advantage"][:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    kl = own - logp_of(ref_logits, tokens[:, 1 : keep + 1])
    by_hand = (((pg + 0.1 * kl) * mask).sum(-1) / mask.sum()).mean()
    assert terms.loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    terms.objective.backward()
    assert_only_trained(model, (SOFT_PROMPT,))


@pytest.mark.parametrize("length", [SEQ, 5], ids=["whole", "a-curriculum-s-shorter-text"])
def test_context_parallel_layout_comes_back_to_the_kept_text(length):
    """before_text puts the prompt's placeholders first (what the context ranks split), and
    pads a shorter text's sequence (a curriculum's) to a multiple of 2 x cp; past_prompt, on
    the gathered outputs' side, gives the micro-batch text_kept gives."""
    tokens = torch.randint(0, 100, (2, length + 1))
    prep = shifted(tokens, None, None)
    prep.mask = torch.rand(2, length) > 0.3
    prep.rewards, prep.reference_logp = torch.randn(2, length), torch.randn(2, length)
    laid_out = before_text(prep, N, SEQ, multiple=8)
    text = min(length, SEQ - N)
    assert laid_out.text == text and laid_out.inputs.shape[1] % 8 == 0
    assert laid_out.inputs.shape[1] - N - text < 8 and not laid_out.mask[:, :N].any()
    assert not laid_out.mask[:, N + text :].any()  # the padding is out of the loss
    back = past_prompt(laid_out, N, laid_out.text)
    kept = text_kept(torch.zeros(2, text, 1), prep)
    for name in ("labels", "mask", "rewards", "reference_logp"):
        assert torch.equal(getattr(back, name), getattr(kept, name)), name
