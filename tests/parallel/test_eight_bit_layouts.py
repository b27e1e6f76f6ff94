"""8-bit Adam (use_bnb_optimizer) in every layout axis, on 4 processes: torchao's AdamW8bit steps
the DTensor parts of data parallel 2 x expert parallel 2 x tensor parallel 2 under ZeRO 3, and of
pipeline 2 x context parallel 2; both train as the same optimizer in one process and resume bit
for bit. (Which library each layout runs: tests/optim/test_eight_bit.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DP_KEYS, assert_resumes_bitwise, losses, train, weights
from torchneox.config.load import load_config
from torchneox.optim import eight_bit as optim_eight_bit
from torchneox.train.trainer import Trainer

# hidden 128: every tensor quantised in one process (>= 4,096 values, whole blocks of 256)
# splits into parts of whole blocks that are themselves >= 4,096 values (ZeRO's and the
# column- and vocabulary-parallel rows, the experts), so each part keeps 8-bit moments over the
# very blocks of the whole tensor; the attention output, split by tensor parallelism into
# 64-column halves of its 128-value rows (a block is two whole rows), is stepped in rows
# (optim/eight_bit.py: row_placements); the tensors under 4,096 values (norms, biases, the
# router) keep fp32 moments in every run
KEYS = {
    "hidden_size": 128,
    "train_iters": 3,
    "split": "100,0,0",  # (no evaluation at the end)
    "use_bnb_optimizer": True,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_router_type": "topk",
    "no_weight_tying": True,
    **DP_KEYS,
}
TP_EP_ZERO3 = [
    "model_parallel_size=2",
    "expert_parallel_size=2",
    "zero_optimization.stage=3",
    "train_micro_batch_size_per_gpu=4",
    "gradient_accumulation_steps=1",
]
PP_CP = ["pipe_parallel_size=2", "context_parallel_size=2"]


def assert_trains_as(out, one) -> None:
    """The layouts' gradients differ from one process's in float rounding (their sums run in
    other orders); where such a difference moves a moment across the midpoint of two of the
    256 code values, that value rounds to the neighbouring code and the element's update moves
    by a step of the code: a few elements in 100,000 land beyond the fp32 layouts' tolerance
    (5e-5), none by a third of lr; a block quantised over other values (another absmax, as the
    attention output's 64-column halves would be) would move most of its 256 elements"""
    a, b = losses(one), losses(out)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    norms_a, norms_b = losses(one, "grad_norm"), losses(out, "grad_norm")
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5), k
        assert norms_b[k] == pytest.approx(norms_a[k], rel=1e-4), k
    whole, values, beyond = weights(one), 0, 0
    for name, tensor in weights(out).items():
        off = (tensor - whole[name]).abs()
        assert off.max() < 1e-3, name  # lr 3e-3
        assert int((off > 5e-5).sum()) < 64, name  # (a block moved whole: 256)
        values, beyond = values + off.numel(), beyond + int((off > 5e-5).sum())
    assert beyond < values / 10_000, (beyond, values)


def test_8bit_adam_in_every_layout_equals_one_process_and_resumes_bitwise(
    make_config, tmp_path, monkeypatch
):
    # torchao's step eager in every process (torch.compile would compile it once per part
    # shape, most of this test's time): what is held here is how the parts are stepped
    # (torch._dynamo.config.patch, not monkeypatch: monkeypatch's undo deletes the config
    # module's attribute, and every later compile in this test process then fails)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    one = tmp_path / "one"
    cfg = make_config("e.yml", save=str(one), load=str(one), **KEYS)
    # one process runs bitsandbytes where it is installed: the baseline is torchao's optimizer
    monkeypatch.setattr(optim_eight_bit, "library_for", lambda o, dtensors=None: "torchao")
    trainer = Trainer(load_config([cfg]), device="cpu")
    with torch._dynamo.config.patch(disable=True):
        trainer.run()
    assert type(trainer.optimizer).__name__ == "AdamW8bit"
    monkeypatch.undo()
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    out = tmp_path / "tp-ep-zero3"
    train(cfg, f"save={out}", "load=null", "checkpoint_factor=2", *TP_EP_ZERO3, nproc=4)
    assert_trains_as(out, one)
    assert_resumes_bitwise(cfg, out, 2, TP_EP_ZERO3, nproc=4)
    out = tmp_path / "pp-cp"
    train(cfg, f"save={out}", "load=null", "checkpoint_factor=2", *PP_CP, nproc=4)
    assert_trains_as(out, one)
    assert_resumes_bitwise(cfg, out, 2, PP_CP, nproc=4)  # (the stages' state keyed by name)
