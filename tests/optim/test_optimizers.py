"""SM3, madgrad_wd and LAMB against references they did not write: the madgrad package's
MADGRAD, and the published updates computed here by hand, element by element, on fixed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from torchneox.optim.neox import SM3, Lamb, MadgradWD

P0 = [[0.5, -1.0, 2.0], [0.25, 1.5, -0.75]]
GRADS = [
    [[0.1, -0.2, 0.3], [-0.4, 0.5, 0.05]],
    [[0.3, 0.1, -0.2], [0.2, -0.6, 0.4]],
    [[-0.5, 0.2, 0.1], [0.1, 0.3, -0.2]],
]


def stepped(optimizer_cls, steps: int = 3, p0=P0, **kwargs) -> torch.Tensor:
    p = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = optimizer_cls([p], **kwargs)
    for g in GRADS[:steps]:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_madgrad_wd_without_decay_is_madgrad(momentum):
    madgrad = pytest.importorskip("madgrad")
    ours = stepped(MadgradWD, lr=0.01, momentum=momentum, eps=1e-6)
    theirs = stepped(madgrad.MADGRAD, lr=0.01, momentum=momentum, eps=1e-6)
    assert not torch.equal(ours, torch.tensor(P0, dtype=torch.float64))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_madgrad_wd_is_madgrads_decoupled_decay_without_momentum():
    """Without momentum GPT-NeoX's decay before the step (p *= 1 - lr' wd) and the madgrad
    package's after it (p -= lr' wd p_old) are the same update."""
    madgrad = pytest.importorskip("madgrad")
    kw = {"lr": 0.01, "momentum": 0.0, "eps": 1e-6, "weight_decay": 0.1}
    ours = stepped(MadgradWD, **kw)
    theirs = stepped(madgrad.MADGRAD, decouple_decay=True, **kw)
    assert not torch.allclose(ours, stepped(MadgradWD, **{**kw, "weight_decay": 0.0}))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_madgrad_wd_decay_by_hand(momentum):
    """One step: x0 = p (kept from before the decay with momentum), p *= 1 - (lr + eps) wd,
    s = lambda g, v = lambda g^2 (lambda = lr + eps at step 0), z = x0 - s / (v^(1/3) + eps),
    p = momentum p + (1 - momentum) z (p = z without momentum, x0 = the decayed p + s_old / .. =
    the decayed p)."""
    lr, eps, wd = 0.01, 1e-6, 0.5
    got = stepped(MadgradWD, steps=1, lr=lr, momentum=momentum, eps=eps, weight_decay=wd)
    lam = lr + eps
    for i in range(2):
        for j in range(3):
            p = P0[i][j] * (1 - (lr + eps) * wd)
            g = GRADS[0][i][j]
            x0 = P0[i][j] if momentum else p
            z = x0 - lam * g / ((lam * g * g) ** (1 / 3) + eps)
            want = momentum * p + (1 - momentum) * z
            assert got[i, j].item() == pytest.approx(want, rel=1e-12)


def lamb_by_hand(p0, grads, lr, b1, b2, eps, wd, lo, hi, bias_correction=True, inside=False):
    p = [row[:] for row in p0]
    cells = [(i, j) for i in range(len(p)) for j in range(len(p[0]))]
    m = {c: 0.0 for c in cells}
    v = {c: 0.0 for c in cells}
    for t, g in enumerate(grads, start=1):
        u = {}
        for i, j in cells:
            m[i, j] = b1 * m[i, j] + (1 - b1) * g[i][j]
            v[i, j] = b2 * v[i, j] + (1 - b2) * g[i][j] ** 2
            denom = math.sqrt(v[i, j] + eps) if inside else math.sqrt(v[i, j]) + eps
            u[i, j] = m[i, j] / denom + wd * p[i][j]
        w_norm = math.sqrt(sum(p[i][j] ** 2 for i, j in cells))
        u_norm = math.sqrt(sum(x * x for x in u.values()))
        ratio = min(max(w_norm / u_norm, lo), hi)
        size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
        for i, j in cells:
            p[i][j] -= size * ratio * u[i, j]
    return torch.tensor(p, dtype=torch.float64)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"weight_decay": 0.1, "eps_inside_sqrt": True},
        {"bias_correction": False, "max_coeff": 0.5, "min_coeff": 0.3},
    ],
)
def test_lamb_by_hand(kw):
    full = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.0, **kw}
    got = stepped(Lamb, **full)
    want = lamb_by_hand(
        P0,
        GRADS,
        full["lr"],
        *full["betas"],
        full["eps"],
        full["weight_decay"],
        full.get("min_coeff", 0.01),
        full.get("max_coeff", 10.0),
        bias_correction=full.get("bias_correction", True),
        inside=full.get("eps_inside_sqrt", False),
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_lamb_ratio_is_one_for_a_zero_tensor():
    got = stepped(Lamb, steps=1, p0=[[0.0] * 3] * 2, lr=0.1, betas=(0.9, 0.99), eps=0.0)
    # m / sqrt(v) = g(1 - b1) / (|g| sqrt(1 - b2)) = sign(g) (1 - b1) / sqrt(1 - b2), then the
    # bias correction sqrt(1 - b2) / (1 - b1): one step of lr * sign(g)
    torch.testing.assert_close(got, -0.1 * torch.tensor(GRADS[0]).double().sign())


def sm3_by_hand(p0, grads, lr, momentum, beta, eps):
    rows, cols = len(p0), len(p0[0])
    p = [row[:] for row in p0]
    row_acc, col_acc = [0.0] * rows, [0.0] * cols
    buf = [[0.0] * cols for _ in range(rows)]
    for g in grads:
        nu = [
            [beta * min(row_acc[i], col_acc[j]) + (1 - beta) * g[i][j] ** 2 for j in range(cols)]
            for i in range(rows)
        ]
        new_rows = [max(nu[i]) for i in range(rows)]
        new_cols = [max(nu[i][j] for i in range(rows)) for j in range(cols)]
        if beta > 0:
            new_rows = [max(a, b) for a, b in zip(row_acc, new_rows, strict=True)]
            new_cols = [max(a, b) for a, b in zip(col_acc, new_cols, strict=True)]
        row_acc, col_acc = new_rows, new_cols
        for i in range(rows):
            for j in range(cols):
                u = g[i][j] / math.sqrt(nu[i][j] + eps)
                if momentum > 0:
                    u = (1 - momentum) * u + momentum * buf[i][j]
                    buf[i][j] = u
                p[i][j] -= lr * u
    return torch.tensor(p, dtype=torch.float64)


@pytest.mark.parametrize(
    "kw", [{}, {"momentum": 0.5}, {"beta": 0.9}, {"momentum": 0.9, "beta": 0.5}]
)
def test_sm3_by_hand(kw):
    full = {"lr": 0.1, "momentum": 0.0, "beta": 0.0, "eps": 1e-30, **kw}
    got = stepped(SM3, **full)
    want = sm3_by_hand(P0, GRADS, **full)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_sm3_keeps_one_accumulator_per_dimension():
    p = torch.nn.Parameter(torch.ones(4, 3, 2))
    b = torch.nn.Parameter(torch.ones(5))
    opt = SM3([p, b])
    p.grad, b.grad = torch.full_like(p, 0.5), torch.full_like(b, 0.5)
    opt.step()
    shapes = {k: tuple(v.shape) for k, v in opt.state[p].items() if k.startswith("acc")}
    assert shapes == {
        "accumulator_0": (4, 1, 1),
        "accumulator_1": (1, 3, 1),
        "accumulator_2": (1, 1, 2),
    }
    assert tuple(opt.state[b]["accumulator_0"].shape) == (5,)
    # g / sqrt(g^2) = 1: every entry moved by lr (0.1)
    torch.testing.assert_close(p.detach(), torch.full_like(p, 0.9))


def _sharded_steps(rank: int, store: str, kind: str, placement: str, out: str) -> None:
    """One of 2 gloo ranks: the parameter and its gradients as DTensors sharded over both,
    three steps of ``kind``, the whole parameter written by rank 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        placements = [Shard(int(placement[-1]))]
        p = torch.nn.Parameter(distribute_tensor(UNEVEN.clone(), mesh, placements))
        opt = OTHERS[kind][0]([p], **OTHERS[kind][1])
        for g in UNEVEN_GRADS:
            p.grad = distribute_tensor(g.clone(), mesh, placements)
            opt.step()
        whole = p.detach().full_tensor()
        if rank == 0:
            torch.save(whole, out)
    finally:
        dist.destroy_process_group()


# rows (and columns) of very different sizes: a norm or a max taken over one shard is not the
# whole tensor's
UNEVEN = torch.cat([torch.full((2, 4), 3.0), torch.full((2, 4), 0.01)]) * torch.tensor(
    [1.0, -2.0, 0.5, 4.0]
)
UNEVEN_GRADS = [UNEVEN.flip(0) * s + 0.1 * k for k, s in enumerate((1.0, -0.5, 2.0))]
OTHERS = {
    "sm3": (SM3, {"lr": 0.1, "momentum": 0.5, "beta": 0.5}),
    "madgrad_wd": (MadgradWD, {"lr": 0.01, "weight_decay": 0.1}),
    "lamb": (Lamb, {"lr": 0.01, "weight_decay": 0.1}),
}


@pytest.mark.parametrize("placement", ["shard0", "shard1"])
@pytest.mark.parametrize("kind", list(OTHERS))
def test_a_sharded_parameter_steps_as_the_whole_one(tmp_path, kind, placement):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    out = tmp_path / "whole.pt"
    args = (str(tmp_path / "store"), kind, placement, str(out))
    ranks = [context.Process(target=_sharded_steps, args=(r, *args)) for r in range(2)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(120)
    assert [r.exitcode for r in ranks] == [0, 0]
    p = torch.nn.Parameter(UNEVEN.clone())
    opt = OTHERS[kind][0]([p], **OTHERS[kind][1])
    for g in UNEVEN_GRADS:
        p.grad = g.clone()
        opt.step()
    assert not torch.equal(p.detach(), UNEVEN)
    torch.testing.assert_close(torch.load(out), p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "optimizer,shown",
    [
        (
            "{type: SM3, params: {lr: 0.1, momentum: 0.5}}",
            [
                "sm3  from optimizer.type 'SM3'; SM3 (GPT-NeoX's): momentum 0.5, beta 0, eps 1e-30",
                "0.1, unused: SM3 takes no weight decay",
            ],
        ),
        (
            "{type: madgrad_wd, params: {lr: 0.01, eps: 1.0e-7}}",
            ["p *= 1 - (lr + eps) * weight_decay", "momentum 0.9, eps 1e-07"],
        ),
        (
            "{type: Lamb, params: {lr: 0.01, max_coeff: 3, eps_inside_sqrt: true}}",
            ["LAMB (DeepSpeed's FusedLamb", "eps 1e-08 inside the square root", "[0.01, 3]"],
        ),
    ],
)
def test_explain_names_the_optimizer_and_its_settings(tmp_path, capsys, optimizer, shown):
    from torchneox.cli import main

    cfg = tmp_path / "c.yml"
    cfg.write_text(f"{{optimizer: {optimizer}, weight_decay: 0.1}}\n")
    assert main(["config", "explain", str(cfg)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in shown:
        assert " ".join(text.split()) in out, text


def test_a_run_resumed_with_another_optimizer_is_one_line(make_config, tmp_path, capsys):
    """Adam's checkpoint, rerun with muon: its state cannot be muon's (a traceback before)."""
    from torchneox.cli import main

    cfg = make_config(train_iters=1)
    assert main(["train", cfg]) == 0
    muon = '{"type": "muon", "params": {"lr": 0.003}}'
    capsys.readouterr()
    assert main(["train", cfg, "--set", "train_iters=2", "--set", f"optimizer={muon}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its optimizer state does not fit this run's optimizer" in err
    assert "no_load_optim: true" in err
    assert main(["train", cfg, "--set", "train_iters=2", "--set", f"optimizer={muon}",
                 "--set", "no_load_optim=true"]) == 0  # fmt: skip
