"""8-bit Adam (use_bnb_optimizer) at ZeRO 3 on 2 processes: torchao's AdamW8bit steps FSDP2's
DTensor shards, trains as the same optimizer at ZeRO 0 in one process, and resumes bit for bit.
(Which library each stage runs and the layouts 8-bit Adam refuses: tests/optim/test_eight_bit.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DP_KEYS, assert_resumes_bitwise, losses, train, weights
from torchneox.config.load import load_config
from torchneox.optim import eight_bit as optim_eight_bit
from torchneox.train.trainer import Trainer

# hidden 128: every tensor quantised at ZeRO 0 (>= 4,096 values, whole blocks of 256) splits
# into 2 shards of whole blocks that are themselves >= 4,096 values, so each shard keeps 8-bit
# moments over the very blocks of the whole tensor, and the tensors under 4,096 (norms,
# biases) keep fp32 moments in both runs
KEYS = {"hidden_size": 128, "train_iters": 4, "use_bnb_optimizer": True, **DP_KEYS}
ZERO3 = ["zero_optimization.stage=3", "train_micro_batch_size_per_gpu=2"]


def test_zero3_8bit_adam_equals_zero0_and_resumes_bitwise(make_config, tmp_path, monkeypatch):
    # torchao's step eager in every process (torch.compile would compile it once per shard
    # shape, most of this test's time): what is held here is how the shards are stepped
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    one = tmp_path / "one"
    cfg = make_config("e.yml", save=str(one), load=str(one), **KEYS)
    # ZeRO 0 runs bitsandbytes where it is installed: the baseline is torchao's optimizer too
    monkeypatch.setattr(optim_eight_bit, "library_for", lambda o: "torchao")
    trainer = Trainer(load_config([cfg]), device="cpu")
    trainer.run()
    assert type(trainer.optimizer).__name__ == "AdamW8bit"
    monkeypatch.undo()
    out = tmp_path / "zero3"
    train(cfg, f"save={out}", "load=null", "checkpoint_factor=2", *ZERO3, nproc=2)
    # the blocks are the same, but the layouts' gradients differ in float rounding (their sums
    # run in other orders), and where such a difference moves a moment across the midpoint of
    # two of the 256 code values, that value rounds to the neighbouring code and the element's
    # update moves by a step of the code: a few elements in 10,000 land beyond the fp32
    # layouts' tolerance (5e-5), none by a third of lr; a block quantised over other values
    # (another absmax) would move all 256 of its elements
    a, b = losses(one), losses(out)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    norms_a, norms_b = losses(one, "grad_norm"), losses(out, "grad_norm")
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5), k
        assert norms_b[k] == pytest.approx(norms_a[k], rel=1e-4), k
    zero0, values, beyond = weights(one), 0, 0
    for name, tensor in weights(out).items():
        off = (tensor - zero0[name]).abs()
        assert off.max() < 1e-3, name  # lr 3e-3
        values, beyond = values + off.numel(), beyond + int((off > 5e-5).sum())
    assert beyond < values / 10_000, (beyond, values)
    assert_resumes_bitwise(cfg, out, 2, ZERO3, nproc=2)
