"""RWKV-6 ("Finch"), as GPT-NeoX's megatron/model/rwkv/v6/rwkv.py builds it: a time mix (the
mixer) and a channel mix (the block's second sublayer), each after its own LayerNorm.

Time mix, per position t over the sequence (x_{-1} = 0; dx = x_{t-1} - x_t):

    m_* = tanh((x + dx * maa_x) W1) W2 (five low-rank mixes, for w k v r g)
    x_* = x + dx * (maa_* + m_*)
    r, k, v = R x_r, K x_k, V x_v       g = silu(G x_g)
    w = time_decay + tanh(x_w Wd1) Wd2  (a per-channel log-log decay)
    per head: y_t = r_t (u * k_t v_t^T + S),   S <- diag(exp(-exp(w_t))) S + k_t v_t^T
    out = O(GroupNorm(heads, eps 6.4e-4)(y) * g)

Channel mix: sigmoid(R x_r) * V(relu(K x_k)^2), with x_k, x_r token-shift mixes (maa_k, maa_r).

The WKV recurrence runs in chunks (``wkv``): within a chunk of CHUNK positions, products of
cumulative log decays (every exponent <= 0, so nothing overflows); across chunks, the state
carried - a Python loop per chunk, not per token. On CUDA, where flash-linear-attention is
installed, its chunked RWKV-6 kernel runs instead (``fla_wkv``).

Decoding keeps, in ``cache.state(layer)``: ``time_shift`` and ``channel_shift`` (each mix's
last input, [B, H]) and ``wkv`` ([B, heads, N, N], fp32), so each new token costs one step.
Padding (``bias.valid_BS``) is zeroed at each mix's input: a zero input gives k = v = 0, so a
padded position leaves the state as it was and the token after it shifts in zeros, as at the
start of a sequence.

GPT-NeoX's layer reads its [seq, batch, hidden] input as [batch, seq, hidden], so its shift
and recurrence run over the batch; here they run over the sequence (docs/migrating-from-gpt-neox.md).
"""

from __future__ import annotations

import math
from inspect import signature

import torch
from torch import nn
from torch.nn import functional as F

from torchneox.models.args import ModelArgs
from torchneox.models.init import InitFn
from torchneox.models.linear import Linear
from torchneox.models.mixers.attention import valid_tokens
from torchneox.models.mixers.state_passing import chunks_of, incoming, passes, shifted

TIME_MIX_EXTRA_DIM = 32
"""The rank of each of the five token-shift mixes (W1: hidden x 5*32, W2: 5 x 32 x hidden)."""
TIME_DECAY_EXTRA_DIM = 64
"""The rank of the data-dependent decay (Wd1: hidden x 64, Wd2: 64 x dim_att)."""
GROUP_NORM_EPS = 1e-5 * 8**2
"""GPT-NeoX's ln_x: (1e-5) * (8**2)."""
LAYER_NORM_EPS = 1e-5
"""ln1 and ln2 are torch's LayerNorm with its default eps, whatever ``norm`` says."""
CHUNK = 16


def wkv(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, H, T, N], final state [B, H, N, N]) of the RWKV-6 recurrence on ``r, k, v,
    log_decay`` [B, H, T, N] (``log_decay`` = -exp(w) <= 0), bonus ``u`` [H, N] and the state
    before the first position (None: zeros), in fp32."""
    b, h, t, n = r.shape
    r, k, v, log_decay = (x.float() for x in (r, k, v, log_decay))
    u = u.float()
    if state is None:
        state = r.new_zeros(b, h, n, n)
    size = min(chunk, t)
    pad = (-t) % size
    if pad:  # zeros at the end: k = v = 0 and a decay of 1 leave the state as it is
        r, k, v, log_decay = (F.pad(x, (0, 0, 0, pad)) for x in (r, k, v, log_decay))
    chunks = (t + pad) // size
    r, k, v, log_decay = (x.reshape(b, h, chunks, size, n) for x in (r, k, v, log_decay))
    upto = log_decay.cumsum(-2)  # c_t: the log decay from the chunk's start through t
    before = upto - log_decay  # c_{t-1}
    # within a chunk: y_t += sum_{s<t} (r_t . exp(c_{t-1} - c_s) k_s) v_s + (r_t . u k_t) v_t
    gap = before[..., :, None, :] - upto[..., None, :, :]  # [.., t, s, n], <= 0 where s < t
    earlier = torch.ones(size, size, dtype=torch.bool, device=r.device).tril(-1)
    gap = gap.masked_fill(~earlier[:, :, None], float("-inf"))
    scores = torch.einsum("bhcti,bhcsi,bhctsi->bhcts", r, k, gap.exp())
    y = scores @ v + (r * u[:, None, None] * k).sum(-1, keepdim=True) * v
    # across chunks: the state at each chunk's start, read out and carried
    r_read = r * before.exp()
    k_kept = k * (upto[..., -1:, :] - upto).exp()
    kept = upto[..., -1, :].exp()  # [b, h, chunks, n]: the whole chunk's decay
    reads = []
    for c in range(chunks):
        reads.append(r_read[:, :, c] @ state)
        state = kept[:, :, c, :, None] * state + k_kept[:, :, c].transpose(-1, -2) @ v[:, :, c]
    y = y + torch.stack(reads, dim=2)
    return y.reshape(b, h, chunks * size, n)[:, :, :t], state


def fla_wkv(r, k, v, log_decay, u, state):
    """flash-linear-attention's chunked RWKV-6 kernel on CUDA (inputs [B, H, T, N]), or None
    where it is not installed."""
    try:
        from fla.ops.rwkv6 import chunk_rwkv6
    except ImportError:
        return None
    # older releases default to [B, H, T, N] (head_first), newer ones take only [B, T, H, N]
    layout = {"head_first": False} if "head_first" in signature(chunk_rwkv6).parameters else {}
    y, final = chunk_rwkv6(
        *(x.to(r.dtype).transpose(1, 2).contiguous() for x in (r, k, v, log_decay)),
        u.to(r.dtype),
        scale=1.0,
        initial_state=state,
        output_final_state=True,
        **layout,
    )
    return y.transpose(1, 2).float(), final.float()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter split over tensor ranks (a DTensor), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _shifted(x: torch.Tensor, state: dict, name: str, cache) -> torch.Tensor:
    """x_{t-1} for every position (zeros, or the cached last input, before the first)."""
    first = state.get(name) if cache is not None else None
    first = torch.zeros_like(x[:, :1]) if first is None else first[:, None].to(x.dtype)
    previous = torch.cat([first, x[:, :-1]], dim=1)
    if cache is not None:
        _keep(state, name, x[:, -1])
    return previous


def _keep(state: dict, name: str, value: torch.Tensor) -> None:
    """Store a decoding state in place where it exists (a CUDA graph replays the same buffer)."""
    if name in state and state[name].shape == value.shape:
        state[name].copy_(value)
    else:
        state[name] = value.detach().clone()


def zero_padding(x_BTH: torch.Tensor, bias, cache) -> torch.Tensor:
    """``x`` with its padded positions zeroed."""
    valid = valid_tokens(bias, cache, x_BTH.shape[1])
    return x_BTH if valid is None else x_BTH * valid[..., None].to(x_BTH.dtype)


def _ratios(args: ModelArgs, layer: int) -> tuple[float, float]:
    """GPT-NeoX's (ratio_0_to_1, ratio_1_to_almost0) of a layer (one layer: 0 and 1)."""
    return layer / max(args.num_layers - 1, 1), 1.0 - layer / args.num_layers


def _previous(x: torch.Tensor, state: dict, name: str, cache, bias) -> torch.Tensor:
    """x_{t-1} at every position: under context parallelism a chunk's first takes the last
    input of the chunk before, from the rank that holds it."""
    if passes(bias, cache):
        return shifted(x, chunks_of(bias), bias)
    return _shifted(x, state, name, cache)


class TimeMix(nn.Module):
    passes_state = True
    """Under context parallelism it runs its own chunks and passes its shift and WKV state on
    (models/mixers/state_passing.py), never gathering the whole sequence."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        h, d = args.hidden_size, args.rwkv_dim_att
        self.heads = args.num_heads
        self.head_size = d // self.heads
        for name in ("x", "w", "k", "v", "r", "g"):
            setattr(self, f"time_maa_{name}", nn.Parameter(torch.empty(1, 1, h)))
        self.time_maa_w1 = nn.Parameter(torch.empty(h, TIME_MIX_EXTRA_DIM * 5))
        self.time_maa_w2 = nn.Parameter(torch.empty(5, TIME_MIX_EXTRA_DIM, h))
        self.time_decay = nn.Parameter(torch.empty(1, 1, d))
        self.time_decay_w1 = nn.Parameter(torch.empty(h, TIME_DECAY_EXTRA_DIM))
        self.time_decay_w2 = nn.Parameter(torch.empty(TIME_DECAY_EXTRA_DIM, d))
        self.time_faaaa = nn.Parameter(torch.empty(self.heads, self.head_size))
        self.receptance = Linear(h, d, bias=False)
        self.key = Linear(h, d, bias=False)
        self.value = Linear(h, d, bias=False)
        self.gate = Linear(h, d, bias=False)
        self.output = Linear(d, h, bias=False)
        self.out_norm = nn.GroupNorm(self.heads, d, eps=GROUP_NORM_EPS)
        self.tp = None
        """Tensor parallelism's collectives (parallel/families.py's ``Split``) when the mix is
        split over tensor ranks by heads."""

    def forward(self, x_BTH, rope=None, bias=None, cache=None) -> torch.Tensor:
        b, t, _ = x_BTH.shape
        state = cache.state(self.layer) if cache is not None else {}
        x = zero_padding(x_BTH, bias, cache)
        dx = _previous(x, state, "time_shift", cache, bias) - x
        low = torch.tanh((x + dx * self.time_maa_x) @ self.time_maa_w1)
        low = low.view(b * t, 5, TIME_MIX_EXTRA_DIM).transpose(0, 1)
        mw, mk, mv, mr, mg = torch.bmm(low, self.time_maa_w2).view(5, b, t, -1).unbind(0)
        xw = x + dx * (self.time_maa_w + mw)
        r = self.receptance(x + dx * (self.time_maa_r + mr))
        k = self.key(x + dx * (self.time_maa_k + mk))
        v = self.value(x + dx * (self.time_maa_v + mv))
        g = F.silu(self.gate(x + dx * (self.time_maa_g + mg)))
        low_w = torch.tanh(xw @ self.time_decay_w1)
        if self.tp is not None:  # every rank's heads read the decay's shared low-rank part
            low_w = self.tp.copy(low_w)
        w = _local(self.time_decay) + low_w @ _local(self.time_decay_w2)
        n = r.shape[-1] // self.head_size  # the heads this rank holds (all of them unsplit)
        heads = [z.view(b, t, n, self.head_size).transpose(1, 2) for z in (r, k, v)]
        log_decay = -torch.exp(w.float()).view(b, t, n, self.head_size).transpose(1, 2)
        if passes(bias, cache):
            y, final = self._passed(*heads, log_decay, bias)
        else:
            y, final = self._wkv(*heads, log_decay, state.get("wkv"))
        if cache is not None:
            _keep(state, "wkv", final)
        y = y.transpose(1, 2).reshape(b * t, -1)
        y = self._group_norm(y, n).view(b, t, -1).to(g.dtype)
        return self.output(y * g)

    def _group_norm(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        """ln_x over each of the ``heads`` this rank holds (its weight's part of them)."""
        if self.tp is None:
            return self.out_norm(y)
        norm = self.out_norm
        weight, bias = _local(norm.weight), _local(norm.bias)
        return F.group_norm(y, heads, weight, bias, norm.eps)

    def _passed(self, r, k, v, log_decay, bias):
        """Context parallelism ([B, heads, T, N] each): each of this rank's two chunks runs once
        from a zero state, giving its outputs, last state and whole decay; the states entering
        the chunks are composed over the ranks (one small all-gather), and each chunk's outputs
        gain what its entering state adds: r_t (decay over the chunk before t) h_in, the
        recurrence being linear in its state."""
        chunks = chunks_of(bias)
        spans = [[z[:, :, chunks.span(c)] for z in (r, k, v, log_decay)] for c in (0, 1)]
        runs = [self._wkv(*part, None) for part in spans]
        upto = [part[3].cumsum(2) for part in spans]  # the log decay from the chunk's start
        decay = [c[:, :, -1].exp()[..., None] for c in upto]  # (per key channel)
        last = torch.stack([final for _, final in runs], 1)
        entering = incoming(last, torch.stack(decay, 1), chunks, bias)
        ys = []
        with torch.autocast(r.device.type, enabled=False):  # the state's term in fp32
            for c, (r_c, _, _, log_decay_c) in enumerate(spans):
                read = r_c.float() * (upto[c] - log_decay_c).exp()  # r_t x decay through t - 1
                ys.append(runs[c][0] + read @ entering[:, c].float())
        return torch.cat(ys, 2), None

    def _wkv(self, r, k, v, log_decay, state):
        if r.is_cuda:
            out = fla_wkv(r, k, v, log_decay, _local(self.time_faaaa), state)
            if out is not None:
                return out
        with torch.autocast(r.device.type, enabled=False):  # the recurrence in fp32
            return wkv(r, k, v, log_decay, _local(self.time_faaaa), state)


class ChannelMix(nn.Module):
    passes_state = True
    """Under context parallelism its token shift reads the last input before each chunk from
    the rank that holds it (models/mixers/state_passing.py)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        h, f = args.hidden_size, args.rwkv_ffn_dim
        self.time_maa_k = nn.Parameter(torch.empty(1, 1, h))
        self.time_maa_r = nn.Parameter(torch.empty(1, 1, h))
        self.key = Linear(h, f, bias=False)
        self.receptance = Linear(h, h, bias=False)
        self.value = Linear(f, h, bias=False)

    def forward(self, x_BTH, rope=None, bias=None, cache=None) -> torch.Tensor:
        state = cache.state(self.layer) if cache is not None else {}
        x = zero_padding(x_BTH, bias, cache)
        dx = _previous(x, state, "channel_shift", cache, bias) - x
        k = torch.relu(self.key(x + dx * self.time_maa_k)) ** 2
        return torch.sigmoid(self.receptance(x + dx * self.time_maa_r)) * self.value(k)


def layer_norm(args: ModelArgs) -> nn.Module:
    """ln1 / ln2: torch's LayerNorm (eps 1e-5, with a bias), as GPT-NeoX builds them."""
    return nn.LayerNorm(args.hidden_size, eps=LAYER_NORM_EPS)


# ---------------------------------------------------------------- GPT-NeoX's initialisation


def _fill(values: torch.Tensor) -> InitFn:
    return lambda t, g=None: t.copy_(values.reshape(t.shape))


def _uniform(bound: float) -> InitFn:
    return lambda t, g=None: t.uniform_(-bound, bound, generator=g)


def _maa(args: ModelArgs, layer: int, name: str) -> torch.Tensor:
    """time_maa_* of the time mix (``name`` w, k, v, r, g, x) and channel mix (ffn_k, ffn_r)."""
    ratio_0_to_1, ratio_1_to_almost0 = _ratios(args, layer)
    ddd = torch.arange(args.hidden_size, dtype=torch.float32) / args.hidden_size
    if name == "v":
        return 1.0 - (torch.pow(ddd, ratio_1_to_almost0) + 0.3 * ratio_0_to_1)
    if name in ("r", "g"):
        return 1.0 - torch.pow(ddd, 0.5 * ratio_1_to_almost0)
    return 1.0 - torch.pow(ddd, ratio_1_to_almost0)


def _decay(args: ModelArgs, layer: int) -> torch.Tensor:
    ratio_0_to_1, _ = _ratios(args, layer)
    n = torch.arange(args.rwkv_dim_att, dtype=torch.float64) / (args.rwkv_dim_att - 1)
    return (-6 + 5 * n ** (0.7 + 1.3 * ratio_0_to_1)).float()


def _faaaa(args: ModelArgs, layer: int) -> torch.Tensor:
    ratio_0_to_1, _ = _ratios(args, layer)
    index = torch.arange(args.rwkv_dim_att, dtype=torch.float64)
    zigzag = ((index + 1) % 3 - 1) * 0.1
    return (ratio_0_to_1 * (1 - index / (args.rwkv_dim_att - 1)) + zigzag).float()


def init_rule(args: ModelArgs, layer: int, name: str) -> InitFn | None:
    """GPT-NeoX's initialisation of an RWKV layer's parameter ``name`` (after ``layers.{i}.``):
    the fixed curves of the mixes, decays and bonus, uniform(+-1e-4) low-rank weights, and the
    plain ``nn.Linear`` default (uniform +-1/sqrt(fan_in)) of every projection; the norms are
    ones and zeros (None: the model's rule does that)."""
    sub, _, rest = name.partition(".")
    param, _, leaf = rest.rpartition(".")
    if sub in ("time_mix", "channel_mix") and leaf == "weight" and param != "out_norm":
        return lambda t, g=None: _uniform(1 / math.sqrt(t.shape[1]))(t, g)
    if not rest.startswith("time_"):
        return None
    if rest in ("time_maa_w1", "time_maa_w2", "time_decay_w1", "time_decay_w2"):
        return _uniform(1e-4)
    if rest.startswith("time_maa_"):
        mix = rest.removeprefix("time_maa_")
        return _fill(_maa(args, layer, mix if sub == "time_mix" else "ffn"))
    if rest == "time_decay":
        return _fill(_decay(args, layer))
    if rest == "time_faaaa":
        return _fill(_faaaa(args, layer))
    return None
