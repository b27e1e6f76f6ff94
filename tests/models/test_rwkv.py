"""RWKV-6: the chunked WKV equals the recurrence written out token by token, the layers equal
GPT-NeoX's formulas (run over the sequence) and start from its initialisation, and decoding
with the recurrent state equals recomputing the whole prefix, left padding included.

The WKV is held both to the recurrence written out here from the formula and to
flash-linear-attention's ``naive_recurrent_rwkv6`` (fla-core, a dev extra; read from its own
file, since importing the fla package needs triton)."""

from __future__ import annotations

from importlib import metadata, util

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import build
from torchneox.base.errors import HFError
from torchneox.inference.generate import Sampling, generate
from torchneox.models.hf.architectures import export_architecture
from torchneox.models.mixers.attention import AttentionBias, KVCache
from torchneox.models.mixers.rwkv import wkv


def recurrent_wkv(r, k, v, log_decay, u, state=None):
    """y_t = r_t (u * k_t v_t^T + S);  S <- diag(exp(log_decay_t)) S + k_t v_t^T, per head."""
    b, h, t, n = r.shape
    s = torch.zeros(b, h, n, n, dtype=torch.float64) if state is None else state.double()
    ys = []
    for i in range(t):
        kv = k[:, :, i, :, None].double() * v[:, :, i, None, :].double()
        ys.append(torch.einsum("bhi,bhij->bhj", r[:, :, i].double(), u[..., None] * kv + s))
        s = log_decay[:, :, i, :, None].double().exp() * s + kv
    return torch.stack(ys, dim=2), s


@pytest.mark.parametrize("t", [1, 7, 16, 37])
def test_chunked_wkv_equals_the_recurrence(t):
    g = torch.Generator().manual_seed(t)
    b, h, n = 2, 3, 8
    r, k, v = (torch.randn(b, h, t, n, generator=g) for _ in range(3))
    # decays from almost none to strong (exp(w) up to e^2 per step: far past what a
    # factorised exp(+-cumsum) could hold in fp32 over a chunk)
    w = torch.rand(b, h, t, n, generator=g) * 8 - 6
    log_decay = -w.exp()
    u = torch.randn(h, n, generator=g)
    state = torch.randn(b, h, n, n, generator=g)
    inputs = [x.clone().requires_grad_() for x in (r, k, v, log_decay, u, state)]
    y, final = wkv(*inputs)
    ref_inputs = [x.double().clone().requires_grad_() for x in (r, k, v, log_decay, u, state)]
    y_ref, final_ref = recurrent_wkv(*ref_inputs)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.double(), final_ref, rtol=1e-4, atol=1e-4)
    # the gradients too (the chunked form is what trains)
    weights = torch.randn(y.shape, generator=g).double()
    ((y.double() * weights).sum() + final.double().sum()).backward()
    ((y_ref * weights).sum() + final_ref.sum()).backward()
    for ours, ref in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-3, atol=1e-3)


def fla_naive_rwkv6():
    """flash-linear-attention's naive_recurrent_rwkv6 (fla-core, the dev extra), read from its
    own file: importing the fla package needs triton, that file only torch."""
    try:
        dist = metadata.distribution("fla-core")
    except metadata.PackageNotFoundError:
        pytest.skip("fla-core (pip install -e .[dev]) is not installed")
    spec = util.spec_from_file_location(
        "fla_naive_rwkv6", dist.locate_file("fla/ops/rwkv6/recurrent_naive.py")
    )
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.naive_recurrent_rwkv6


@pytest.mark.parametrize("t", [5, 37])
def test_wkv_equals_flash_linear_attention_s_naive_reference(t):
    """The chunked WKV (what trains) and flash-linear-attention's reference recurrence give the
    same outputs and final state from random inputs and a random initial state."""
    naive = fla_naive_rwkv6()
    g = torch.Generator().manual_seed(100 + t)
    b, h, n = 2, 3, 8
    r, k, v = (torch.randn(b, h, t, n, generator=g) for _ in range(3))
    log_decay = -(torch.rand(b, h, t, n, generator=g) * 6 - 5).exp()  # fla's w: log of the decay
    u = torch.randn(h, n, generator=g)
    state = torch.randn(b, h, n, n, generator=g)
    y, final = wkv(r, k, v, log_decay, u, state)
    y_ref, final_ref = naive(
        r, k, v, log_decay, u, scale=1.0, initial_state=state, output_final_state=True
    )
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)


def neox_time_mix(m, x):
    """GPT-NeoX's RWKV_TimeMix.forward, token shift and WKV over the sequence (dim 1)."""
    b, t, _ = x.shape
    xx = F.pad(x, (0, 0, 1, -1)) - x
    xxx = torch.tanh((x + xx * m.time_maa_x) @ m.time_maa_w1).view(b * t, 5, -1).transpose(0, 1)
    mw, mk, mv, mr, mg = torch.bmm(xxx, m.time_maa_w2).view(5, b, t, -1).unbind(dim=0)
    r = (x + xx * (m.time_maa_r + mr)) @ m.receptance.weight.T
    k = (x + xx * (m.time_maa_k + mk)) @ m.key.weight.T
    v = (x + xx * (m.time_maa_v + mv)) @ m.value.weight.T
    g = F.silu((x + xx * (m.time_maa_g + mg)) @ m.gate.weight.T)
    xw = x + xx * (m.time_maa_w + mw)
    w = m.time_decay + torch.tanh(xw @ m.time_decay_w1) @ m.time_decay_w2
    heads = m.heads

    def split(z):
        return z.view(b, t, heads, -1).transpose(1, 2)

    y, _ = recurrent_wkv(split(r), split(k), split(v), -split(w).exp(), m.time_faaaa.double())
    y = y.float().transpose(1, 2).reshape(b * t, -1)
    y = F.group_norm(y, heads, m.out_norm.weight, m.out_norm.bias, eps=(1e-5) * (8**2))
    return (y.view(b, t, -1) * g) @ m.output.weight.T


def neox_channel_mix(m, x):
    xx = F.pad(x, (0, 0, 1, -1)) - x
    k = torch.relu((x + xx * m.time_maa_k) @ m.key.weight.T) ** 2
    return torch.sigmoid((x + xx * m.time_maa_r) @ m.receptance.weight.T) * (k @ m.value.weight.T)


def lively(model):
    """The model moved away from its init (near-zero low-rank weights; with tied embeddings
    greedy decoding then mostly repeats the input, whatever the mixers compute)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_layers_compute_gpt_neox_formulas_over_the_sequence():
    model = lively(build("rwkv")[1])
    x = torch.randn(2, 21, 64)
    block = model.layers["0"]
    with torch.no_grad():
        torch.testing.assert_close(
            block.time_mix(x, None, AttentionBias(None, True)), neox_time_mix(block.time_mix, x)
        )
        torch.testing.assert_close(
            block.channel_mix(x, None, AttentionBias(None, True)),
            neox_channel_mix(block.channel_mix, x),
        )
        # layer 0 normalises its input with ln1 first (GPT-NeoX: x = ln1(x), then x + att(ln1(x)))
        ln1, ln2 = block.time_mix_norm, block.channel_mix_norm
        h = ln1(x)
        h = h + neox_time_mix(block.time_mix, ln1(h))
        h = h + neox_channel_mix(block.channel_mix, ln2(h))
        torch.testing.assert_close(block(x, None, AttentionBias(None, True))[0], h)
        later = model.layers["1"]
        h = x + neox_time_mix(later.time_mix, later.time_mix_norm(x))
        h = h + neox_channel_mix(later.channel_mix, later.channel_mix_norm(h))
        torch.testing.assert_close(later(x, None, AttentionBias(None, True))[0], h)


def test_initialisation_is_gpt_neox_s():
    _, model = build("rwkv")
    layers, hidden, dim_att, heads = 2, 64, 64, 4
    for i in range(layers):
        tm, cm = model.layers[str(i)].time_mix, model.layers[str(i)].channel_mix
        ratio_0_to_1 = i / (layers - 1)
        ratio_1_to_almost0 = 1.0 - (i / layers)
        ddd = torch.ones(1, 1, hidden)
        for j in range(hidden):
            ddd[0, 0, j] = j / hidden
        expected = {
            "x": 1.0 - torch.pow(ddd, ratio_1_to_almost0),
            "w": 1.0 - torch.pow(ddd, ratio_1_to_almost0),
            "k": 1.0 - torch.pow(ddd, ratio_1_to_almost0),
            "v": 1.0 - (torch.pow(ddd, ratio_1_to_almost0) + 0.3 * ratio_0_to_1),
            "r": 1.0 - torch.pow(ddd, 0.5 * ratio_1_to_almost0),
            "g": 1.0 - torch.pow(ddd, 0.5 * ratio_1_to_almost0),
        }
        for name, value in expected.items():
            assert torch.equal(getattr(tm, f"time_maa_{name}").data, value), name
        decay_speed = torch.ones(dim_att)
        tmp = torch.zeros(dim_att)
        for n in range(dim_att):
            decay_speed[n] = -6 + 5 * (n / (dim_att - 1)) ** (0.7 + 1.3 * ratio_0_to_1)
            zigzag = ((n + 1) % 3 - 1) * 0.1
            tmp[n] = ratio_0_to_1 * (1 - (n / (dim_att - 1))) + zigzag
        assert torch.equal(tm.time_decay.data, decay_speed.reshape(1, 1, dim_att))
        assert torch.equal(tm.time_faaaa.data, tmp.reshape(heads, dim_att // heads))
        for name in ("k", "r"):
            torch.testing.assert_close(
                getattr(cm, f"time_maa_{name}").data, 1.0 - torch.pow(ddd, ratio_1_to_almost0)
            )
        for low_rank in (tm.time_maa_w1, tm.time_maa_w2, tm.time_decay_w1, tm.time_decay_w2):
            assert 0 < low_rank.abs().max() <= 1e-4
        # nn.Linear's default: uniform within 1/sqrt(fan_in)
        for linear in (tm.receptance, tm.key, tm.value, tm.gate, tm.output, cm.key, cm.value):
            bound = linear.weight.shape[1] ** -0.5
            assert bound * 0.9 < linear.weight.abs().max() <= bound
        assert torch.equal(tm.out_norm.weight.data, torch.ones(dim_att))
        assert model.layers[str(i)].time_mix_norm.eps == 1e-5


@pytest.mark.parametrize("variant", ["rwkv", "rwkv-global"])
def test_decoding_with_the_state_equals_recomputing(variant):
    _, model = build(variant)
    model.eval()
    tokens = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache(model.args, 2, 19, torch.float32, "cpu")
        steps = [model(tokens[:, :11], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(11, 19)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-4)
    # the state holds the shifts and the WKV state of every RWKV layer, nothing per position
    rwkv_layers = [i for i in range(2) if not model.args.is_attention_layer(i)]
    assert sorted(cache.states) == rwkv_layers
    for state in cache.states.values():
        assert sorted(state) == ["channel_shift", "time_shift", "wkv"]
        assert state["wkv"].shape == (2, 4, 16, 16)


@pytest.mark.parametrize("variant", ["rwkv", "rwkv-global"])
def test_generation_of_left_padded_prompts_equals_one_at_a_time_and_recomputing(variant):
    model = lively(build(variant)[1])
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    cached = generate(model, prompts, Sampling(maximum_tokens=10))
    recomputed = generate(model, prompts, Sampling(maximum_tokens=10, use_cache=False))
    static = generate(model, prompts, Sampling(maximum_tokens=10, decode_loop="static"))
    alone = [generate(model, [p], Sampling(maximum_tokens=10))[0] for p in prompts]
    assert cached == recomputed == static == alone
    assert all(len(c) == 10 for c in cached)
    assert len({t for c in cached for t in c}) > 2  # not one token repeated


@pytest.mark.parametrize("variant", ["rwkv", "rwkv-global"])
def test_left_padding_changes_nothing(variant):
    _, model = build(variant)
    model.eval()
    rows = [torch.randint(1, 256, (n,)) for n in (12, 5, 9)]
    padded = torch.zeros(3, 12, dtype=torch.long)
    valid = torch.zeros(3, 12, dtype=torch.bool)
    for i, row in enumerate(rows):
        padded[i, 12 - len(row) :], valid[i, 12 - len(row) :] = row, True
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    nxt = torch.randint(1, 256, (3, 1))
    with torch.no_grad():
        cache = KVCache(model.args, 3, 13, torch.float32, "cpu")
        batched = model(padded, positions_BT=positions, key_valid_BS=valid, cache=cache)
        valid = torch.cat([valid, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        step = model(nxt, positions_BT=positions[:, -1:] + 1, key_valid_BS=valid, cache=cache)
        for i, row in enumerate(rows):
            alone = model(torch.cat([row, nxt[i]])[None])[0]
            torch.testing.assert_close(batched[i, 12 - len(row) :], alone[:-1])
            torch.testing.assert_close(step[i, 0], alone[-1])


def test_export_to_hugging_face_says_in_one_line_that_rwkv_cannot_go():
    args = build("rwkv")[1].args
    with pytest.raises(HFError) as err:
        export_architecture(args)
    assert "RWKV-6 layers (transformers' Rwkv is RWKV-4" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-linear-attention runs on CUDA")
def test_flash_linear_attention_kernel_equals_the_chunked_path():
    pytest.importorskip("fla")
    from torchneox.models.mixers.rwkv import fla_wkv

    g = torch.Generator().manual_seed(0)
    b, h, t, n = 2, 4, 100, 64
    r, k, v = (torch.randn(b, h, t, n, generator=g) for _ in range(3))
    log_decay = -(torch.rand(b, h, t, n, generator=g) * 6 - 6).exp()
    u = torch.randn(h, n, generator=g)
    state = torch.randn(b, h, n, n, generator=g)
    y, final = wkv(r, k, v, log_decay, u, state)
    cuda = [x.cuda() for x in (r, k, v, log_decay, u, state)]
    y_fla, final_fla = fla_wkv(*cuda)
    torch.testing.assert_close(y_fla.cpu(), y, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(final_fla.cpu(), final, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_decoding_equals_recomputing():
    """The static loop's warm-up runs advance the recurrent state; it is put back before the
    captured step replays."""
    model = lively(build("rwkv")[1]).cuda()
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    graphed = generate(model, prompts, Sampling(maximum_tokens=10, decode_loop="static"))
    recomputed = generate(model, prompts, Sampling(maximum_tokens=10, use_cache=False))
    assert graphed == recomputed


def test_widths_follow_dim_att_and_intermediate_size():
    block = build("rwkv-widths")[1].layers["1"]
    assert block.time_mix.receptance.weight.shape == (128, 64)
    assert block.time_mix.time_faaaa.shape == (4, 32)
    assert block.channel_mix.key.weight.shape == (96, 64)  # 100 rounded down to 96


def test_the_recurrence_runs_in_fp32_under_bf16_autocast(monkeypatch):
    mix = lively(build("rwkv")[1]).layers["1"].time_mix
    seen = []

    def spy(*args, **kwargs):
        y, state = wkv(*args, **kwargs)
        seen.append((y.dtype, state.dtype, torch.is_autocast_enabled("cpu")))
        return y, state

    monkeypatch.setattr("torchneox.models.mixers.rwkv.wkv", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        mix(torch.randn(2, 40, 64), None, AttentionBias(None, True))
    assert seen == [(torch.float32, torch.float32, False)]
