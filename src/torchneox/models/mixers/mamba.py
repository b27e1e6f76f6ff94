"""Mamba-1's mixer as GPT-NeoX computes it (megatron/model/mamba/mamba.py), on any device.

    xz = in_proj(x)                   h -> 2 d_inner, split into x and the gate z
    x = silu(conv1d(x))               depthwise, kernel 4, causal (3 positions of left padding)
    dt, B, C = x_proj(x)              d_inner -> dt_rank + 2 * 16
    dt = softplus(dt_proj(dt))        dt_rank -> d_inner, with its bias
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,   A = -exp(A_log)   [d_inner, 16] per sequence
    y_t = C_t . h_t + D x_t
    out = out_proj(y * silu(z))

d_inner is ``intermediate_size``, else ``expansion_factor`` (2) x hidden_size; dt_rank is
ceil(hidden_size / 16). The scan runs in fp32 (A_log, D and the dt bias are read in fp32) as
a parallel scan: the sequence is cut into chunks of ``CHUNK`` positions, each chunk scanned
by recursive doubling (log2(CHUNK) steps of elementwise products, so no decay is ever divided
or exponentiated past its own range), the state carried from chunk to chunk: a Python loop
over chunks, never over tokens. Training keeps only each chunk's inputs and recomputes its
states in the backward (as mamba-ssm's kernel does), so the [B, T, d_inner, 16] states are
never all held at once. On CUDA, where mamba-ssm and causal-conv1d are installed,
the fusion keys select their kernels for training forwards (``kernels``).

Decoding keeps ``conv`` (the last 3 inputs of the convolution) and ``ssm`` (the state h) in
``cache.state(layer)``; a forward with a cache continues from them, so generation runs one
token at a time without recomputing the prefix. Padding (``bias.valid_BS``) is zeroed before
and after the convolution, so a left-padded sequence's state is the unpadded one's.

Under ``inter_document_attention_masking`` (``bias.documents``) the mixer restarts at every
document of a packed sample: the convolution reads only the inputs of the position's own
document, and the scan's decay is 0 at a document's first token, so each document computes
what it would alone. (GPT-NeoX's mamba reads a packed sample as one sequence.) Such a
forward takes this file's scan even where mamba-ssm is installed: its Mamba-1 selective scan
takes no document boundaries.

Under context parallelism (``bias.gather``) the mixer runs only this rank's two chunks of the
sequence (models/mixers/state_passing.py). The scan being linear in its state, each chunk's
last state from a zero state is a weighted sum of its inputs (``last_state``, without a scan);
the ranks pass those on, and each chunk is scanned once, from the state entering it (composed
from the chunks before it). It takes this file's scan on CUDA too: mamba-ssm's selective scan
takes no entering state.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from torchneox.models.args import ModelArgs
from torchneox.models.init import InitFn, init_function
from torchneox.models.linear import Linear
from torchneox.models.mixers.attention import AttentionBias, KVCache, valid_tokens
from torchneox.models.mixers.state_passing import chunks_of, halo, incoming, passes

D_STATE = 16
"""The state's size per channel (GPT-NeoX's d_state)."""
D_CONV = 4
"""The convolution's width (GPT-NeoX's d_conv)."""
CHUNK = 64
"""Positions scanned together by recursive doubling."""
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4
"""GPT-NeoX's dt initialisation: log-uniform in [DT_MIN, DT_MAX], clamped at DT_FLOOR."""


@functools.cache
def kernels_installed() -> bool:
    """Whether mamba-ssm and causal-conv1d can be imported (never imported here)."""
    return all(importlib.util.find_spec(m) is not None for m in ("mamba_ssm", "causal_conv1d"))


def scan_chunk(
    decay: torch.Tensor, inputs: torch.Tensor, h0: torch.Tensor
) -> torch.Tensor:  # fmt: skip
    """The states h_t = decay_t * h_{t-1} + inputs_t of one chunk ([B, L, d, n] each; h0:
    [B, d, n]) by recursive doubling: after the step of span k every position holds the
    composition of the k (then 2k) steps that end there."""
    first = decay[:, :1] * h0[:, None] + inputs[:, :1]
    h = torch.cat([first, inputs[:, 1:]], 1)
    a, k, length = decay, 1, decay.shape[1]
    while k < length:
        h = torch.cat([h[:, :k], a[:, k:] * h[:, :-k] + h[:, k:]], 1)
        a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], 1)
        k *= 2
    return h


def selective_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h0: torch.Tensor,
    chunk: int = CHUNK,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, T, d], last state [B, d, n]) of the selective scan in fp32: u and dt (already
    through softplus) [B, T, d], A [d, n], B and C [B, T, n], D [d], h0 [B, d, n]; ``keep``
    [B, T]: 0 where the state restarts (a document's first token), 1 where it carries on."""
    u, dt, B, C = u.float(), dt.float(), B.float(), C.float()
    ys, h = [], h0.float()
    for start in range(0, u.shape[1], chunk):
        part = slice(start, start + chunk)
        kept = keep[:, part] if keep is not None else None
        args = (u[:, part], dt[:, part], A, B[:, part], C[:, part], h, kept)
        if torch.is_grad_enabled():  # keep the chunk's inputs, recompute its states backward
            y, h = checkpoint(_scan_part, *args, use_reentrant=False)
        else:
            y, h = _scan_part(*args)
        ys.append(y)
    return torch.cat(ys, 1) + u * D.float(), h


def last_state(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    keep: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """[B, d, n] the state a scan from a zero state ends in, without running the scan (the
    scan being linear): the sum over t of exp(A (dt_{t+1} + ... + dt_L)) dt_t u_t B_t, from the
    last document start on (``keep``), in fp32. The decays since each position are summed from
    the end (no difference of large sums), ``chunk`` positions at a time, each recomputed in the
    backward, so no [B, L, d, n] tensor is held for more than one."""
    u, dt, B = u.float(), dt.float(), B.float()
    after = torch.flip(torch.cumsum(torch.flip(dt, [1]), 1), [1])  # dt_t + ... + dt_L
    after = F.pad(after[:, 1:], (0, 0, 0, 1))  # dt_{t+1} + ... + dt_L
    weight = dt * u
    if keep is not None:  # nothing from before a document that starts after t
        alive = torch.flip(torch.cumprod(torch.flip(keep, [1]), 1), [1])
        weight = weight * F.pad(alive[:, 1:], (0, 1), value=1.0)[..., None]
    total = None
    for start in range(0, u.shape[1], chunk):
        part = slice(start, start + chunk)
        args = (weight[:, part], after[:, part], A, B[:, part])
        if torch.is_grad_enabled():
            term = checkpoint(_last_part, *args, use_reentrant=False)
        else:
            term = _last_part(*args)
        total = term if total is None else total + term
    return total


def _last_part(
    weight: torch.Tensor, after: torch.Tensor, A: torch.Tensor, B: torch.Tensor
) -> torch.Tensor:  # fmt: skip
    return torch.einsum("bldn,bln->bdn", torch.exp(after[..., None] * A) * weight[..., None], B)


def _scan_part(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (y without the D skip [B, L, d], its last state)."""
    decay = torch.exp(dt[..., None] * A)  # [B, L, d, n], in (0, 1]
    if keep is not None:  # a document's first token: nothing of the state before it
        decay = decay * keep[:, :, None, None]
    inputs = (dt * u)[..., None] * B[:, :, None, :]
    states = scan_chunk(decay, inputs, h0)
    return torch.einsum("bldn,bln->bld", states, C), states[:, -1]


class Mamba(nn.Module):
    """GPT-NeoX's ParallelMambaBlock: parameters in_proj, conv1d, x_proj, dt_proj, A_log, D,
    out_proj (transformers' MambaMixer's names)."""

    passes_state = True
    """Under context parallelism it runs its own chunks and passes its state on (no gather of
    the whole sequence: models/block.py)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        h, d, r = args.hidden_size, args.mamba_inner, args.mamba_dt_rank
        self.dt_rank = r
        self.fusion = args.mamba_fusion
        self.gather_fp32 = args.mamba_fp32_params
        """ZeRO gathers this mixer's weights in fp32 (A_log and D stay fp32)."""
        bias = args.mamba_linear_bias
        self.in_proj = Linear(h, 2 * d, bias=bias)
        self.conv1d = nn.Conv1d(d, d, D_CONV, groups=d, bias=args.mamba_conv_bias)
        self.x_proj = Linear(d, r + 2 * D_STATE, bias=bias)
        self.dt_proj = Linear(r, d, bias=True)
        self.A_log = nn.Parameter(torch.empty(d, D_STATE))
        self.D = nn.Parameter(torch.empty(d))
        self.out_proj = Linear(d, h, bias=bias)
        self.tp = None
        """Tensor parallelism's collectives (parallel/families.py's ``Split``) when the mixer
        is split over tensor ranks by channels."""

    def forward(
        self,
        x_BTH: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        if passes(bias, cache):  # context parallelism: this rank's chunks, the state passed on
            return self._context_parallel(x_BTH, bias)
        t = x_BTH.shape[1]
        valid, docs = valid_tokens(bias, cache, t), bias.documents
        if cache is None and valid is None and docs is None and self._kernel_ready(x_BTH):
            return self._fused(x_BTH)
        state = cache.state(self.layer) if cache is not None else None
        x, z = self._x_and_gate(x_BTH)
        x = self._conv(_masked(x, valid), state, docs)
        x = _masked(x, valid)
        dt, B, C = self._dt_B_C(x)
        with torch.autocast(x.device.type, enabled=False):
            A = -torch.exp(_local(self.A_log).float())
            h0 = state.get("ssm") if state is not None else None
            if h0 is None:
                h0 = x.new_zeros(x.shape[0], *A.shape, dtype=torch.float32)
            keep = _same_document(docs) if docs is not None else None
            y, h = selective_scan(x, dt, A, B, C, _local(self.D), h0, keep=keep)
            y = y * F.silu(z.float())
        if state is not None:
            _keep(state, "ssm", h)
        return self.out_proj(y.to(x.dtype))

    def _dt_B_C(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt (through dt_proj and softplus, fp32), B and C of the convolution's output."""
        dt_B_C = self.x_proj(x)
        if self.tp is not None:  # every rank's channels read dt, B and C
            dt_B_C = self.tp.copy(dt_B_C)
        dt, B, C = dt_B_C.split([self.dt_rank, D_STATE, D_STATE], dim=-1)
        with torch.autocast(x.device.type, enabled=False):
            w, b = _local(self.dt_proj.weight).float(), _local(self.dt_proj.bias).float()
            dt = dt.float()
            term = self.dt_proj.adapter_term(dt)  # LoRA's, in fp32 as the product
            dt = F.linear(dt, w, b)
            return F.softplus(dt if term is None else dt + term), B, C

    def _context_parallel(self, x_BTH: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
        """This rank's two chunks of each sequence (models/mixers/state_passing.py): the
        convolution reads the 3 inputs before each chunk from the rank that holds them, each
        chunk's last state from a zero state (``last_state``, no scan) and whole decay go to
        every rank, and each chunk is scanned once, from the state entering it."""
        chunks = chunks_of(bias)
        x, z = self._x_and_gate(x_BTH)
        before = halo(x, D_CONV - 1, chunks, bias)
        docs = chunks.documents
        convolved, keeps = [], []
        if docs is not None:  # (the whole sequence's: each chunk takes its part)
            keep, padded = _same_document(docs), F.pad(docs, (D_CONV - 1, 0), value=-1)
        for k, chunk in enumerate(chunks.mine):
            start, mine = chunks.starts(chunk), x[:, chunks.span(k)]
            if docs is None:
                convolved.append(self._conv(mine, None, None, before[:, k]))
                keeps.append(None)
                continue
            own, ahead = docs[:, start : start + chunks.size], padded[:, start : start + D_CONV - 1]
            convolved.append(self._conv(mine, None, own, before[:, k], ahead))
            keeps.append(keep[:, start : start + chunks.size])
        x = torch.cat(convolved, 1)
        dt, B, C = self._dt_B_C(x)
        with torch.autocast(x.device.type, enabled=False):
            A, D = -torch.exp(_local(self.A_log).float()), _local(self.D)
            spans = [chunks.span(k) for k in (0, 1)]
            args = [(x[:, s], dt[:, s], A, B[:, s], C[:, s], D) for s in spans]
            last = [
                last_state(x[:, s], dt[:, s], A, B[:, s], keeps[k]) for k, s in enumerate(spans)
            ]
            decay = [_chunk_decay(dt[:, spans[k]], A, keeps[k]) for k in (0, 1)]
            entering = incoming(torch.stack(last, 1), torch.stack(decay, 1), chunks, bias)
            ys = [selective_scan(*args[k], entering[:, k], keep=keeps[k])[0] for k in (0, 1)]
            y = torch.cat(ys, 1) * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))

    def _x_and_gate(self, x_BTH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj's x and z (split over tensor ranks: this rank's channels of each)."""
        xz = self.in_proj(x_BTH)
        if self.tp is None:
            return xz.chunk(2, dim=-1)
        x, z = self.tp.parts(self.tp.copy(self.tp.whole(xz)), 2)
        return x, z

    def _conv(
        self,
        x_BTD: torch.Tensor,
        state: dict | None,
        docs_BT: torch.Tensor | None = None,
        halo_BKD: torch.Tensor | None = None,
        halo_docs_BK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """silu(causal depthwise conv) of x, continuing from the state's last inputs (or a
        context-parallel chunk's ``halo_BKD``, the inputs just before it, of documents
        ``halo_docs_BK``); with ``docs_BT`` each position reads only its own document's."""
        x = x_BTD.transpose(1, 2)
        if halo_BKD is not None:
            before = halo_BKD.transpose(1, 2).to(x.dtype)
        elif state:
            before = state["conv"].to(x.dtype)
        else:
            before = x.new_zeros(x.shape[0], x.shape[1], D_CONV - 1)
        x = torch.cat([before, x], dim=-1)
        if state is not None:
            _keep(state, "conv", x[..., -(D_CONV - 1) :])
        w, b = _local(self.conv1d.weight), _local(self.conv1d.bias)
        if docs_BT is None:
            return F.silu(F.conv1d(x, w, b, groups=w.shape[0])).transpose(1, 2)
        windows = x.unfold(-1, D_CONV, 1)  # [B, d, T, D_CONV]: window t ends at position t
        if halo_docs_BK is None:
            docs = F.pad(docs_BT, (D_CONV - 1, 0), value=-1).unfold(-1, D_CONV, 1)
        else:
            docs = torch.cat([halo_docs_BK, docs_BT], 1).unfold(-1, D_CONV, 1)
        same = (docs == docs_BT[..., None]).to(x.dtype)  # [B, T, D_CONV]
        out = (windows * same[:, None] * w[:, 0][None, :, None]).sum(-1)
        out = out if b is None else out + b[None, :, None]
        return F.silu(out).transpose(1, 2)

    def _kernel_ready(self, x: torch.Tensor) -> bool:
        """Whether mamba-ssm's kernels run the forward: they read x_proj's, dt_proj's and
        out_proj's weights themselves, so a LoRA adapter on one of them takes the plain path
        (and so does a tensor-parallel split)."""
        adapted = any("lora_A" in m._modules for m in (self.x_proj, self.dt_proj, self.out_proj))
        ready = bool(self.fusion) and x.is_cuda and kernels_installed()
        return ready and self.tp is None and not adapted

    def _fused(self, x_BTH: torch.Tensor) -> torch.Tensor:
        """The forward through mamba-ssm's and causal-conv1d's kernels, as the fusion keys
        select them (mamba_inner_func_fusion: the whole mixer in one)."""
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn

        A = -torch.exp(self.A_log.float())
        xz = self.in_proj(x_BTH).transpose(1, 2)  # [B, 2d, T]
        conv_w = self.conv1d.weight.squeeze(1)
        if "inner" in self.fusion:  # (validation refuses it with biases in the linears)
            return mamba_inner_fn(
                xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight,
                self.dt_proj.weight, self.out_proj.weight, self.out_proj.bias, A, None, None,
                self.D.float(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            )  # fmt: skip
        x, z = xz.chunk(2, dim=1)
        if "conv" in self.fusion or "inner" in self.fusion:
            x = causal_conv1d_fn(x, conv_w, self.conv1d.bias, activation="silu")
        else:
            x = self._conv(x.transpose(1, 2), None).transpose(1, 2)
        dt, B, C = self.x_proj(x.transpose(1, 2)).split([self.dt_rank, D_STATE, D_STATE], -1)
        dt = (dt @ self.dt_proj.weight.t().to(dt.dtype)).transpose(1, 2)
        B, C = B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous()
        if "scan" in self.fusion or "inner" in self.fusion:
            y = selective_scan_fn(
                x, dt.contiguous(), A, B, C, self.D.float(), z=z,
                delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
            )  # fmt: skip
        else:
            with torch.autocast("cuda", enabled=False):
                dt = F.softplus(dt.float() + self.dt_proj.bias.float()[:, None])
                h0 = x.new_zeros(x.shape[0], *A.shape, dtype=torch.float32)
                y, _ = selective_scan(
                    x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2),
                    C.transpose(1, 2), self.D, h0,
                )  # fmt: skip
                y = (y * F.silu(z.transpose(1, 2).float())).transpose(1, 2)
        return self.out_proj(y.transpose(1, 2).to(x_BTH.dtype))


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a parameter split over tensor ranks (a DTensor), else ``t``; its
    gradient goes to that part."""
    return t.to_local() if hasattr(t, "to_local") else t


def _chunk_decay(dt: torch.Tensor, A: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """[B, d, n] what a chunk's scan does to the state entering it: exp(A x the chunk's dt),
    or nothing of it where a document starts in the chunk."""
    decay = torch.exp(dt.sum(1)[..., None] * A)
    return decay if keep is None else decay * keep.prod(1)[:, None, None]


def _same_document(docs_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] float: 1 where a token is of the document before it (and at 0), 0 where one
    starts."""
    keep = torch.ones(docs_BT.shape, dtype=torch.float32, device=docs_BT.device)
    keep[:, 1:] = (docs_BT[:, 1:] == docs_BT[:, :-1]).float()
    return keep


def _masked(x_BTD: torch.Tensor, valid_BT: torch.Tensor | None) -> torch.Tensor:
    return x_BTD if valid_BT is None else x_BTD * valid_BT[..., None].to(x_BTD.dtype)


def _keep(state: dict, name: str, value: torch.Tensor) -> None:
    """Store a decoding state in place once it exists (a captured CUDA graph reads it there)."""
    value = value.detach()
    if name in state and state[name].shape == value.shape:
        state[name].copy_(value)
    else:
        state[name] = value.clone()


def init_rule(args: ModelArgs, name: str) -> InitFn | None:
    """GPT-NeoX's initialisations of a mamba layer's parameters (``name`` after
    ``layers.{i}.``): A_log = log(1..16) per channel, D = 1, dt_proj's weight uniform in
    +-dt_rank^-0.5 and its bias the inverse softplus of a log-uniform dt, conv1d PyTorch's
    default (uniform in +-1/sqrt(4)), out_proj output_layer_init_method; the rest (in_proj,
    x_proj: init_method; biases zero) the model's rule."""
    rules = {
        "mamba.A_log": _a_log,
        "mamba.D": lambda t, g=None: t.fill_(1.0),
        "mamba.dt_proj.weight": _uniform(args.mamba_dt_rank**-0.5),
        "mamba.dt_proj.bias": _dt_bias,
        "mamba.conv1d.weight": _uniform(1 / math.sqrt(D_CONV)),
        "mamba.conv1d.bias": _uniform(1 / math.sqrt(D_CONV)),
    }
    if name == "mamba.out_proj.weight":
        m = args.output_init_method
        return init_function(m, args.init_std, args.num_layers, args.hidden_size)
    return rules.get(name)


def _a_log(t: torch.Tensor, g: torch.Generator | None = None) -> None:
    n = torch.arange(1, t.shape[-1] + 1, dtype=torch.float32, device=t.device)
    t.copy_(torch.log(n).expand_as(t))


def _uniform(bound: float) -> InitFn:
    return lambda t, g=None: nn.init.uniform_(t, -bound, bound, generator=g)


def _dt_bias(t: torch.Tensor, g: torch.Generator | None = None) -> None:
    r = torch.rand(t.shape, generator=g, dtype=torch.float32, device=t.device)
    dt = torch.exp(r * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
    dt = dt.clamp(min=DT_FLOOR)
    t.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus's inverse
