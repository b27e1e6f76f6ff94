"""The trainer's components, each on its own: the checkpoint manager, the objective, the
gradient policy of the step, the evaluator's one loop, and MFU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers import build
from torchneox.base.errors import ConfigError, TrainingStopped
from torchneox.checkpoint.manager import CheckpointManager, TrainingState, save_iterations
from torchneox.data.loader import BatchLoader
from torchneox.models.moe import RouterStats, balancing_loss
from torchneox.optim.builder import load_optimizer_state
from torchneox.parallel.dims import ParallelDims
from torchneox.parallel.parallelize import ParallelModel
from torchneox.reporting.metrics import Throughput, Timers
from torchneox.train.evaluation import Evaluator, mean_loss
from torchneox.train.loss import lm_loss, lm_loss_and_z
from torchneox.train.objectives import LanguageModeling, Prepared
from torchneox.train.precision import LossScaler
from torchneox.train.step import GradientPolicy, Gradients, TrainStep, Update


def checkpoint_group(save, **keys) -> SimpleNamespace:
    ck = dict(
        save=str(save),
        checkpoint_factor=None,
        checkpoint_scale="linear",
        extra_save_iters=None,
        keep_last_n_checkpoints=None,
        no_save_optim=False,
        no_save_rng=False,
        no_load_optim=False,
        no_load_rng=False,
        finetune=False,
        async_checkpointing=False,
        async_checkpoint_writer="process",
        s3_path=None,
        s3_chunk_size=104_857_600,
    )
    return SimpleNamespace(**(ck | keys))


class Lines(list):
    def __call__(self, text: str) -> None:
        self.append(text)


def state(seed: int = 0) -> TrainingState:
    _, model = build("neox-rotary", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = [np.arange(17) + i for i in range(64)]
    loader = BatchLoader(samples, micro_batch=2, grad_accum=2, prefetch=False)
    return TrainingState(model, optimizer, LossScaler(), {"train": loader})


def step_once(s: TrainingState) -> None:
    tokens = torch.randint(0, 100, (2, 16))
    s.model(tokens).float().mean().backward()
    s.optimizer.step()
    s.optimizer.zero_grad()
    s.loaders["train"].next()


def test_the_manager_saves_resumes_and_rotates(tmp_path):
    lines = Lines()
    manager = CheckpointManager(
        checkpoint_group(tmp_path / "run", keep_last_n_checkpoints=2), 4, "{}\n", True, lines
    )
    assert manager.save_at == {4} and manager.last_good() == "no checkpoint was saved yet"
    saved = state()
    for iteration in (1, 2, 3):
        step_once(saved)
        manager.save(iteration, saved)
    kept = sorted(p.name for p in (tmp_path / "run").glob("global_step*"))
    assert kept == ["global_step2", "global_step3"]  # keep_last_n_checkpoints
    assert manager.last_good().endswith("run/global_step3")
    fresh = state(seed=1)
    resumed = manager.resume(manager.find(tmp_path / "run", None), fresh)
    assert resumed.iteration == 3 and resumed.training_state
    assert fresh.loaders["train"].consumed == saved.loaders["train"].consumed == 12
    for a, b in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    moments = [fresh.optimizer.state[p]["exp_avg"] for p in fresh.model.parameters()]
    assert all(
        torch.equal(m, saved.optimizer.state[p]["exp_avg"])
        for m, p in zip(moments, saved.model.parameters(), strict=True)
    )


def test_finetune_takes_the_weights_only(tmp_path):
    first = CheckpointManager(checkpoint_group(tmp_path / "run"), 4, "{}\n", True, Lines())
    saved = state()
    step_once(saved)
    first.save(1, saved)
    lines = Lines()
    tuned = CheckpointManager(
        checkpoint_group(tmp_path / "run", finetune=True), 4, "{}\n", True, lines
    )
    fresh = state(seed=1)
    resumed = tuned.resume(tuned.find(tmp_path / "run", None), fresh)
    assert resumed.iteration == 0 and not resumed.training_state
    assert not fresh.optimizer.state and fresh.loaders["train"].consumed == 0
    assert "finetune is set" in lines[-1]


def test_nothing_to_resume_says_so(tmp_path):
    lines = Lines()
    manager = CheckpointManager(checkpoint_group(tmp_path / "run"), 4, "{}\n", True, lines)
    assert manager.find(tmp_path / "empty", None) is None
    assert lines == [f"no checkpoint in {tmp_path / 'empty'}: starting from scratch"]
    with pytest.raises(ConfigError, match=r"load: .*empty holds no checkpoint, and train_impl dpo"):
        manager.find(tmp_path / "empty", None, "train_impl dpo")  # a post-training run
    assert len(lines) == 1


def test_a_load_naming_one_step_directory_loads_it(tmp_path):
    """It used to find no 'latest' inside it and start from scratch."""
    saved = state()
    CheckpointManager(checkpoint_group(tmp_path / "run"), 4, "{}\n", True, Lines()).save(1, saved)
    lines = Lines()
    manager = CheckpointManager(checkpoint_group(tmp_path / "b"), 4, "{}\n", True, lines)
    step = tmp_path / "run" / "global_step1"
    assert manager.find(step, None) == step and lines == []


def test_save_steps_are_gpt_neox_s():
    ck = checkpoint_group("x", checkpoint_factor=10, extra_save_iters=[0, 3])
    assert save_iterations(ck, 35) == {0, 3, 10, 20, 30, 35}


def test_the_objective_adds_z_loss_and_the_balancing_loss():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    prep = Prepared(labels, labels, None)
    plain = LanguageModeling().terms(logits, prep)
    assert torch.equal(plain.loss, lm_loss(logits, labels, None)) and plain.objective is plain.loss
    loss, z = lm_loss_and_z(logits, labels, None)
    stats = [RouterStats(torch.tensor([3, 1]), torch.tensor([2.5, 1.5]), 4, 1)]
    both = LanguageModeling(z_weight=0.1, aux_weight=0.01).terms(logits, prep, None, stats)
    want = loss + 0.1 * z + 0.01 * balancing_loss(stats[0])
    assert torch.allclose(both.objective, want) and torch.equal(both.z_loss, z.detach())
    # E x sum_e share_e x mean prob_e = 2 x (3/4 x 2.5/4 + 1/4 x 1.5/4)
    assert balancing_loss(stats[0]).item() == pytest.approx(2 * (0.75 * 0.625 + 0.25 * 0.375))


def one_process_step(model: torch.nn.Module, limit: int, lines: Lines) -> TrainStep:
    dims = ParallelDims(dp=1, tp=1, pp=1, world_size=1, device_type="cpu")
    scaler = LossScaler()
    gradients = Gradients(
        ParallelModel(model, model),
        LanguageModeling(),
        dims,
        torch.device("cpu"),
        "fp32",
        1,
        Timers(False),
        lambda: scaler.scale,
    )
    update = Update(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler,
        GradientPolicy(clip=1.0, skip_nonfinite_steps=limit),
        "fp32",
        None,
        lines,
        lambda: "the last good checkpoint is X",
    )
    return TrainStep(gradients, update)


def test_the_step_clips_and_skips_then_stops_on_non_finite_gradients():
    _, model = build("neox-rotary")
    lines = Lines()
    step = one_process_step(model, limit=1, lines=lines)
    tokens = torch.randint(0, 100, (2, 17))
    out = step(1, 0.1, [tokens])
    assert math.isfinite(out["lm_loss"]) and out["skipped"] == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    poisoned = next(model.parameters())
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        poisoned.grad.fill_(float("nan"))
        if _ == 0:
            norm, skipped = step.update.apply_gradients(2, None)
            assert skipped and math.isnan(norm)
            assert (
                lines[-1]
                == "step 2: the gradient norm is nan; step skipped (1 of 1 allowed by skip_nonfinite_steps)"
            )
        else:
            with pytest.raises(TrainingStopped) as stopped:
                step.update.apply_gradients(3, None)
            assert "step 3: the gradient norm is nan (the 1 skips allowed" in str(stopped.value)
            assert "the last good checkpoint is X" in str(stopped.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_step_clips_to_the_policy():
    _, model = build("neox-rotary")
    step = one_process_step(model, limit=0, lines=Lines())
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    norm, skipped = step.update.apply_gradients(1, None)
    total = math.sqrt(sum(9.0 * p.numel() for p in model.parameters()))
    assert norm == pytest.approx(total, rel=1e-5) and not skipped


def test_one_loop_gives_the_mean_of_every_batch_and_restores_train_mode():
    model = torch.nn.Linear(2, 2)
    seen = []

    def losses_of(batch):
        seen.append(model.training)
        return [torch.tensor(float(x)) for x in batch]

    assert mean_loss(model, [[1, 2], [3], [6]], losses_of).item() == pytest.approx(3.0)
    assert seen == [False, False, False] and model.training
    assert mean_loss(model, [], losses_of) is None


def test_the_evaluator_stops_at_the_last_whole_batch():
    samples = [np.arange(5)] * 10
    loader = BatchLoader(samples, micro_batch=2, grad_accum=2, prefetch=False)
    logger = SimpleNamespace(lines=[], rows=[])
    logger.line, logger.record = logger.lines.append, logger.rows.append
    ev = Evaluator(
        torch.nn.Linear(1, 1), 5, lambda mb: [t.float().mean() for t in mb], lambda v: v, logger
    )
    row = ev.split_row("valid", loader, 7)
    assert row == {"iteration": 7, "valid_lm_loss": 2.0, "valid_ppl": pytest.approx(math.exp(2.0))}
    assert loader.consumed == 8  # two global batches of four; the last two samples are left
    assert ev.split_row("valid", loader, 8) is None
    assert logger.lines[-1] == "valid: no whole batch left in the valid split; not evaluated"


def test_mfu_is_tflops_over_the_given_peak():
    t = Throughput(100.0, torch.device("cpu"), "fp32", 6e9, 2, Lines())
    got = t.measure(tokens_per_step=10_000, seconds=2.0)
    assert got["tokens_per_sec"] == 5000.0
    assert got["tflops"] == pytest.approx(6e9 * 5000 / 2 / 1e12)
    assert got["mfu"] == pytest.approx(got["tflops"] / 100.0)
    assert t.peak_source == "peak_theoretical_tflops 100"


def test_a_loaded_optimizer_state_keeps_this_runs_kernels():
    """A tensor-parallel run saves AdamW groups without foreach; resumed in one process, the
    update stays fused (the run's own choice), with the saved moments."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _, model = build("neox-rotary")
    saved = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    model(torch.randint(0, 100, (2, 8))).float().pow(2).mean().backward()
    saved.step()
    state = get_optimizer_state_dict(model, saved)
    resumed = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    load_optimizer_state(model, resumed, state)
    assert all(g["fused"] and not g["foreach"] for g in resumed.param_groups)
    first = next(iter(model.parameters()))
    assert torch.equal(resumed.state[first]["exp_avg"], saved.state[first]["exp_avg"])
