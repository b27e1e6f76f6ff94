"""fp8 training through torchao's float8: the keys pick the linears and casts, runs train
like the bf16 run to fp8's tolerance, and what cannot run is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import losses
from torchneox.base.errors import ConfigError
from torchneox.cli import main
from torchneox.config.features.fp8_plan import fp8_plan
from torchneox.config.load import load_config
from torchneox.parallel.fp8 import check_fp8_hardware, torchao_config
from torchneox.train.trainer import Trainer

pytest.importorskip("torchao.float8")  # the dev extra installs it


def trained(make_config, tmp_path, name, **keys):
    cfg = make_config(precision="bfloat16", train_iters=6, save=str(tmp_path / name), **keys)
    trainer = Trainer(load_config([cfg]), device="cpu")
    trainer.run()
    return trainer, losses(tmp_path / name)


@pytest.mark.parametrize(
    ("keys", "swapped"),
    [
        ({"fp8_recipe": "tensorwise"}, "every block linear"),
        ({"fp8_recipe": "rowwise"}, "every block linear"),
        ({"fp8_recipe": "rowwise_with_gw_hp"}, "every block linear"),
        ({"te_fp8_mha": True}, "attention"),
    ],
)
def test_fp8_trains_like_bf16(make_config, tmp_path, keys, swapped):
    from torchao.float8.float8_linear import Float8Linear

    _, bf16 = trained(make_config, tmp_path, "bf16")
    trainer, fp8 = trained(make_config, tmp_path, "fp8", **keys)
    names = [n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
    blocks = [n for n, m in trainer.model.named_modules() if isinstance(m, torch.nn.Linear)]
    blocks = [n for n in blocks if n.startswith("layers.")]
    want = blocks if swapped == "every block linear" else [n for n in blocks if ".attention." in n]
    assert names == want and names
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # masters
    assert fp8 != bf16  # the products ran in fp8
    for step, loss in bf16.items():
        assert fp8[step] == pytest.approx(loss, rel=3e-2)
    assert fp8[6] < fp8[1]


def test_te_fp8_keys_map_onto_torchao_casts(make_config):
    cfg = load_config([make_config(te_fp8_mha=True, te_fp8_wgrad=False)]).config
    plan = fp8_plan(cfg.precision, cfg.model)
    assert (plan.recipe, plan.scope, plan.grad_format, plan.wgrad_high_precision) == (
        "tensorwise", "attention", "e5m2", True,
    )  # fmt: skip
    c = torchao_config(plan)
    assert c.cast_config_grad_output.target_dtype == torch.float8_e5m2  # hybrid's backward
    assert c.cast_config_input_for_grad_weight.scaling_type.value == "disabled"
    e4m3_cfg = load_config([make_config(te_fp8_mha=True, te_fp8_format="e4m3")]).config
    e4m3 = fp8_plan(e4m3_cfg.precision, e4m3_cfg.model)
    assert torchao_config(e4m3).cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    plain = load_config([make_config()]).config
    assert fp8_plan(plain.precision, plain.model) is None


def test_fp8_refusals_are_one_line(make_config, tmp_path, capsys, monkeypatch):
    cfg = make_config(te_fp8_mha=True, te_fp8_amax_history_len=16)
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "te_fp8_amax_history_len" in err and "delayed" in err
    rowwise = load_config([make_config(fp8_recipe="rowwise")]).config
    plan = fp8_plan(rowwise.precision, rowwise.model)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8\.0\) has no fp8 units"):
        check_fp8_hardware(plan, torch.device("cuda"))


def test_tensor_parallelism_splits_fp8_layers_with_torchaos_float8_styles():
    """Tensorwise fp8 layers take torchao's float8 tensor-parallel styles (inputs and output
    gradients cast before their collectives); a recipe keeping the weight gradient's product
    in high precision, a layer with a LoRA adapter, a plain layer, and gloo under sequence
    parallelism (no fp8 collectives) take torch's styles, the layer casting its own parts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from torchneox.config.features.fp8_plan import FP8Plan
    from torchneox.parallel.fp8 import apply_fp8, column_style, gather_input_style, row_style

    def layers(plan):
        model = torch.nn.Module()
        model.layers = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        apply_fp8(model, plan)
        return list(model.layers)

    fp8, plain = layers(FP8Plan("tensorwise", "blocks")), torch.nn.Linear(32, 32)
    assert type(column_style(fp8[0])) is Float8ColwiseParallel
    assert type(row_style(fp8[1], output_layouts=None)) is Float8RowwiseParallel
    assert type(gather_input_style(fp8, True)) is PrepareFloat8ModuleInput
    assert type(gather_input_style([*fp8, plain], True)) is not PrepareFloat8ModuleInput
    assert type(column_style(fp8[0], False)) is ColwiseParallel
    assert type(gather_input_style(fp8, False)) is not PrepareFloat8ModuleInput
    assert type(column_style(plain)) is ColwiseParallel
    high = FP8Plan("tensorwise", "blocks", wgrad_high_precision=True)
    for layer in (*layers(FP8Plan("rowwise_with_gw_hp", "blocks")), *layers(high)):
        assert type(column_style(layer)) is ColwiseParallel
        assert type(row_style(layer)) is RowwiseParallel
    fp8[0].lora_A = torch.nn.Linear(32, 4)
    assert type(column_style(fp8[0])) is ColwiseParallel


def test_rowwise_with_gw_hp_and_high_precision_weight_gradients_run_under_cpu_autocast():
    """The recipes that keep the weight gradient's product in high precision met an fp32
    input and a bf16 output gradient under the CPU's autocast (a dtype error inside torchao)."""
    from torchneox.config.features.fp8_plan import FP8Plan
    from torchneox.parallel.fp8 import apply_fp8

    for plan in (
        FP8Plan("rowwise_with_gw_hp", "blocks"),
        FP8Plan("tensorwise", "blocks", grad_format="e5m2", wgrad_high_precision=True),
    ):
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.layers = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
        assert apply_fp8(model, plan) == 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.layers(torch.randn(8, 32))
        out.float().square().sum().backward()
        for p in model.parameters():
            assert p.grad is not None and p.grad.dtype == torch.float32
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
