"""optimizer.type muon: torch.optim.Muon on the blocks' hidden matrices and torch.optim.AdamW
on the rest (the references are torch's own optimizers, stepped side by side on a copy of
the model), its one-line refusals and what explain says."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import BASE, VARIANTS
from torchneox.config.features.optimizer import optimizer_spec
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.optim.builder import build_optimizer

MUON = {
    "type": "muon",
    "params": {"lr": 0.02, "momentum": 0.9, "betas": [0.9, 0.95], "eps": 1e-8, "adamw_lr": 0.004},
}


def build(variant: str):
    """A tiny model: a helpers variant, or "moe" (two experts in every layer)."""
    keys = {"moe_num_experts": 2, "moe_top_k": 1} if variant == "moe" else VARIANTS[variant]
    loaded = load_mapping(BASE | keys, variant)
    return loaded, build_model(model_args(loaded), seed=0)


def _optimizer_config(loaded, optimizer):
    o = copy.deepcopy(loaded.config.optimizer)
    o.optimizer, o.weight_decay = copy.deepcopy(optimizer), 0.1
    return o


def _grads(model, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _references(model, rule="match_rms_adamw"):
    """torch's Muon over the blocks' 2-D weights but the router, AdamW over the rest (the
    same split and decay groups, written out here by name)."""
    hidden, matrices, others = [], [], []
    for name, p in model.named_parameters():
        block = name.startswith("layers.") and "router" not in name
        if block and name.endswith(".weight") and p.ndim == 2:
            hidden.append(p)
        else:
            (matrices if p.ndim >= 2 else others).append(p)
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn=rule)
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=0.004, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return hidden, muon, adamw


@pytest.mark.parametrize(
    "variant,rule",
    [("neox-rotary", "match_rms_adamw"), ("moe", "match_rms_adamw"), ("neox-rotary", "original")],
)
def test_muon_steps_as_torchs_muon_and_adamw(variant, rule):
    loaded, model = build(variant)
    ref = copy.deepcopy(model)
    optimizer = copy.deepcopy(MUON)
    optimizer["params"]["adjust_lr_fn"] = rule
    opt = build_optimizer(model, _optimizer_config(loaded, optimizer), "cpu")
    hidden, ref_muon, ref_adamw = _references(ref, rule)
    assert hidden and len(hidden) < len(list(ref.parameters()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        _grads(model, step)
        _grads(ref, step)
        for group in opt.param_groups:  # as the trainer's schedule sets it
            group["lr"] = 0.02
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert not torch.equal(p, before[name]), name
        assert torch.equal(p, q), name
    if variant == "moe":  # the router and the experts are AdamW's
        names = [n for n, p in ref.named_parameters() if any(p is h for h in hidden)]
        assert not any("router" in n or "experts" in n for n in names)


def test_state_dict_round_trip_keeps_stepping_the_same():
    loaded, model = build("neox-rotary")
    config = _optimizer_config(loaded, MUON)
    opt = build_optimizer(model, config, "cpu")
    _grads(model, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    other = build_optimizer(twin, config, "cpu")
    other.load_state_dict(saved)
    for m, o in ((model, opt), (twin, other)):
        _grads(m, 1)
        o.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name
    kinds = {k for state in opt.state.values() for k in state}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}


def test_state_tensors_for_the_estimator():
    loaded, _ = build("neox-rotary")
    spec = optimizer_spec(_optimizer_config(loaded, MUON))
    assert (spec.state_tensors, spec.hidden_state_tensors) == (2, 1)


@pytest.mark.parametrize(
    "params,message",
    [
        ("{momentum: 1.0}", "params.momentum must be in [0, 1), got 1.0"),
        ("{ns_steps: 0}", "params.ns_steps must be a whole number of Newton-Schulz steps"),
        ("{adjust_lr_fn: moonshot}", "params.adjust_lr_fn must be match_rms_adamw"),
        ("{ns_coefficients: [1, 2]}", "params.ns_coefficients must be three numbers"),
        ("{adamw_lr: 0}", "params.adamw_lr must be > 0, got 0"),
        ("{ns_dtype: fp16}", "params.ns_dtype must be bf16 (torch's Muon) or fp32"),
        ("{nesterov: 1}", "params.nesterov must be true or false"),
        ("{dampening: 0.1}", "params.dampening is not a parameter of muon"),
    ],
)
def test_bad_params_are_one_line(tmp_path, capsys, params, message):
    from torchneox.cli import main

    cfg = tmp_path / "c.yml"
    cfg.write_text(f"{{optimizer: {{type: muon, params: {params}}}}}\n")
    assert main(["config", "explain", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "c.yml" in err, err


def test_explain_says_what_runs_where(tmp_path, capsys):
    from torchneox.cli import main

    cfg = tmp_path / "c.yml"
    cfg.write_text("{optimizer: {type: muon, params: {lr: 0.001, adamw_lr: 0.0003}}}\n")
    assert main(["config", "explain", str(cfg)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in (
        "muon from optimizer.type 'muon'",
        "torch.optim.Muon on the blocks' 2-D weights (momentum 0.95, nesterov, 5 Newton-Schulz",
        "steps in bf16, eps 1e-07",
        "lr adjusted by match_rms_adamw",
        "AdamW (betas (0.9, 0.999), eps 1e-08, adamw_lr 0.0003",
        "gathered whole on every rank, orthogonalised, and each rank keeps its shard's part",
    ):
        assert text in out, text


def _sharded_muon(rank: int, store: str, placement: str, out: str) -> None:
    """One of 2 gloo ranks: a 5 x 3 matrix (uneven rows) sharded over both, three Muon steps,
    the whole matrix written by rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchneox.optim.muon import ShardedMuon

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        placements = [Shard(int(placement[-1]))]
        p = torch.nn.Parameter(distribute_tensor(MATRIX.clone(), mesh, placements))
        opt = ShardedMuon([p], **SETTINGS)
        for g in MATRIX_GRADS:
            p.grad = distribute_tensor(g.clone(), mesh, placements)
            opt.step()
        whole = p.detach().full_tensor()
        if rank == 0:
            torch.save(whole, out)
    finally:
        dist.destroy_process_group()


MATRIX = torch.linspace(-1.0, 1.0, 15).reshape(5, 3)
MATRIX_GRADS = [MATRIX.flip(0) * s + 0.1 * k for k, s in enumerate((1.0, -0.5, 2.0))]
SETTINGS = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9}


@pytest.mark.parametrize("placement", ["shard0", "shard1"])
def test_a_sharded_matrix_steps_as_torchs_muon_on_the_whole_one(tmp_path, placement):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    out = tmp_path / "whole.pt"
    args = (str(tmp_path / "store"), placement, str(out))
    ranks = [context.Process(target=_sharded_muon, args=(r, *args)) for r in range(2)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(120)
    assert [r.exitcode for r in ranks] == [0, 0]
    p = torch.nn.Parameter(MATRIX.clone())
    opt = torch.optim.Muon([p], **SETTINGS)
    for g in MATRIX_GRADS:
        p.grad = g.clone()
        opt.step()
    assert not torch.equal(p.detach(), MATRIX)
    assert torch.equal(torch.load(out), p.detach())


def test_a_resumed_run_takes_its_own_adamw_lr_and_kernels():
    loaded, model = build("neox-rotary")
    opt = build_optimizer(model, _optimizer_config(loaded, MUON), "cpu")
    _grads(model, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    changed = copy.deepcopy(MUON)
    changed["params"]["adamw_lr"] = 0.01
    other = build_optimizer(copy.deepcopy(model), _optimizer_config(loaded, changed), "mps")
    other.load_state_dict(saved)
    adamw = other.param_groups[1:]
    assert [g["lr_ratio"] for g in adamw] == [0.5, 0.5]
    assert all(g["foreach"] and not g["fused"] for g in adamw)  # this run's, not the saved
    assert other.param_groups[0]["momentum"] == 0.9


def test_newton_schulz_in_fp32_is_the_same_iteration_without_bf16_rounding():
    """fp32 orthogonalises as bf16 does, to bf16's precision; it is no copy of the bf16 one."""
    from torchneox.optim.muon import newton_schulz

    g = torch.randn(8, 20, generator=torch.Generator().manual_seed(0))
    coefficients = (3.4445, -4.7750, 2.0315)
    for m in (g, g.T):  # wide and tall
        fp32 = newton_schulz(m, coefficients, 5, 1e-7, torch.float32)
        bf16 = newton_schulz(m, coefficients, 5, 1e-7, torch.bfloat16)
        assert fp32.dtype == torch.float32 and fp32.shape == m.shape
        assert not torch.equal(fp32, bf16.float())
        torch.testing.assert_close(fp32, bf16.float(), atol=0.05, rtol=0.05)
        # its singular values are near one: the quintic's band, about (0.7, 1.2)
        s = torch.linalg.svdvals(fp32)
        assert s.min() > 0.6 and s.max() < 1.25, s
