"""Causal self-attention through scaled_dot_product_attention, with GQA and a KV cache.

On the CPU under bf16 or fp16 autocast, PyTorch's reduced-precision attention backward is
several times slower than its fp32 one at short sequences (at 64 positions and 32 dimensions
per head, 4x; past about 512 positions the reduced-precision kernel wins). ``cpu_attention``
chooses how training attention runs there: ``auto`` (the default) times both at the run's
shape once per machine (models/cpu_kernels.py: an fp32 verdict is timed again by the next run
that uses it) and, where fp32 is clearly faster (at least 10% in most rounds), casts
the queries, keys and values up (exactly: they are bf16 values) and the output back;
``fp32`` always, ``native`` never. Both kernels accumulate in fp32; outputs differ by bf16
rounding. Forward-only calls (evaluation, generation) are left as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from torchneox.models.args import ModelArgs
from torchneox.models.cpu_kernels import cached_verdict, fp32_attention_faster
from torchneox.models.linear import Linear
from torchneox.models.norms import HeadRMSNorm, build_norm
from torchneox.models.positions import apply_rotary

CPU_ATTENTION_CHOICES = ("auto", "fp32", "native")

Gather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Context parallelism: every rank's keys and values from this rank's (MLA: its latents and rotary
keys, [B, 1, T, *] each)."""


@dataclass
class AttentionBias:
    """What SDPA needs besides q, k, v: an explicit mask/bias or the causal flag (every mixer
    is handed it; the recurrent ones read only ``valid_BS``)."""

    mask: torch.Tensor | None
    """bool [B|1, 1, T, S] (True = attend) or float [B|1, H, T, S] added to the scores."""
    is_causal: bool
    gather: Gather | None = None
    """Context parallelism: the whole sequence's keys and values from this rank's."""
    valid_BS: torch.Tensor | None = None
    """[B, S] the real (not padding) positions of the cache and this forward's tokens, when
    some are padding (a recurrent mixer zeroes those inputs; attention has them in ``mask``)."""
    positions: tuple[torch.Tensor, torch.Tensor] | None = None
    """([T] the queries', [S] the keys' positions) where they are not the last T of 0..S
    (context parallelism, a static cache): a block-sparse layer's layout is taken there."""
    documents: torch.Tensor | None = None
    """[B, S] each key's document under inter_document_attention_masking (the call's tokens;
    under context parallelism the gathered keys, in gather order): a mamba mixer restarts its
    convolution and scan at each document's first token."""
    context_rank: int = 0
    """Context parallelism: this rank's place among the ranks (its chunks r and 2 cp - 1 - r)."""


@dataclass
class ContextShard:
    """This rank's part of a context-parallel micro-batch, as the model needs it: the sequence
    positions of its tokens, those of the keys ``gather`` returns (in the order it returns
    them), and the keys' documents under document masking."""

    index: torch.Tensor
    """[T_local] the positions in the whole sequence of this rank's tokens."""
    keys: torch.Tensor
    """[T] the positions of the gathered keys, in gather order."""
    length: int
    """The whole sequence's length."""
    gather: Gather
    key_segments: torch.Tensor | None = None
    """[B, T] each gathered key's document (inter_document_attention_masking)."""
    rank: int = 0
    """This rank's place among the context ranks."""

    @property
    def ranks(self) -> int:
        """The ranks that split the sequence (each holds as many of its tokens)."""
        return self.keys.numel() // self.index.numel()

    def with_key_segments(self, segments_BT: torch.Tensor) -> ContextShard:
        """This shard with the keys' documents, gathered from every rank's ``segments_BT``
        [B, T_local] (a pipeline stage's shard serves every micro-batch of a step; document
        numbers are exact in float32)."""
        s = segments_BT[:, None, :, None].float()
        keys, _ = self.gather(s, s)
        return dataclasses.replace(self, key_segments=keys[:, 0, :, 0].round().long())


def documents(tokens_BT: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, segments) of a packed batch: each token's document number in its row
    (an end-of-text token closes the document it ends) and its position inside it, from 0
    at the row's start and after every end-of-text."""
    is_eod = (tokens_BT == eod_id).long()
    segments = torch.cumsum(is_eod, dim=1) - is_eod
    index = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(tokens_BT)
    starts_here = torch.zeros_like(is_eod, dtype=torch.bool)
    starts_here[:, 0] = True
    starts_here[:, 1:] = is_eod[:, :-1].bool()
    start = torch.cummax(torch.where(starts_here, index, torch.zeros_like(index)), dim=1).values
    return index - start, segments


def kv_cache_widths(args: ModelArgs, tp: int = 1) -> tuple[int, int, int]:
    """(heads, key width, value width) one attention layer's cache keeps per token on each of
    ``tp`` tensor ranks: its key/value heads, or under MLA (mixers/mla.py) one latent and one
    rotary key, whole on every rank."""
    if args.mla:
        return 1, args.mla_kv_rank, args.mla_rope_dim
    return args.num_kv_heads // tp, args.head_dim, args.head_dim


class KVCache:
    """What decoding keeps between forwards: the keys and values of every attention layer,
    preallocated for ``max_len`` positions, and each recurrent layer's state (a mamba or RWKV
    mixer's, kept in ``states[layer]`` by the mixer itself and updated in place). Under
    tensor parallelism over ``tp`` ranks each rank's attention holds ``num_kv_heads // tp``
    of the heads, and so does its cache (MLA keeps its latents instead: ``kv_cache_widths``)."""

    def __init__(
        self,
        args: ModelArgs,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: int = 1,
    ):
        attention = [i for i in range(args.num_layers) if args.is_attention_layer(i)]
        self.slot_of = {layer: j for j, layer in enumerate(attention)}
        """Each attention layer's row of ``k`` and ``v``."""
        heads, k_dim, v_dim = kv_cache_widths(args, tp)
        shape = (len(attention), batch, heads, max_len)
        self.k = torch.zeros((*shape, k_dim), dtype=dtype, device=device)
        self.v = torch.zeros((*shape, v_dim), dtype=dtype, device=device)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        """A recurrent layer's state by layer index (empty before its first forward)."""
        self.length = 0
        self.max_len = max_len

    def update(
        self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k_BHTD.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        row = self.slot_of[layer]
        self.k[row, :, :, self.length : end] = k_BHTD
        self.v[row, :, :, self.length : end] = v_BHTD
        return self.k[row, :, :, :end], self.v[row, :, :, :end]

    def new_tokens(self, valid_BS: torch.Tensor, t: int) -> torch.Tensor:
        """[B, t] the columns of ``valid_BS`` (cache and new tokens) of this forward's tokens."""
        return valid_BS[:, -t:]

    def state(self, layer: int) -> dict[str, torch.Tensor]:
        """Recurrent layer ``layer``'s state (a dict its mixer fills on its first forward)."""
        return self.states.setdefault(layer, {})


class StaticKVCache(KVCache):
    """A cache whose shapes never change, for a decode loop that runs (or replays as a CUDA
    graph) without reading anything back to the host: each forward writes its keys at the
    device position ``slot`` and attends over all ``max_len`` positions, the unwritten ones
    masked (``Transformer`` builds that mask from ``queries`` and ``keys``)."""

    def __init__(self, args, batch, max_len, dtype, device, tp: int = 1):
        super().__init__(args, batch, max_len, dtype, device, tp)
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        self.keys = torch.arange(max_len, device=device)

    def queries(self, t: int) -> torch.Tensor:
        """[t] the positions in the cache of the tokens this forward writes."""
        return self.slot + torch.arange(t, device=self.slot.device)

    def update(
        self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index, row = self.queries(k_BHTD.shape[2]), self.slot_of[layer]
        self.k[row].index_copy_(2, index, k_BHTD)
        self.v[row].index_copy_(2, index, v_BHTD)
        return self.k[row], self.v[row]

    def new_tokens(self, valid_BS: torch.Tensor, t: int) -> torch.Tensor:
        return valid_BS.index_select(1, self.queries(t))  # every slot of the buffer

    def advance(self, t: int) -> None:
        self.slot += t


def valid_tokens(bias: AttentionBias, cache: KVCache | None, t: int) -> torch.Tensor | None:
    """[B, t] which of this forward's ``t`` tokens are real, not padding (None: all): what a
    recurrent mixer zeroes before it reads them."""
    if bias.valid_BS is None:
        return None
    return bias.valid_BS[:, -t:] if cache is None else cache.new_tokens(bias.valid_BS, t)


class Attention(nn.Module):
    cpu_fp32 = False
    """Training attention on the CPU under reduced-precision autocast runs in fp32
    (``set_cpu_attention``)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.head_dim = args.head_dim
        self.scale = args.attention_scale  # muP's 1/d (None: 1/sqrt(d))
        self.dropout = args.attention_dropout
        self.grouped = args.num_kv_heads != args.num_heads
        bias = args.attn_bias
        h, q_width, kv_width = (
            args.hidden_size,
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        self.wq = Linear(h, q_width, bias=bias)
        self.wk = Linear(h, kv_width, bias=bias)
        self.wv = Linear(h, kv_width, bias=bias)
        self.wo = Linear(q_width, h, bias=args.attn_out_bias)
        self.qk_norm_scope = args.qk_norm
        self.qk_norm = self.q_norm = self.k_norm = None
        if args.qk_norm == "neox":  # one norm for queries and keys (GPT-NeoX)
            self.qk_norm = _shared_qk_norm(args)
        elif args.qk_norm is not None:
            q_dim, k_dim = (
                (args.head_dim, args.head_dim) if args.qk_norm == "head" else (q_width, kv_width)
            )
            self.q_norm = build_norm(args.norm, q_dim, args.norm_eps, args.norm_bias)
            self.k_norm = build_norm(args.norm, k_dim, args.norm_eps, args.norm_bias)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q, k = self._queries_keys(x_BTD)
        v = self.wv(x_BTD).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if bias.gather is not None:  # context parallel: this rank's queries, every key
            k, v = bias.gather(k, v)
        return self.wo(self._attend(q, k, v, bias).transpose(1, 2).reshape(b, t, -1))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: AttentionBias
    ) -> torch.Tensor:
        """SDPA, in fp32 where ``cpu_fp32`` says so (see the module's text)."""
        mask, kw = bias.mask, {"is_causal": bias.is_causal, "enable_gqa": self.grouped}
        kw["dropout_p"] = self.dropout if self.training else 0.0
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.cpu_fp32 and q.device.type == "cpu" and torch.is_grad_enabled():
            autocast = torch.is_autocast_enabled("cpu")
            dtype = torch.get_autocast_dtype("cpu") if autocast else v.dtype
            if dtype != torch.float32:
                if mask is not None and mask.is_floating_point():
                    mask = mask.float()
                with torch.autocast("cpu", enabled=False):
                    out = F.scaled_dot_product_attention(
                        q.float(), k.float(), v.float(), attn_mask=mask, **kw
                    )
                return out.to(dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)

    def _queries_keys(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k, [B, heads, T, head_dim], normalised as use_qk_layernorm asks (before
        rotary). -1 heads: under tensor parallelism each rank holds a slice of the heads."""
        b, t, _ = x_BTD.shape
        q, k = self.wq(x_BTD), self.wk(x_BTD)
        if self.qk_norm_scope == "width":  # over all heads together (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, t, -1, self.head_dim), k.view(b, t, -1, self.head_dim)
        if self.qk_norm_scope == "head":  # each head over its dimensions (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2)


def _shared_qk_norm(args: ModelArgs) -> nn.Module:
    """GPT-NeoX's qk_layernorm: one module over [heads, head_dim] for both queries and keys,
    rmsnorm per head, layernorm over all the heads."""
    if args.norm == "rmsnorm":
        return HeadRMSNorm(args.num_heads, args.head_dim, args.norm_eps)
    shape = (args.num_heads, args.head_dim)
    return nn.LayerNorm(shape, eps=args.norm_eps, bias=args.norm_bias)


def cpu_attention_in_fp32(
    mode: str,
    dtype: torch.dtype,
    batch: int,
    args: ModelArgs,
    length: int,
    masked: bool,
    tp: int = 1,
) -> bool:
    """Whether training attention at this shape (``dtype`` autocast on the CPU, ``batch``
    sequences of ``length``, ``args``' heads split over ``tp`` ranks; ``masked``: by an
    explicit mask) runs in fp32 under ``mode`` (see the module's text)."""
    if mode not in CPU_ATTENTION_CHOICES:
        raise ValueError(f"cpu_attention must be one of {CPU_ATTENTION_CHOICES}, not {mode!r}")
    if mode != "auto" or dtype == torch.float32:
        return mode == "fp32" and dtype != torch.float32
    heads, kv_heads = args.num_heads // tp, max(1, args.num_kv_heads // tp)
    bucket = 1 << max(0, batch - 1).bit_length()
    shape = (bucket, heads, kv_heads, length, args.head_dim)
    name = f"attention {str(dtype).removeprefix('torch.')} " + "x".join(map(str, shape))
    name += " masked" if masked else " causal"
    return cached_verdict(name, lambda: fp32_attention_faster(dtype, *shape, masked))


def set_cpu_attention(model: nn.Module, fp32: bool) -> None:
    """Every attention layer of ``model`` computes training attention on the CPU in fp32
    (``fp32``) or in the autocast dtype."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.cpu_fp32 = fp32
