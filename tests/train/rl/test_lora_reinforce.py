"""Online RL (REINFORCE) with LoRA adapters: the KL reference is the policy with its adapters
left out (no second model): 0 at the first step, then the adapters move the policy away from
it; the base stays as it was drawn."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import metric_rows
from tests.train.rl.test_reinforce_run import EXAMPLE, tiny
from torchneox.cli import main
from torchneox.models.params import is_adapter
from torchneox.models.transformer import build_model
from torchneox.train.trainer import Trainer

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def test_reinforce_with_lora_takes_the_base_as_its_reference(tmp_path):
    kept = []
    original = Trainer.run

    def keep(self):
        out = original(self)
        kept.append((self, {k: v.detach().clone() for k, v in self.model.state_dict().items()}))
        return out

    args = ["train", str(EXAMPLE)]
    for s in [*tiny(lora=LORA), f"save={tmp_path / 'run'}"]:
        args += ["--set", s]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "run", keep)
        assert main(args) == 0
    ((trainer, after),) = kept
    assert trainer.parts.reference is None
    kl = [r["kl"] for r in metric_rows(tmp_path / "run") if "kl" in r]
    assert len(kl) == 6 and kl[0] == 0.0 and all(k > 0 for k in kl[1:]), kl
    drawn = build_model(trainer.args, seed=trainer.cfg.training.seed).state_dict()
    for name, tensor in after.items():
        if not is_adapter(name):
            assert torch.equal(tensor, drawn[name]), name
        elif name.endswith("lora_B.weight"):
            assert tensor.abs().max() > 0, name
