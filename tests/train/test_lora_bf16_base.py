"""LoRA with its frozen base stored in bfloat16 (``lora.base_dtype: bf16``): under bf16
precision the run computes what the fp32-base run computes, bit for bit (autocast casts the
fp32 weights to the same bfloat16 values at each use), in one process and on two (ZeRO-3, the
bf16 base and the fp32 adapters in one FSDP unit; tensor parallel 2); the base's linear
weights are bfloat16 in the model; and the process holds about half their bytes less,
measured from outside it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import losses, post_training_data, train, weights
from tests.parallel.test_lora_layouts import KEYS as LAYOUT_KEYS
from tests.train.test_lora_memory import COMMON, MODEL, status_at_first_step
from torchneox.checkpoint.files import checkpoint_config, resolve
from torchneox.config.features.lora import is_base_linear
from torchneox.config.load import load_config
from torchneox.models.args import model_args
from torchneox.models.transformer import Transformer

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
# test_lora_layouts' model and batches (2 micro-batches of 2 here), trained in bf16
KEYS = LAYOUT_KEYS | {"lora": LORA, "gradient_accumulation_steps": 2, "precision": "bfloat16"}
BF16 = "lora.base_dtype=bf16"


@pytest.fixture(scope="module")
def runs(make_module_config, tmp_path_factory):
    """A base checkpoint (fp32, no adapters), and LoRA from it with the base in fp32 and in
    bf16 (one process)."""
    tmp = tmp_path_factory.mktemp("bf16_base")
    config = make_module_config("bf16.yml", train_iters=4, **KEYS)
    base = tmp / "base"
    train(config, f"save={base}", "load=null", "lora=null", "train_iters=1")
    out = {"config": config, "base": base}
    for name, extra in (("fp32", ()), ("bf16", (BF16,))):
        out[name] = tmp / name
        train(config, f"save={out[name]}", f"load={base}", "finetune=true", *extra)
    return out


def assert_same_as_fp32_base(run, fp32) -> None:
    """Losses and gradient norms equal bit for bit; the adapters equal, the base the fp32
    base rounded to bfloat16."""
    assert losses(run) == losses(fp32) and len(losses(run)) == 4
    assert losses(run, "grad_norm") == losses(fp32, "grad_norm")
    ours, theirs = weights(run), weights(fp32)
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        bf16 = is_base_linear(name)
        assert tensor.dtype == (torch.bfloat16 if bf16 else torch.float32), name
        expected = theirs[name].bfloat16() if bf16 else theirs[name]
        assert torch.equal(tensor, expected), name


def test_a_bf16_base_trains_as_the_fp32_base_does(runs):
    assert_same_as_fp32_base(runs["bf16"], runs["fp32"])
    assert checkpoint_config(resolve(runs["bf16"])).config.training.lora["base_dtype"] == "bf16"
    stored = {n: t.dtype for n, t in weights(runs["bf16"]).items()}  # as training builds it
    assert stored["layers.0.attention.wq.weight"] == torch.bfloat16
    assert stored["layers.1.mlp.up.weight"] == torch.bfloat16  # not adapted, still the base's
    assert stored["output.weight"] == torch.bfloat16
    assert stored["layers.0.attention.wq.lora_A.weight"] == torch.float32
    assert stored["embed.weight"] == torch.float32
    assert stored["final_norm.weight"] == torch.float32


@pytest.mark.parametrize(
    "layout",
    [
        # the bf16 base and the fp32 adapters in the same FSDP2 units
        ("zero_optimization.stage=3", "train_micro_batch_size_per_gpu=1"),
        ("model_parallel_size=2",),
    ],
    ids=["zero3", "tp2"],
)
def test_a_bf16_base_on_two_processes_trains_as_the_fp32_base(runs, tmp_path, layout):
    out = {}
    for name, extra in (("fp32", ()), ("bf16", (BF16,))):
        out[name] = tmp_path / name
        from_base = [f"save={out[name]}", f"load={runs['base']}", "finetune=true"]
        train(runs["config"], *from_base, *layout, *extra, nproc=2)
    assert_same_as_fp32_base(out["bf16"], out["fp32"])
    # and the layout trains as one process does, to bfloat16's precision (ZeRO gathers the
    # norms in bf16 too; tensor ranks sum in another order)
    assert losses(out["bf16"]) == pytest.approx(losses(runs["bf16"]), rel=1e-4)


def test_a_bf16_base_holds_half_the_bytes_of_its_linear_weights(tmp_path):
    """Measured from outside the process as its first step begins: about 50 M parameters,
    nearly all of them the blocks' linear weights. Measured with the system's malloc settings:
    the run fixes glibc's mmap threshold itself (train/processes.fix_malloc_threshold), so a
    freed temporary (a weight drawn in fp32 before its bf16 copy is kept) goes back to the
    system instead of staying in the heap."""
    data = post_training_data(tmp_path)
    held = {}
    for name in ("bf16", "fp32"):  # (the first run also writes the data's index caches)
        keys = data["sft"] | COMMON | MODEL | {"precision": "bfloat16"}
        keys["lora"] = LORA | {"base_dtype": name}
        path = tmp_path / f"{name}.yml"
        path.write_text(json.dumps(keys))
        held[name] = status_at_first_step(str(path))
    args = model_args(load_config([str(tmp_path / "bf16.yml")]))
    with torch.device("meta"):
        model = Transformer(args)
    linear = sum(p.numel() for n, p in model.named_parameters() if is_base_linear(n))
    assert linear > 0.9 * sum(p.numel() for p in model.parameters())
    mib = {f"{k} {v}": held[k][v] >> 20 for k in held for v in ("RssAnon", "VmHWM")}
    mib["linear weights in fp32"] = 4 * linear >> 20
    # what it holds: two bytes fewer per linear weight (seen: 318 MiB against 414, for 192 MiB
    # of fp32 linear weights)
    saved = held["fp32"]["RssAnon"] - held["bf16"]["RssAnon"]
    assert 0.8 * 2 * linear < saved < 1.2 * 2 * linear, mib
    # and its peak too: the bf16 base is never built in fp32 first
    assert held["fp32"]["VmHWM"] - held["bf16"]["VmHWM"] > 0.5 * 2 * linear, mib
