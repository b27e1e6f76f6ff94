"""The fp32 CPU linears on oneDNN: equal to F.linear to float tolerance, forward and backward,
and out of the way wherever they do not apply."""

import functools
import json

import pytest
import torch
import torch.nn.functional as F

from torchneox.models import cpu_kernels
from torchneox.models import linear as lin

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)


@pytest.fixture
def onednn():
    """``linear`` as a model with cpu_matmul: onednn runs it."""
    return functools.partial(lin.linear, mode="onednn")


def _both(ours, shape_x, out_features, bias, x_grad=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape_x, generator=g)
    w = torch.randn(out_features, shape_x[-1], generator=g) / shape_x[-1] ** 0.5
    b = torch.randn(out_features, generator=g) if bias else None
    grad = torch.randn(*shape_x[:-1], out_features, generator=g)
    results = []
    for fn in (ours, F.linear):
        xs = x.clone().requires_grad_(x_grad)
        ws = w.clone().requires_grad_(True)
        bs = b.clone().requires_grad_(True) if bias else None
        y = fn(xs, ws, bs)
        y.backward(grad)
        results.append((y, xs.grad, ws.grad, bs.grad if bias else None))
    return results


@pytest.mark.parametrize(
    "shape_x,out,bias",
    [((12, 64, 128), 384, True), ((7, 96), 50, False), ((2, 3, 5, 33), 17, True)],
)
def test_onednn_linear_equals_f_linear(onednn, shape_x, out, bias):
    ours, ref = _both(onednn, shape_x, out, bias)
    assert ours[0].shape == ref[0].shape
    for a, b in zip(ours, ref, strict=True):
        if b is None:
            assert a is None
        else:  # float tolerance at the tensor's scale (a weight gradient sums 768 rows)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6 * b.abs().max().item())


def test_input_without_grad_gets_none(onednn):
    ours, ref = _both(onednn, (4, 8), 6, True, x_grad=False)
    assert ours[1] is None and ref[1] is None
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-5, atol=1e-6)


def test_onednn_path_is_taken(onednn, monkeypatch):
    calls = []
    real = lin._mm
    monkeypatch.setattr(lin, "_mm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    onednn(x, w).sum().backward()
    assert len(calls) == 3  # forward, input gradient, weight gradient


@pytest.mark.parametrize("case", ["bf16", "autocast", "default", "empty"])
def test_falls_back_to_f_linear(onednn, monkeypatch, case):
    monkeypatch.setattr(lin, "_mm", lambda *a: pytest.fail("oneDNN path taken"))
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    if case == "bf16":
        onednn(x.bfloat16(), w.bfloat16())
    elif case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert onednn(x, w).dtype == torch.bfloat16
    elif case == "default":
        lin.linear(x, w, mode="default")
    else:
        assert onednn(x[:0], w).shape == (0, 5)


def test_auto_measures_once_per_machine_and_shape(monkeypatch, tmp_path):
    """auto: the faster kernel per shape, measured the first time and cached for every later
    process on the machine (the same kernels in a resumed run)."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "kernels.json"))
    monkeypatch.setattr(lin, "_verdicts", {})
    monkeypatch.setattr(cpu_kernels, "_timed_here", {})
    measured = []

    def fake(rows, k, n):
        measured.append((rows, k, n))
        return k == 128

    monkeypatch.setattr(lin, "measure_onednn_faster", fake)
    assert lin.onednn_selected(768, 128, 384, "auto")
    assert lin.onednn_selected(700, 128, 384, "auto")  # rows bucketed to 1024: no new timing
    assert not lin.onednn_selected(768, 512, 128, "auto")
    assert measured == [(1024, 128, 384), (1024, 512, 128)]
    # a later process: the cache; the oneDNN verdict timed once more (models/cpu_kernels.py)
    monkeypatch.setattr(lin, "_verdicts", {})
    monkeypatch.setattr(cpu_kernels, "_timed_here", {})
    monkeypatch.setattr(cpu_kernels, "second_timing", True)  # not a resumed run
    assert lin.onednn_selected(768, 128, 384, "auto")
    assert not lin.onednn_selected(1000, 512, 128, "auto")
    assert measured == [(1024, 128, 384), (1024, 512, 128), (1024, 128, 384)]
    assert len(json.loads((tmp_path / "kernels.json").read_text())) == 2
    assert lin.onednn_selected(1, 512, 128, "onednn") and not lin.onednn_selected(
        1, 1, 1, "default"
    )
    with pytest.raises(ValueError, match="cpu_matmul"):
        lin.onednn_selected(1, 1, 1, "mkl")


def test_measuring_a_shape_gives_a_verdict_and_leaves_the_rng_alone():
    before = torch.get_rng_state()
    assert lin.measure_onednn_faster(64, 32, 48).challenger in (True, False)
    # timed on fewer rows
    assert lin.measure_onednn_faster(4096, 1024, 1024).challenger in (True, False)
    assert torch.equal(before, torch.get_rng_state())


def test_config_key_selects_the_kernel(tmp_path, monkeypatch):
    from torchneox.config.load import load_config
    from torchneox.models.args import model_args
    from torchneox.models.transformer import build_model

    def model(matmul: str):
        cfg = tmp_path / f"{matmul}.yml"
        cfg.write_text(
            "num_layers: 1\nhidden_size: 16\nnum_attention_heads: 2\nseq_length: 8\n"
            f"cpu_matmul: {matmul}\n"
        )
        return build_model(model_args(load_config([cfg])))

    # a setting of each model, not of the process: two models keep their own
    default, onednn = model("default"), model("onednn")
    kernels = {m.cpu_matmul for m in default.modules() if isinstance(m, lin.Linear)}
    assert kernels == {"default"}
    assert {m.cpu_matmul for m in onednn.modules() if isinstance(m, lin.Linear)} == {"onednn"}
    calls = []
    real = lin._mm
    monkeypatch.setattr(lin, "_mm", lambda *a: calls.append(1) or real(*a))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    default(tokens)
    assert not calls
    onednn(tokens)
    layers = sum(isinstance(m, lin.Linear) for m in onednn.modules())
    assert len(calls) == layers + (onednn.output is None)  # and a tied head's product


def test_expanded_gradients_and_strided_inputs(onednn):
    """A sum's gradient reaches the layer expanded (stride 0); a transposed input is strided."""
    x = torch.randn(7, 5).t().requires_grad_(True)
    w = torch.randn(3, 7, requires_grad=True)
    onednn(x, w).sum().backward()
    ours = (x.grad, w.grad)
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    F.linear(x2, w2).sum().backward()
    torch.testing.assert_close(ours, (x2.grad, w2.grad), rtol=1e-5, atol=1e-6)


def test_the_output_takes_the_blocked_loss(onednn):
    """The logits are a view of a tensor with a history, as F.linear's: the blocked loss
    serves them (a policy's and its reference's log-probabilities then agree bit for bit)."""
    from torchneox.train.loss import _blockable

    x = torch.randn(2, 4, 8, requires_grad=True)
    logits = onednn(x, torch.randn(16, 8))
    assert _blockable(logits.reshape(-1, 16))
