"""A training step reads nothing back to the host between log rows (fused AdamW outside fp16):
a non-finite step is skipped on the device, and counted, reported or stopped on when the steps
are settled, at the log interval or before a save."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import metric_rows, poison
from torchneox.base.errors import TrainingStopped
from torchneox.config.load import load_config
from torchneox.train.trainer import Trainer

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def counted_reads(monkeypatch):
    """Every read of a tensor's value by Python (item, tolist, bool(), float(), ...)."""
    calls: list[str] = []
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    yield calls
    monkeypatch.undo()


def adam_trainer(make_config, tmp_path, **keys):
    cfg = make_config(**{"log_interval": 3, "save": str(tmp_path / "r"), "load": None} | keys)
    return Trainer(load_config([cfg]), device="cpu")


def test_steps_between_log_rows_read_nothing_back(make_config, tmp_path, monkeypatch):
    trainer = adam_trainer(make_config, tmp_path)
    assert trainer.step.update.deferred  # fused AdamW in fp32
    trainer.train_step()  # the first step builds state (and may read the data's shape)
    trainer.train_step()
    with counted_reads(monkeypatch) as calls:
        trainer.train_step()  # step 3: settles steps 1 to 3 in one read
        settled = list(calls)
        calls.clear()
        out = trainer.train_step()
        out2 = trainer.train_step()
        between = list(calls)
        loss = out["lm_loss"]  # reading a value settles the pending steps
        read = list(calls)
    assert between == []
    assert settled and read
    assert isinstance(loss, float) and out2["grad_norm"] > 0
    assert trainer.step.update.pending == []


def test_a_deferred_non_finite_step_is_skipped_then_counted(make_config, tmp_path):
    trainer = adam_trainer(make_config, tmp_path, skip_nonfinite_steps=1, train_iters=6)
    lines: list[str] = []
    trainer.step.update.line = lines.append
    poison(trainer, 2, float("nan"))
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step()  # step 2: NaN loss, skipped by the fused update, not yet reported
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True))
    assert trainer.scaler.skipped == 0 and lines == []
    trainer.train_step()  # step 3: the log interval settles 1-3
    assert trainer.scaler.skipped == 1
    assert lines == [
        "step 2: the loss is nan; step skipped (1 of 1 allowed by skip_nonfinite_steps)"
    ]
    assert torch.optim.AdamW is type(trainer.optimizer)
    steps = {int(s["step"].item()) for s in trainer.optimizer.state.values()}
    assert steps == {2}  # Adam's own step count left out the skipped step


def test_the_run_stops_at_a_save_before_keeping_an_unchecked_step(make_config, tmp_path):
    trainer = adam_trainer(
        make_config, tmp_path, train_iters=8, log_interval=5, checkpoint_factor=3
    )
    poison(trainer, 2, float("nan"))
    with pytest.raises(TrainingStopped, match=r"step 2: the loss is nan .*stopping"):
        trainer.run()
    assert not (tmp_path / "r" / "global_step3").exists()
    assert trainer.iteration == 3


def test_logged_rows_are_those_of_a_step_by_step_run(make_config, tmp_path):
    rows = {}
    for every in (1, 3):
        folder = tmp_path / f"log{every}"
        cfg = make_config(train_iters=6, log_interval=every, save=str(folder), load=None)
        Trainer(load_config([cfg]), device="cpu").run()
        rows[every] = {r["iteration"]: r for r in metric_rows(folder) if "lm_loss" in r}
    assert set(rows[3]) == {3, 6}
    for it, row in rows[3].items():
        for key in ("lm_loss", "grad_norm", "lr", "skipped_steps"):
            assert row[key] == rows[1][it][key]
