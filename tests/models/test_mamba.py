"""Mamba's mixer: the parallel scan equals the plain recurrence, GPT-NeoX's initialisations,
decoding continues the recurrent state (left padding changes nothing), A_log never decays."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import build
from torchneox.inference.generate import Sampling, generate
from torchneox.models.mixers.attention import AttentionBias, KVCache, documents
from torchneox.models.mixers.mamba import kernels_installed, selective_scan
from torchneox.optim.builder import param_groups


def sequential_scan(u, dt, A, B, C, D, h):
    """The recurrence one position at a time, in float64 (the reference)."""
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * B[:, t, None]
        ys.append((h * C[:, t, None]).sum(-1) + D * u[:, t])
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("length,chunk", [(37, 8), (64, 64), (5, 16)])
def test_parallel_scan_equals_the_recurrence(length, chunk):
    g = torch.Generator().manual_seed(0)
    b, d, n = 2, 6, 16
    u = torch.randn(b, length, d, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, length, d, generator=g) * 3)  # up to ~10
    A = -torch.exp(torch.randn(d, n, generator=g))
    B, C = torch.randn(b, length, n, generator=g), torch.randn(b, length, n, generator=g)
    D, h0 = torch.randn(d, generator=g), torch.randn(b, d, n, generator=g)
    y, h = selective_scan(u, dt, A, B, C, D, h0, chunk=chunk)
    args = (u, dt, A, B, C, D, h0)
    y_ref, h_ref = sequential_scan(*(x.double() for x in args))
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-5, rtol=1e-5)


def scan_inputs(length: int, requires_grad: bool = False):
    g = torch.Generator().manual_seed(0)
    b, d, n = 2, 6, 16
    tensors = (
        torch.randn(b, length, d, generator=g),
        torch.nn.functional.softplus(torch.randn(b, length, d, generator=g)),
        -torch.exp(torch.randn(d, n, generator=g)),
        torch.randn(b, length, n, generator=g),
        torch.randn(b, length, n, generator=g),
        torch.randn(d, generator=g),
        torch.randn(b, d, n, generator=g),
    )
    return [t.requires_grad_(requires_grad) for t in tensors]


def test_the_scan_gradients_equal_the_recurrences():
    args = scan_inputs(40, requires_grad=True)
    y, h = selective_scan(*args, chunk=16)
    (y.square().sum() + h.sum()).backward()
    ours = [t.grad.clone() for t in args]
    ref = [t.detach().double().requires_grad_() for t in args]
    y_ref, h_ref = sequential_scan(*ref)
    (y_ref.square().sum() + h_ref.sum()).backward()
    for name, got, expected in zip(["u", "dt", "A", "B", "C", "D", "h0"], ours, ref, strict=True):
        torch.testing.assert_close(got.double(), expected.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_training_keeps_the_chunks_inputs_not_their_states():
    """What autograd saves for the scan is far less than the [B, T, d, n] states it computes
    (each chunk's states are recomputed in the backward)."""
    args = scan_inputs(256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        selective_scan(*args, chunk=64)
    states = 2 * 256 * 6 * 16
    assert sum(saved) < states


def test_gpt_neox_initialisation():
    _, model = build("mamba")
    mixer = model.layers["0"].mamba
    d = mixer.D.shape[0]
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1, 17.0)).expand(d, 16))
    assert torch.equal(mixer.D, torch.ones(d))
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    bound = mixer.dt_rank**-0.5  # ceil(64 / 16) = 4
    assert mixer.dt_rank == 4 and mixer.dt_proj.weight.abs().max() <= bound
    assert mixer.dt_proj.weight.abs().max() > 0.9 * bound
    assert mixer.conv1d.weight.abs().max() <= 0.5 and mixer.conv1d.bias.abs().max() <= 0.5
    # out_proj: output_layer_init_method (scaled_normal, 0.02 / sqrt(2 x 2 layers))
    assert mixer.out_proj.weight.std().item() == pytest.approx(0.01, rel=0.1)
    assert mixer.in_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_a_log_and_d_do_not_decay():
    _, model = build("mamba")
    decay = {id(p) for p in param_groups(model, 0.1)[0]["params"]}
    mixer = model.layers["0"].mamba
    assert id(mixer.A_log) not in decay and id(mixer.D) not in decay
    assert id(mixer.in_proj.weight) in decay


@pytest.mark.parametrize("variant", ["mamba", "mamba-global"])
def test_decoding_continues_the_state(variant):
    """A prefix, then one token at a time from the cache, gives the logits of one forward over
    the whole sequence."""
    _, model = build(variant)
    model.eval()
    tokens = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache(model.args, 2, 20, torch.float32, "cpu")
        steps = [model(tokens[:, :12], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-5, rtol=1e-5)
    assert cache.states[0]["ssm"].shape == (2, model.args.mamba_inner, 16)


@pytest.mark.parametrize("variant", ["mamba", "mamba-global"])
@pytest.mark.parametrize("loop", ["dynamic", "static"])
def test_recurrent_generation_equals_recomputation(variant, loop):
    """Prompts of different lengths (left-padded): decoding from the recurrent state gives the
    tokens of recomputing every prefix, and each prompt's tokens alone."""
    model = lively(variant)
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    cached = generate(model, prompts, Sampling(maximum_tokens=12, decode_loop=loop))
    recomputed = generate(model, prompts, Sampling(maximum_tokens=12, use_cache=False))
    alone = [generate(model, [p], Sampling(maximum_tokens=12))[0] for p in prompts]
    assert cached == recomputed == alone
    assert all(len(c) == 12 for c in cached)
    assert len({t for c in cached for t in c}) > len(prompts)  # not one token per row


def lively(variant: str):
    """A tiny model whose greedy tokens depend on what it has seen (at GPT-NeoX's init a
    tiny tied model repeats its last token)."""
    _, model = build(variant)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("in_proj.weight", "out_proj.weight", "embed.weight")):
                p.mul_(10)
    return model


def test_eval_mode_equals_training_mode_without_dropout():
    """GPT-NeoX's mamba asserts training mode; here it evaluates, with the same numbers."""
    _, model = build("mamba")
    tokens = torch.randint(0, 200, (2, 16))
    train = model.train()(tokens)
    with torch.no_grad():
        evaluated = model.eval()(tokens)
    torch.testing.assert_close(train.detach(), evaluated)
    assert math.isfinite(train.sum().item())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    from torchneox.parallel.activation_ckpt import apply_activation_checkpointing
    from torchneox.train.loss import lm_loss

    def grads(checkpointed: bool):
        _, model = build("mamba-global")
        if checkpointed:
            assert apply_activation_checkpointing(model, 1, mode) == 2
        tokens = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(1))
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:], None).backward()
        return {
            n.replace("_checkpoint_wrapped_module.", ""): p.grad
            for n, p in model.named_parameters()
        }

    plain, checkpointed = grads(False), grads(True)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_compiled_blocks_equal_eager():
    from torchneox.parallel.activation_ckpt import compile_blocks

    _, model = build("mamba")
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager = model(tokens)
        compile_blocks(model)
        compiled = model(tokens)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_a_decode_step_is_undone_before_a_cuda_graph_is_captured():
    """The static loop's warm-up steps (before capturing a CUDA graph) advance the recurrent
    states; snapshot puts them back in place, with the slot."""
    from torchneox.inference.generate import snapshot
    from torchneox.models.mixers.attention import StaticKVCache

    _, model = build("mamba-global")
    model.eval()
    cache = StaticKVCache(model.args, 2, 16, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.randint(0, 200, (2, 5)), cache=cache)
        before = {k: v.clone() for k, v in cache.states[0].items()}
        ssm = cache.states[0]["ssm"]
        put_back = snapshot(cache)
        model(torch.randint(0, 200, (2, 1)), cache=cache)
        assert not torch.equal(cache.states[0]["ssm"], before["ssm"])
        put_back()
    assert cache.slot.item() == 5 and cache.states[0]["ssm"] is ssm
    for name, value in before.items():
        assert torch.equal(cache.states[0][name], value), name


@pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels_installed()),
    reason="mamba-ssm / causal-conv1d's kernels run on CUDA where they are installed",
)
@pytest.mark.parametrize("fusion", [("scan",), ("conv",), ("scan", "conv"), ("inner",)])
def test_kernels_equal_the_pytorch_path(fusion):
    import dataclasses

    _, model = build("mamba")
    mixer = model.layers["0"].mamba.cuda()
    x = torch.randn(2, 40, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    bias = AttentionBias(None, is_causal=True)
    with torch.no_grad():
        ours = mixer(x, None, bias)
        mixer.fusion = dataclasses.replace(model.args, mamba_fusion=fusion).mamba_fusion
        fused = mixer(x, None, bias)
    torch.testing.assert_close(fused, ours, atol=1e-4, rtol=1e-4)


def test_document_masking_restarts_the_convolution_and_scan_at_every_document():
    """inter_document_attention_masking: a packed row (mamba and attention layers) computes
    what each of its documents computes alone (under context parallelism:
    tests/models/test_state_passing.py)."""
    model = lively("mamba-global").eval()
    eod = 0
    tokens = torch.randint(1, 200, (2, 24), generator=torch.Generator().manual_seed(2))
    tokens[0, [6, 7, 15]] = eod  # documents of 7, 1, 8 and 8 tokens; the second row: 11, 13
    tokens[1, 10] = eod
    positions, segments = documents(tokens, eod)
    with torch.no_grad():
        packed = model(tokens, positions_BT=positions, segments_BT=segments)
        for row, ends in ((0, [7, 8, 16, 24]), (1, [11, 24])):
            for start, end in zip([0, *ends[:-1]], ends, strict=True):
                alone = model(tokens[row : row + 1, start:end])
                torch.testing.assert_close(packed[row, start:end], alone[0], atol=1e-5, rtol=1e-5)
        unmasked = model(tokens, positions_BT=positions)
        assert not torch.allclose(unmasked[0, 8:], packed[0, 8:], atol=1e-3)

        block, x = model.layers["0"], torch.randn(2, 24, 64, generator=torch.Generator())
        whole = block.mamba(x, None, AttentionBias(None, True, documents=segments))
        first = block.mamba(x[:, :7], None, AttentionBias(None, True))
        torch.testing.assert_close(whole[0, :7], first[0], atol=1e-5, rtol=1e-5)
