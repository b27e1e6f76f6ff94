"""Position schemes: rotary (partial, rotate-half layout), ALiBi biases, sinusoidal tables.

Learned positions are a plain embedding in the transformer. Tables here are buffers that
``init_buffers`` fills, so that a model built on the meta device gets them on its real device.
"""

from __future__ import annotations

import math

import torch


def rotary_inv_freq(dims: int, base: float, scaling: tuple = ()) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)).float()
    return scale_inv_freq(inv, dict(scaling)) if scaling else inv


def scale_inv_freq(inv_freq: torch.Tensor, spec: dict) -> torch.Tensor:
    """Rotary frequencies under Hugging Face's rope scaling. ``linear``: every frequency divided
    by the factor (positions stretched). ``llama3`` (Llama 3.1): wavelengths longer than
    original_max_position_embeddings / low_freq_factor divided by the factor, shorter than
    .. / high_freq_factor kept, the ones between blended smoothly."""
    factor = spec["factor"]
    if spec["type"] == "linear":
        return inv_freq / factor
    low, high = spec["low_freq_factor"], spec["high_freq_factor"]
    context = spec["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def rotary_tables(
    dims: int, base: float, length: int, scaling: tuple = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [length, dims], for positions 0..length-1 (each frequency used twice)."""
    t = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(t, rotary_inv_freq(dims, base, scaling))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


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


def sinusoidal_table(dim: int, length: int) -> torch.Tensor:
    """[length, dim]: sin of every frequency, then cos of every frequency."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)
