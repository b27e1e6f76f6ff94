"""curriculum_learning: DeepSpeed's sequence-length curriculum, its lengths per step against
the formula computed by hand, a run that trains on only that many tokens, and exact resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import losses, metric_rows
from torchneox.config.features.curriculum import curriculum
from torchneox.config.load import load_config
from torchneox.train.trainer import Trainer


def spec(kind: str, low: int, high: int, **schedule) -> dict:
    return {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": low,
        "max_difficulty": high,
        "schedule_type": kind,
        "schedule_config": schedule,
    }


def lengths(make_config, value: dict, steps) -> list[int]:
    cur = curriculum(load_config([make_config(curriculum_learning=value)]).config)
    assert cur is not None
    return [cur.length(k) for k in steps]


def test_fixed_linear_lengths(make_config):
    # floor(k/10 x (32 - 8) + 8) down to a multiple of 8: k=1 10.4 -> 8, k=3 15.2 -> 8,
    # k=4 17.6 -> 16, k=6 22.4 -> 16, k=7 24.8 -> 24, k=10 32, k=11 34.4 -> 32 (the cap)
    value = spec("fixed_linear", 8, 32, total_curriculum_step=10, difficulty_step=8)
    assert lengths(make_config, value, [1, 3, 4, 6, 7, 10, 11]) == [8, 8, 16, 16, 24, 32, 32]


def test_fixed_root_lengths(make_config):
    # floor(sqrt(k/100) x 1984 + 64) down to a multiple of 8: k=1 262.4 -> 256,
    # k=7 588.9 -> 584, k=25 1056, k=50 1466.9 -> 1464, k=100 2048, k=400 4032 -> 2048
    value = spec(
        "fixed_root", 64, 2048, total_curriculum_step=100, difficulty_step=8, root_degree=2
    )
    steps = [1, 7, 25, 50, 100, 400]
    assert lengths(make_config, value, steps) == [256, 584, 1056, 1464, 2048, 2048]


def test_fixed_discrete_lengths(make_config):
    value = spec("fixed_discrete", 8, 32, difficulty=[8, 16, 32], max_step=[2, 5])
    assert lengths(make_config, value, range(1, 8)) == [8, 8, 16, 16, 16, 32, 32]
    # DeepSpeed updates no more once the length reached max_difficulty: a list that comes
    # back down stays at the top
    value = spec("fixed_discrete", 8, 32, difficulty=[8, 32, 16], max_step=[2, 4])
    assert lengths(make_config, value, range(1, 8)) == [8, 8, 32, 32, 32, 32, 32]


DISCRETE = spec("fixed_discrete", 8, 32, difficulty=[8, 16, 32], max_step=[2, 4])


def test_a_run_trains_on_the_scheduled_length_only(make_config, tmp_path):
    cfg = make_config(curriculum_learning=DISCRETE, cpu_matmul="default", load=None)
    trainer = Trainer(load_config([cfg]), device="cpu")
    # step 1's loss, by hand: the untrained model on the first 8 inputs of the first batch
    batch = torch.stack([torch.from_numpy(trainer.train_loader.samples[i]) for i in range(4)])
    with torch.no_grad():
        logits = trainer.model(batch[:, :8])
        by_hand = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:9].flatten()).item()
        whole = trainer.model(batch[:, :-1])
        full = F.cross_entropy(whole.flatten(0, 1).float(), batch[:, 1:].flatten()).item()
    trainer.run()
    rows = [r for r in metric_rows(tmp_path / "run") if "lm_loss" in r]
    assert [r["curriculum_seqlen"] for r in rows] == [8, 8, 16, 16, 32, 32]
    assert rows[0]["lm_loss"] == pytest.approx(by_hand, rel=1e-5)
    assert abs(by_hand - full) > 1e-3  # (the whole samples would give another loss)


def test_resume_mid_curriculum_is_bitwise(make_config, tmp_path):
    keys = {"curriculum_learning": DISCRETE, "cpu_matmul": "default", "train_iters": 6}
    whole = make_config("w.yml", save=str(tmp_path / "w"), load=str(tmp_path / "w"), **keys)
    Trainer(load_config([whole]), device="cpu").run()
    cfg = make_config(
        "s.yml", save=str(tmp_path / "s"), load=str(tmp_path / "s"), exit_interval=3, **keys
    )
    assert Trainer(load_config([cfg]), device="cpu").run() is not None
    Trainer(load_config([cfg]), device="cpu").run()
    lw, ls = losses(tmp_path / "w"), losses(tmp_path / "s")
    assert {k: lw[k] for k in range(4, 7)} == {k: ls[k] for k in range(4, 7)}
    seqlen = losses(tmp_path / "s", "curriculum_seqlen")
    assert [seqlen[k] for k in range(4, 7)] == [16, 32, 32]


def test_tokens_per_second_counts_the_tokens_trained(make_config, monkeypatch):
    cfg = make_config(curriculum_learning=DISCRETE, cpu_matmul="default", load=None)
    tokens = []
    real = Trainer.step_row

    def recording(self, out, seconds, step_tokens):
        tokens.append(step_tokens)
        return real(self, out, seconds, step_tokens)

    monkeypatch.setattr(Trainer, "step_row", recording)
    Trainer(load_config([cfg]), device="cpu").run()
    assert tokens == [4 * n for n in (8, 8, 16, 16, 32, 32)]  # micro-batch 4 x the length


def test_dpo_cuts_both_sides_of_a_pair_to_the_length(tmp_path):
    """Under DPO each row is cut to the step's length, chosen and rejected alike: step 1's
    loss (reference-free) is the hand computation on the pairs' first 16 inputs."""
    import json

    from tests.helpers import post_training_data
    from torchneox.data.loader import stack
    from torchneox.train.batch import cut

    values = post_training_data(tmp_path, only=("dpo",))["dpo"] | {
        "num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 64,
        "max_position_embeddings": 64, "train_micro_batch_size_per_gpu": 2, "train_iters": 1,
        "num_workers": 0, "eval_interval": 100, "eval_iters": 0, "precision": "fp32",
        "make_vocab_size_divisible_by": 64, "dpo_beta": 0.5, "dpo_reference_free": True,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "curriculum_learning": spec("fixed_discrete", 16, 64, difficulty=[16, 64], max_step=[1]),
    }  # fmt: skip
    (tmp_path / "dpo.yml").write_text(json.dumps(values))
    trainer = Trainer(load_config([tmp_path / "dpo.yml"]), device="cpu")
    objective = trainer.step.gradients.objective
    batch = stack([trainer.train_loader.samples[i] for i in range(2)])

    def by_hand(rows) -> float:
        prep = objective.prepare(rows)
        with torch.no_grad():
            logp = F.log_softmax(trainer.model(prep.inputs).float(), -1)
        picked = logp.gather(-1, prep.labels[..., None]).squeeze(-1) * prep.mask
        summed = picked.sum(-1)
        return -F.logsigmoid(0.5 * (summed[:2] - summed[2:])).mean().item()

    short, whole = by_hand(cut(batch, 16)), by_hand(batch)
    assert cut(batch, 16)["pos"].shape[1] == 17 and cut(batch, 16)["neg_label"].shape[1] == 17
    first = trainer.train_step()
    assert first["lm_loss"] == pytest.approx(short, rel=1e-5)
    assert abs(short - whole) > 1e-4  # (the whole pairs would give another loss)
