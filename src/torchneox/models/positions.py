"""Position schemes: rotary (partial, rotate-half layout), ALiBi biases, sinusoidal tables.

Learned positions are a plain embedding in the transformer. Tables here are buffers that
``init_buffers`` fills, so that a model built on the meta device gets them on its real device.
"""

from __future__ import annotations

import math

import torch


def rotary_inv_freq(dims: int, base: float, scaling: tuple = (), length: int = 0) -> torch.Tensor:
    """The rotary frequencies, under ``scaling`` (``ModelArgs.rope_scaling``) when given;
    ``length`` is the sequence length dynamic scaling adapts to."""
    spec = dict(scaling)
    if spec.get("type") == "dynamic":
        base = dynamic_base(dims, base, spec, length)
    inv = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)).float()
    return scale_inv_freq(inv, spec, dims, base) if spec else inv


def dynamic_base(dims: int, base: float, spec: dict, length: int) -> float:
    """Dynamic NTK scaling: past original_max_position_embeddings the base grows with the
    sequence length (Hugging Face's ``dynamic`` rope); up to it nothing changes."""
    original = spec["original_max_position_embeddings"]
    if length <= original:
        return base
    factor = spec["factor"]
    return base * ((factor * length / original) - (factor - 1)) ** (dims / (dims - 2))


def scale_inv_freq(inv_freq: torch.Tensor, spec: dict, dims: int, base: float) -> torch.Tensor:
    """Rotary frequencies under Hugging Face's rope scaling. ``linear``: every frequency divided
    by the factor (positions stretched). ``llama3`` (Llama 3.1): wavelengths longer than
    original_max_position_embeddings / low_freq_factor divided by the factor, shorter than
    .. / high_freq_factor kept, the ones between blended smoothly. ``yarn``: frequencies that
    turn fewer than beta_slow times over the original context divided by the factor, more than
    beta_fast times kept, a linear ramp between (its attention factor scales the tables).
    ``dynamic`` changed the base instead."""
    kind, factor = spec["type"], spec.get("factor", 1.0)
    if kind == "dynamic":
        return inv_freq
    if kind == "linear":
        return inv_freq / factor
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, spec, dims, base)
    low, high = spec["low_freq_factor"], spec["high_freq_factor"]
    context = spec["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, spec: dict, dims: int, base: float) -> torch.Tensor:
    context = spec["original_max_position_embeddings"]
    fast, slow = spec.get("beta_fast") or 32.0, spec.get("beta_slow") or 1.0

    def dim_of(rotations: float) -> float:  # the dimension that turns this often over context
        return dims * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if spec.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / spec["factor"] * (1 - keep) + inv_freq * keep


def attention_factor(scaling: tuple) -> float:
    """YaRN's scale of cos and sin (attention_factor, else from factor and mscale); 1 for
    every other kind."""
    spec = dict(scaling)
    if spec.get("type") != "yarn":
        return 1.0
    if spec.get("attention_factor") is not None:
        return spec["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = spec["factor"]
    if spec.get("mscale") and spec.get("mscale_all_dim"):
        return mscale(factor, spec["mscale"]) / mscale(factor, spec["mscale_all_dim"])
    return mscale(factor)


def rotary_tables(
    dims: int, base: float, length: int, scaling: tuple = (), seq_len: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [length, dims], for positions 0..length-1 (each frequency used twice);
    ``seq_len`` is the sequence length dynamic scaling adapts to."""
    t = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(t, rotary_inv_freq(dims, base, scaling, seq_len))
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = attention_factor(scaling)
    return emb.cos() * scale, emb.sin() * scale


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x_BHTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dimensions of each head; cos/sin are [T, R] or [B, 1, T, R]."""
    r = cos_TR.shape[-1]
    rot, rest = x_BHTD[..., :r], x_BHTD[..., r:]
    cos, sin = cos_TR.to(x_BHTD.dtype), sin_TR.to(x_BHTD.dtype)
    rotated = rot * cos + _rotate_half(rot) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi head slopes (geometric, interleaved when heads are not a power of two)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def relative_position_buckets(
    distance: torch.Tensor, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's causal buckets of ``distance`` (query position - key position, >= 0 where a key
    may be seen): the first num_buckets / 2 distances exact, then logarithmic up to
    max_distance, every longer distance in the last bucket (GPT-NeoX's
    ParallelRelativePositionBias with causal=True)."""
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    far = (
        exact
        + (
            torch.log(n.float().clamp(min=1) / exact)
            / math.log(max_distance / exact)
            * (num_buckets - exact)
        ).long()
    )
    far = far.clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, far)


def sinusoidal_table(dim: int, length: int) -> torch.Tensor:
    """[length, dim]: sin of every frequency, then cos of every frequency."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)
