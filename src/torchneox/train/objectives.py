"""What a batch's loss is: one objective per ``train_impl``, each given to the trainer as a
component (the loop calls ``prepare``, the model, and ``terms``; it knows no objective).

- ``LanguageModeling`` (normal): GPT-NeoX's mean next-token cross-entropy over the positions
  that count: all, or with label datasets (SFT) those whose label is >= 0, without the
  positions after an end-of-document token under ``eod_mask_loss``; plus PaLM's z-loss
  (``lm_z_loss``) and the MoE routers' load-balancing loss (``moe_aux_loss_coeff``); with
  multi-token prediction (``mtp_num_layers``), lambda / D x each depth's loss, each logged.
- ``DPO`` (dpo): ``-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))``, the summed
  log-probabilities of the chosen and rejected answers under the policy and a frozen reference.
- ``KTO`` (kto): the batch's two halves, each half's KL estimate the other's reference point.
- ``Reinforce`` (reinforce): GPT-NeoX's online REINFORCE on rollouts (train/rl/reinforce.py).
- ``RewardModel`` (rm): Bradley-Terry, ``-logsigmoid(v_chosen - v_rejected)`` on the value at
  each sample's one labelled position, plus ``z_loss`` times the squared values.

Every formula and logged metric is GPT-NeoX's (megatron/training.py ``forward_step``); the
metrics are micro-batch means, averaged as lm_loss is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from torchneox.base.errors import DataError
from torchneox.models.moe import RouterStats, balancing_loss
from torchneox.models.mtp import ahead
from torchneox.parallel.collectives import plain
from torchneox.train.batch import Prepared, Terms, shifted, text_kept
from torchneox.train.loss import lm_loss, lm_loss_and_z, token_logp
from torchneox.train.rl.reinforce import Reinforce


def _pair(batch: dict[str, torch.Tensor], eod_id: int | None) -> Prepared:
    """Chosen then rejected samples, one micro-batch of 2 x mb rows (as GPT-NeoX concatenates
    them); the mask is all ones where there are no label datasets."""
    pos = shifted(batch["pos"], batch.get("pos_label"), eod_id, zero_masked=True)
    neg = shifted(batch["neg"], batch.get("neg_label"), eod_id, zero_masked=True)
    ones = torch.ones_like(pos.inputs, dtype=torch.bool)
    mask = torch.cat(
        [ones if pos.mask is None else pos.mask, ones if neg.mask is None else neg.mask]
    )
    out = Prepared(torch.cat([pos.inputs, neg.inputs]), torch.cat([pos.labels, neg.labels]), mask)
    if "pos_ref" in batch:  # a position's value is the log-probability of the next token
        out.reference_logp = torch.cat([batch["pos_ref"], batch["neg_ref"]])[:, :-1].float()
    return out


@dataclass
class LanguageModeling:
    eod_id: int | None = None  # eod_mask_loss: the end-of-document token, else None
    z_weight: float = 0.0  # lm_z_loss
    aux_weight: float = 0.0  # moe_aux_loss_coeff
    mtp_depth: int = 0  # mtp_num_layers
    mtp_weight: float = 0.0  # mtp_loss_scaling_factor
    needs_reference = False

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(f"mtp_loss_{k}" for k in range(1, self.mtp_depth + 1))

    def prepare(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> Prepared:
        if isinstance(batch, dict):
            return shifted(batch["text"], batch.get("label"), self.eod_id)
        return shifted(batch, None, self.eod_id)

    def terms(
        self,
        logits: torch.Tensor,
        prep: Prepared,
        reference: torch.Tensor | None = None,
        router_stats: list[RouterStats] | None = None,
        placed=None,
    ) -> Terms:
        """``router_stats``: every MoE layer's statistics over the whole batch (summed over the
        ranks that split it); ``placed(term, like)`` puts a term beside a distributed loss."""
        # context parallel: each rank's loss is its tokens' share of the micro-batch's, and its
        # gradient counts ``context_ranks`` times (the reduction averages over those ranks too)
        share, total = prep.context_ranks, prep.counted
        depths = None
        if isinstance(logits, tuple):  # multi-token prediction: each depth's logits too
            logits, *depths = logits
        prep = text_kept(logits, prep)
        if self.z_weight:
            loss, z = lm_loss_and_z(logits, prep.labels, prep.mask, total=total)
            out = Terms(loss, loss + self.z_weight * z, z_loss=plain(z.detach()))
        else:
            loss = lm_loss(logits, prep.labels, prep.mask, total=total)
            out = Terms(loss, loss)
        if depths:
            self._add_mtp(out, depths, prep, placed)
        if share > 1:
            out.objective = out.objective * share
        if router_stats:
            aux = torch.stack([balancing_loss(s) for s in router_stats]).mean()
            weighted = self.aux_weight * aux
            out.objective = out.objective + (placed(weighted, loss) if placed else weighted)
            out.moe_aux_loss = aux.detach().float() / share  # every rank has the whole value
        return out

    def _add_mtp(self, out: Terms, depths: list[torch.Tensor], prep: Prepared, placed) -> None:
        """Depth k's logits at t score the label at t + k, under the loss mask moved alike (the
        last k positions count for nothing); the objective adds lambda / D x their sum (put
        beside a distributed loss by ``placed``: tensor parallelism's vocabulary split)."""
        whole = prep.whole or prep  # context parallelism: the labels ahead may be another rank's
        mask = whole.mask if whole.mask is not None else torch.ones_like(whole.labels).bool()
        index = prep.context.index if prep.whole is not None else slice(None)
        losses = []
        for k, logits_k in enumerate(depths, start=1):
            labels_k, mask_k = ahead(whole.labels, k), ahead(mask, k)
            # (a context rank's loss: its tokens' share of the micro-batch's, as the main one)
            total = mask_k.sum().float() if prep.whole is not None else None
            loss_k = lm_loss(logits_k, labels_k[:, index], mask_k[:, index], total=total)
            out.metrics[f"mtp_loss_{k}"] = plain(loss_k.detach()).float()
            losses.append(loss_k)
        weighted = sum(losses[1:], losses[0]) * (self.mtp_weight / len(depths))
        out.objective = out.objective + (placed(weighted, out.objective) if placed else weighted)


def _summed(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected rows' log-probabilities summed over their masked positions."""
    pos, neg = torch.chunk(logp * mask, 2, 0)
    return pos.sum(-1), neg.sum(-1)


class _Pairs:
    """Objectives of chosen and rejected pairs (DPO, reward models): one micro-batch of the
    chosen rows, then the rejected ones."""

    eod_id: int | None

    def prepare(self, batch: dict[str, torch.Tensor]) -> Prepared:
        return _pair(batch, self.eod_id)


@dataclass
class DPO(_Pairs):
    beta: float = 0.1  # dpo_beta
    reference_free: bool = False  # dpo_reference_free: the reference's log-probabilities are 0
    fp32: bool = True  # dpo_fp32
    eod_id: int | None = None

    precomputed: bool = False  # precompute_model_name: the reference's log-probabilities are read

    @property
    def needs_reference(self) -> bool:
        return not (self.reference_free or self.precomputed)

    @property
    def metric_names(self) -> tuple[str, ...]:
        if self.reference_free:
            return ("chosen_neg", "chosen_pos")
        return ("ref_neg", "ref_pos", "chosen_neg", "chosen_pos", "chosen_rewards",
                "rejected_rewards", "reward_acc", "margins")  # fmt: skip

    def terms(
        self,
        logits: torch.Tensor,
        prep: Prepared,
        reference: torch.Tensor | None = None,
        router_stats: Any = None,
        placed: Any = None,
    ) -> Terms:
        assert prep.mask is not None
        prep = text_kept(logits, prep)  # (a soft prompt's model scores the text it kept)
        mask = prep.mask.float()
        chosen_pos, chosen_neg = _summed(token_logp(logits, prep.labels, self.fp32), mask)
        m: dict[str, torch.Tensor] = {}
        if self.reference_free:
            ref_pos = ref_neg = torch.zeros_like(chosen_pos)
        else:
            with torch.no_grad():
                ref = prep.reference_logp
                if ref is None:
                    assert reference is not None
                    ref = token_logp(reference, prep.labels, self.fp32)
                ref_pos, ref_neg = _summed(ref, mask)
            m["ref_neg"], m["ref_pos"] = ref_neg.mean(), ref_pos.mean()
        m["chosen_neg"], m["chosen_pos"] = chosen_neg.detach().mean(), chosen_pos.detach().mean()
        if not self.reference_free:
            chosen_rewards = self.beta * (chosen_pos.detach() - ref_pos)
            rejected_rewards = self.beta * (chosen_neg.detach() - ref_neg)
            m["chosen_rewards"] = chosen_rewards.mean()
            m["rejected_rewards"] = rejected_rewards.mean()
            m["reward_acc"] = (chosen_rewards > rejected_rewards).float().mean()
            m["margins"] = (chosen_rewards - rejected_rewards).mean()
        margin = (chosen_pos - chosen_neg) - (ref_pos - ref_neg)
        loss = -F.logsigmoid(self.beta * margin).mean()
        return Terms(loss, loss, metrics=m)


@dataclass
class KTO:
    beta: float = 0.1  # kto_beta
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    fp32: bool = True  # kto_fp32
    eod_id: int | None = None
    precomputed: bool = False  # precompute_model_name: the reference's log-probabilities are read

    metric_names = ("ref_logp", "policy_logp", "pos_ref_logp", "neg_ref_logp",
                    "pos_policy_logp", "neg_policy_logp", "kl", "reward_acc",
                    "policy_rewards")  # fmt: skip

    @property
    def needs_reference(self) -> bool:
        return not self.precomputed

    def prepare(self, batch: dict[str, torch.Tensor]) -> Prepared:
        prep = shifted(batch["text"], batch.get("label"), self.eod_id)
        if prep.mask is None:
            prep.mask = torch.ones_like(prep.inputs, dtype=torch.bool)
        # the reward of a prediction is the one of the token predicted: without the last
        prep.rewards = batch["reward"][:, :-1].float()
        if "ref" in batch:
            prep.reference_logp = batch["ref"][:, :-1].float()
        return prep

    def terms(
        self,
        logits: torch.Tensor,
        prep: Prepared,
        reference: torch.Tensor | None = None,
        router_stats: Any = None,
        placed: Any = None,
    ) -> Terms:
        assert prep.mask is not None and prep.rewards is not None
        prep = text_kept(logits, prep)
        mask, rewards = prep.mask.float(), prep.rewards
        with torch.no_grad():
            ref = prep.reference_logp
            if ref is None:
                assert reference is not None
                ref = token_logp(reference, prep.labels, self.fp32)
            ref = ref * mask
            total = rewards.sum(-1)
            scaling = (total > 0.001).float() * self.desirable_weight
            scaling = scaling + (total < -0.001).float() * self.undesirable_weight
        policy = token_logp(logits, prep.labels, self.fp32) * mask
        m = _kto_metrics(policy.detach(), ref, rewards, mask, self.beta)
        pol1, pol2 = torch.chunk(policy, 2, 0)
        ref1, ref2 = torch.chunk(ref, 2, 0)
        r1, r2 = torch.chunk(rewards, 2, 0)
        s1, s2 = torch.chunk(scaling, 2, 0)
        kl1 = torch.clamp((pol1 - ref1).sum(-1), min=0).mean().detach()
        kl2 = torch.clamp((pol2 - ref2).sum(-1), min=0).mean().detach()
        # as GPT-NeoX: r is the reward averaged over every position of the row, padding too
        half1 = 1 - torch.sigmoid(self.beta * r1.mean(-1) * ((pol1 - ref1).sum(-1) - kl2))
        half2 = 1 - torch.sigmoid(self.beta * r2.mean(-1) * ((pol2 - ref2).sum(-1) - kl1))
        loss = (0.5 * s1.mean(-1) * half1 + 0.5 * s2.mean(-1) * half2).mean()
        return Terms(loss, loss, metrics=m)


def _kto_metrics(
    policy: torch.Tensor, ref: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, beta: float
) -> dict[str, torch.Tensor]:
    pos, neg = (rewards > 0.001).float(), (rewards < -0.001).float()
    policy_rewards = beta * rewards * (policy - ref)
    return {
        "ref_logp": ref.sum(-1).mean(),
        "policy_logp": policy.sum(-1).mean(),
        "pos_ref_logp": (ref * pos).sum(-1).mean(),
        "neg_ref_logp": (ref * neg).sum(-1).mean(),
        "pos_policy_logp": (policy * pos).sum(-1).mean(),
        "neg_policy_logp": (policy * neg).sum(-1).mean(),
        "kl": (policy - ref).sum() / mask.sum().clamp(min=1),  # (0, not NaN, if all masked)
        "reward_acc": (policy_rewards.sum(-1) > 0.0).float().mean(),
        "policy_rewards": policy_rewards.sum(),
    }


@dataclass
class RewardModel(_Pairs):
    z_weight: float = 0.0  # z_loss: weight of the squared values
    eod_id: int | None = None
    needs_reference = False
    metric_names = ("pos_values", "neg_values", "margin", "accuracy")

    def terms(
        self,
        values: torch.Tensor,
        prep: Prepared,
        reference: torch.Tensor | None = None,
        router_stats: Any = None,
        placed: Any = None,
    ) -> Terms:
        assert prep.mask is not None
        whole = prep.mask.sum(-1)
        prep = text_kept(values, prep)
        counts = prep.mask.sum(-1)
        if not bool((counts == 1).all()):
            n = int(counts[counts != 1][0])
            if bool((whole == 1).all()):  # a soft prompt's cut took the labelled position
                raise DataError(
                    "train_impl rm reads each sample's value at its one labelled position, but "
                    "soft_prompt_tuning's n_tokens cut a sample's off (the model keeps "
                    "seq_length - n_tokens tokens); shorten the samples or the prompt"
                )
            raise DataError(
                f"train_impl rm reads each sample's value at its one labelled position, but a "
                f"sample has {n}; preprocess the pairs with --chat --for-rm"
            )
        where = prep.mask.float().argmax(-1, keepdim=True)
        picked = values.float().squeeze(-1).gather(1, where)  # [2 x mb, 1]
        pos, neg = torch.chunk(picked, 2, 0)
        with torch.no_grad():
            m = {
                "pos_values": pos.mean(),
                "neg_values": neg.mean(),
                "margin": (pos - neg).mean(),
                "accuracy": ((pos - neg) > 0).float().mean(),
            }
        loss = -F.logsigmoid(pos - neg).mean() + (self.z_weight * (pos**2 + neg**2)).mean()
        return Terms(loss, loss, metrics={k: v.detach() for k, v in m.items()})


Objective = LanguageModeling | DPO | KTO | RewardModel | Reinforce


@dataclass
class DocumentMasked:
    """inter_document_attention_masking around any objective: each prepared micro-batch also
    carries its tokens' documents and their positions within them, for the model."""

    inner: Any
    eod_id: int

    def prepare(self, batch: Any) -> Prepared:
        from torchneox.models.mixers.attention import documents

        prep = self.inner.prepare(batch)
        prep.positions, prep.segments = documents(prep.inputs, self.eod_id)
        return prep

    def __getattr__(self, name: str) -> Any:  # terms, needs_reference, metric_names, ...
        return getattr(self.inner, name)


def build_objective(
    training: Any,
    moe_aux_loss_coeff: float,
    eod_id: int | None,
    precomputed: bool = False,
    document_eod: int | None = None,
    rollout: Any = None,
) -> Objective:
    """The objective of ``training.train_impl`` from the training config group (``eod_id``:
    the end-of-document token when eod_mask_loss is set; ``precomputed``: the reference's
    log-probabilities come with the data; ``document_eod``: the end-of-document token when
    inter_document_attention_masking is set; ``rollout``: the rollout group, for reinforce)."""
    objective = _objective(training, moe_aux_loss_coeff, eod_id, precomputed, rollout)
    return objective if document_eod is None else DocumentMasked(objective, document_eod)


def objective_for(cfg: Any, eod_id: int | None) -> Objective:
    """The objective a config trains (``eod_id``: the tokenizer's end-of-document token, used
    where eod_mask_loss or inter_document_attention_masking asks for it)."""
    t = cfg.training
    eod = eod_id if t.eod_mask_loss else None
    documents = eod_id if cfg.model.inter_document_attention_masking else None
    precomputed = bool(cfg.textgen.precompute_model_name)
    moe = cfg.moe.moe_aux_loss_coeff
    objective = build_objective(t, moe, eod, precomputed, documents, cfg.rollout)
    lm = getattr(objective, "inner", objective)
    if isinstance(lm, LanguageModeling):  # (the checks refuse mtp_num_layers elsewhere)
        lm.mtp_depth, lm.mtp_weight = cfg.model.mtp_num_layers, cfg.model.mtp_loss_scaling_factor
    return objective


def _objective(
    training: Any, moe_aux_loss_coeff: float, eod_id: int | None, precomputed: bool, rollout: Any
) -> Objective:
    t = training
    if t.train_impl == "dpo":
        return DPO(t.dpo_beta, t.dpo_reference_free, t.dpo_fp32, eod_id, precomputed)
    if t.train_impl == "kto":
        weights = (t.kto_desirable_weight, t.kto_undesirable_weight)
        return KTO(t.kto_beta, *weights, t.kto_fp32, eod_id, precomputed)
    if t.train_impl == "rm":
        return RewardModel(t.z_loss, eod_id)
    if t.train_impl == "reinforce":
        return Reinforce.from_config(rollout, eod_id)
    return LanguageModeling(eod_id, t.lm_z_loss, moe_aux_loss_coeff)
