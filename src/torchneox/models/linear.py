"""The model's linear layers, and which CPU kernel runs their fp32 matrix multiplies.

On the CPU, PyTorch runs an fp32 ``F.linear`` (and its two backward products) through MKL's
sgemm. On AMD processors MKL takes a generic code path: with AVX-512, oneDNN (also inside
PyTorch) runs the same products about twice as fast; with AVX2 only, oneDNN wins on large
products and loses on small ones. ``cpu_matmul``, a setting of each model (its linear layers carry it), chooses:

- ``auto`` (the default): per product shape (rows rounded up to a power of two, inner and
  output widths), the faster of the two, measured on the forward and both backward products
  the first time the shape is met, oneDNN only when it is clearly faster (at least 10%, in
  most of several interleaved rounds; never slower than PyTorch's own choice). The verdicts
  are cached per machine (models/cpu_kernels.py), a oneDNN verdict timed once more by the
  next fresh run that uses it (and corrected there, with a line, where the default wins), and
  read, not measured again, by every later run: a resumed run computes with the kernels of
  the run it continues, so it still equals an uninterrupted one bit for bit.
- ``onednn``: oneDNN wherever PyTorch was built with it.
- ``default``: PyTorch's own choice, as before.

oneDNN serves only plain fp32 CPU tensors outside autocast and ``torch.compile``: a layer the
tensor-parallel plan splits (it marks them: ``Linear.split``), bf16 or fp16 autocast (already
oneDNN in PyTorch), a GPU and a compiled graph all take ``F.linear``. The two kernels agree to float tolerance, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchneox.models.cpu_kernels import Verdict, cached_verdict, compare

CPU_MATMUL_CHOICES = ("auto", "onednn", "default")
_verdicts: dict[tuple[int, int, int], bool] = {}  # auto's measurements, by (rows bucket, k, n)


def onednn_selected(rows: int, k: int, n: int, mode: str) -> bool:
    """Whether an fp32 CPU product of [rows, k] by [k, n] runs on oneDNN under ``mode``
    (a model's ``cpu_matmul``); auto's verdicts are measured once per machine and shape."""
    if mode not in CPU_MATMUL_CHOICES:
        raise ValueError(f"cpu_matmul must be one of {CPU_MATMUL_CHOICES}, not {mode!r}")
    if mode == "default" or not torch.backends.mkldnn.is_available():
        return False
    if mode == "onednn":
        return True
    key = (1 << max(0, rows - 1).bit_length(), k, n)
    if key not in _verdicts:
        name = "x".join(map(str, key))
        _verdicts[key] = cached_verdict(name, lambda: measure_onednn_faster(*key))
    return _verdicts[key]


def measure_onednn_faster(rows: int, k: int, n: int) -> Verdict:
    """Whether oneDNN runs a linear's three products (forward, input and weight gradients) at
    this shape clearly faster than the default kernel (``compare``, models/cpu_kernels.py).
    Large shapes are timed on fewer rows (at least 256: fewer would time a different,
    matrix-vector regime)."""
    rows = min(rows, max(256, int(2e9 // (6 * k * n))))
    g = torch.Generator().manual_seed(0)  # its own: the global RNG is left alone
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    grad = torch.randn(rows, n, generator=g)
    with torch.no_grad():
        return compare(
            lambda: (F.linear(x, w), grad.mm(w), grad.t().mm(x)),
            lambda: (_mm(x, w), _mm(grad, w.t()), _mm(grad.t(), x.t())),
        )


def _mm(a: torch.Tensor, b_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b_t.T (+ bias)`` by oneDNN, for 2-D ``a`` and ``b_t``."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """``x @ w.T + b`` for 2-D ``x``, the forward and both backward products run by oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm(grad, weight.t())
        if ctx.needs_input_grad[1]:
            grad_w = _mm(grad.t(), x.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def _plain_fp32_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and x.numel() > 0
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: str = "auto"
):
    """``F.linear``, with plain fp32 CPU products on oneDNN where ``mode`` (``cpu_matmul``)
    selects it. A weight stored in another dtype than the input's (a LoRA base kept in bf16)
    is cast to it outside autocast (autocast casts both itself)."""
    if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    if _plain_fp32_cpu(x, weight) and onednn_selected(
        x.numel() // x.shape[-1], *weight.shape[::-1], mode
    ):
        # the reshapes outside the Function: the result is then a view of a tensor with a
        # history, as F.linear's is (the blocked loss tells a caller's leaf by that)
        out = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, names and tensor-parallel plans) computed by
    :func:`linear` with the kernel choice ``cpu_matmul`` (the model sets it on each layer).
    With a LoRA adapter (``add_adapter``) it adds scale x B(A(dropout(x))): ``lora_A.weight``
    [rank, in] and ``lora_B.weight`` [out, rank], the names PEFT saves them under."""

    cpu_matmul: str = "auto"
    split: bool = False
    """Set by the tensor-parallel plan on the layers it splits (parallel/tensor_parallel.py):
    their products, of DTensors, take ``F.linear``."""
    lora_scale: float = 0.0
    lora_off: bool = False
    """Set (by ``adapters_off``): the layer computes its base alone."""

    def add_adapter(self, rank: int, scale: float, dropout: float) -> None:
        """A LoRA adapter on this layer (its tensors on the current default device; the model's
        ``init_weights`` draws A as PEFT does and zeros B)."""
        self.lora_A = nn.Linear(self.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False)
        self.lora_dropout = nn.Dropout(dropout)
        self.lora_scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = "default" if self.split else self.cpu_matmul
        out = linear(x, self.weight, self.bias, mode)
        term = self.adapter_term(x, mode)
        return out if term is None else out + term

    def adapter_term(self, x: torch.Tensor, mode: str = "default") -> torch.Tensor | None:
        """scale x B(A(dropout(x))), the adapter's part of the output (None without one, or
        while ``adapters_off``): for a caller that computes the base product itself."""
        a = self._modules.get("lora_A")
        if a is None or self.lora_off:
            return None
        low = linear(self.lora_dropout(x), a.weight, mode=mode)
        return self.lora_scale * linear(low, self.lora_B.weight, mode=mode)

    def merged_weight(self) -> torch.Tensor:
        """W + scale x B @ A: the weight that computes what the layer and its adapter do."""
        a = self._modules.get("lora_A")
        if a is None:
            return self.weight
        merged = merge_adapter(self.weight, a.weight, self.lora_B.weight, self.lora_scale)
        # a base stored in bf16 merges into fp32: the adapters' part is not rounded away
        return merged if self.weight.dtype == torch.bfloat16 else merged.to(self.weight.dtype)


def merge_adapter(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """W + scale x B @ A in fp32: a LoRA adapter merged into the weight it adapts (the one
    formula of ``convert to-hf`` and ``save_hf``)."""
    return weight.float() + scale * (lora_b.float() @ lora_a.float())
