"""The kernel floor of nanoGPT's tiny Shakespeare recipe step: the operators a training step of
its model (GPT-2, 4 layers, width 128, context 64, batch 12, vocabulary 65, fp32) has to run,
called one after another on prepared tensors with nothing around them: no autograd, no module
calls, no optimizer bookkeeping, no loss read back. Forward (layer norms, linears, flash
attention, GELU, residual adds, the tied head, cross-entropy), backward (each operator's own
backward kernel, the products of every linear), gradient clipping (``_foreach_norm`` and one
scale) and AdamW (``_fused_adamw_``, decay on matrices only).

Each matrix product runs on the faster of PyTorch's default kernel (MKL) and oneDNN at its
shape, measured once; attention on the faster of PyTorch's flash kernel and the explicit
matmul-softmax-matmul. So no framework computing this model with these kernels can take a step
in less time than this one: the plain loop's time over the floor's, both timed in the same
rounds, is the highest speed-up over the plain loop anything built on these kernels could reach.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from torchneox.models.cpu_kernels import challenger_faster
from torchneox.models.linear import _mm as onednn_mm  # a @ b_t.T by oneDNN

aten = torch.ops.aten


class KernelFloor:
    """``step()``: one training step of the recipe's model as bare kernels (the module's text)."""

    def __init__(self, vocab: int, block: int, layers: int, heads: int, width: int, batch: int):
        g = torch.Generator().manual_seed(0)
        self.b, self.t, self.h, self.c, self.vocab = batch, block, heads, width, vocab
        n = batch * block

        def w(*shape):
            return torch.randn(*shape, generator=g) * 0.02

        self.layers = [
            {
                "ln1": torch.ones(width), "qkv": w(3 * width, width), "proj": w(width, width),
                "ln2": torch.ones(width), "fc": w(4 * width, width), "out": w(width, 4 * width),
            }
            for _ in range(layers)
        ]  # fmt: skip
        self.wte, self.wpe, self.lnf = w(vocab, width), w(block, width), torch.ones(width)
        self.idx = torch.randint(0, vocab, (batch, block), generator=g)
        self.targets = torch.randint(0, vocab, (n,), generator=g)
        matrices = [
            self.wte,
            self.wpe,
            *(m for L in self.layers for m in L.values() if m.dim() > 1),
        ]
        vectors = [self.lnf, *(L[k] for L in self.layers for k in ("ln1", "ln2"))]
        self.groups = [
            {"params": p, "decay": d, "m": [torch.zeros_like(x) for x in p],
             "v": [torch.zeros_like(x) for x in p],
             "steps": [torch.zeros((), dtype=torch.float32) for _ in p]}
            for p, d in ((matrices, 0.1), (vectors, 0.0))
        ]  # fmt: skip
        self._mm: dict[tuple, bool] = {}
        self._causal = torch.full((block, block), float("-inf")).triu(1)
        self._math_attention = self._attention_choice()

    # -------------------------------------------------------------------------------- choices

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` on the faster kernel for this shape and layout (chosen at first use)."""
        key = (a.shape, a.stride(), b.shape, b.stride())
        if key not in self._mm:
            self._mm[key] = challenger_faster(lambda: a.mm(b), lambda: onednn_mm(a, b.t()))
        return onednn_mm(a, b.t()) if self._mm[key] else a.mm(b)

    def _attention_choice(self) -> bool:
        shape = (self.b, self.h, self.t, self.c // self.h)
        q, k, v, grad = (torch.randn(shape) for _ in range(4))
        return challenger_faster(
            lambda: self._flash(q, k, v)[1](grad), lambda: self._math(q, k, v)[1](grad)
        )

    def _flash(self, q, k, v):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out, lambda grad: aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, True
        )

    def _math(self, q, k, v):
        """softmax(q k^T / sqrt(d), causal) v, with its backward as the kernels autograd runs."""
        scores = torch.baddbmm(
            self._causal, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2),
            alpha=1 / math.sqrt(q.shape[-1]),
        )  # fmt: skip
        probs = torch.softmax(scores, -1)
        vf = v.flatten(0, 1)
        out = torch.bmm(probs, vf).view(q.shape)

        def backward(grad):
            g = grad.flatten(0, 1)
            grad_v = torch.bmm(probs.transpose(1, 2), g)
            grad_s = aten._softmax_backward_data(torch.bmm(g, vf.transpose(1, 2)), probs, -1,
                                                 torch.float32) / math.sqrt(q.shape[-1])  # fmt: skip
            grad_q = torch.bmm(grad_s, k.flatten(0, 1))
            grad_k = torch.bmm(grad_s.transpose(1, 2), q.flatten(0, 1))
            return (z.view(q.shape) for z in (grad_q, grad_k, grad_v))

        return out, backward

    def attention(self, q, k, v):
        return (self._math if self._math_attention else self._flash)(q, k, v)

    # ----------------------------------------------------------------------------------- step

    def step(self) -> None:
        b, t, c, n = self.b, self.t, self.c, self.b * self.t
        x = (F.embedding(self.idx, self.wte) + self.wpe).view(n, c)
        saved = []
        for L in self.layers:
            x, record = self._layer_forward(x, L)
            saved.append(record)
        y, mean, rstd = aten.native_layer_norm(x, [c], self.lnf, None, 1e-5)
        logits = self.mm(y, self.wte.t())
        logp = torch.log_softmax(logits, -1)
        _loss, total = aten.nll_loss_forward(logp, self.targets, None, 1, -100)
        grad = aten._log_softmax_backward_data(
            aten.nll_loss_backward(torch.ones(()), logp, self.targets, None, 1, -100, total),
            logp, -1, torch.float32,
        )  # fmt: skip
        grad_wte = self.mm(grad.t(), y)
        dy = self.mm(grad, self.wte)
        dx, grad_lnf, _ = aten.native_layer_norm_backward(
            dy, x, [c], mean, rstd, self.lnf, None, [True, True, False]
        )
        layer_grads = []
        for L, record in zip(reversed(self.layers), reversed(saved), strict=True):
            dx, matrices, vectors = self._layer_backward(dx, L, record)
            layer_grads.insert(0, (matrices, vectors))
        dx = dx.view(b, t, c)
        grad_wte += aten.embedding_dense_backward(dx, self.idx, self.vocab, -1, False)
        self._optimizer(
            [grad_wte, dx.sum(0), *(g for matrices, _ in layer_grads for g in matrices)],
            [grad_lnf, *(g for _, vectors in layer_grads for g in vectors)],
        )

    def _layer_forward(self, x, L):
        b, t, c, h = self.b, self.t, self.c, self.h
        y1, m1, r1 = aten.native_layer_norm(x, [c], L["ln1"], None, 1e-5)
        qkv = self.mm(y1, L["qkv"].t())
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in qkv.split(c, 1))
        att, att_backward = self.attention(q, k, v)
        o = att.transpose(1, 2).reshape(b * t, c)
        x1 = x + self.mm(o, L["proj"].t())
        y2, m2, r2 = aten.native_layer_norm(x1, [c], L["ln2"], None, 1e-5)
        hid = self.mm(y2, L["fc"].t())
        act = F.gelu(hid)
        out = x1 + self.mm(act, L["out"].t())
        return out, (x, y1, m1, r1, o, att_backward, x1, y2, m2, r2, hid, act)

    def _layer_backward(self, dx, L, record):
        """The input's gradient, then the layer's matrix gradients (qkv, proj, fc, out) and its
        norms' (ln1, ln2), in the parameters' order."""
        x, y1, m1, r1, o, att_backward, x1, y2, m2, r2, hid, act = record
        b, t, c, h = self.b, self.t, self.c, self.h
        grad_out = self.mm(dx.t(), act)
        dhid = aten.gelu_backward(self.mm(dx, L["out"]), hid)
        grad_fc = self.mm(dhid.t(), y2)
        d1, grad_ln2, _ = aten.native_layer_norm_backward(
            self.mm(dhid, L["fc"]), x1, [c], m2, r2, L["ln2"], None, [True, True, False]
        )
        dx1 = dx + d1
        grad_proj = self.mm(dx1.t(), o)
        dq, dk, dv = att_backward(self.mm(dx1, L["proj"]).view(b, t, h, c // h).transpose(1, 2))
        dqkv = torch.cat([z.transpose(1, 2).reshape(b * t, c) for z in (dq, dk, dv)], 1)
        grad_qkv = self.mm(dqkv.t(), y1)
        d0, grad_ln1, _ = aten.native_layer_norm_backward(
            self.mm(dqkv, L["qkv"]), x, [c], m1, r1, L["ln1"], None, [True, True, False]
        )
        return dx1 + d0, [grad_qkv, grad_proj, grad_fc, grad_out], [grad_ln1, grad_ln2]

    def _optimizer(self, matrix_grads, vector_grads) -> None:
        """Clipping at 1.0 over every gradient, then AdamW (lr 1e-3, betas 0.9/0.99)."""
        every = matrix_grads + vector_grads
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(every)))
        torch._foreach_mul_(every, torch.clamp(1.0 / (total + 1e-6), max=1.0))
        for group, grads in zip(self.groups, (matrix_grads, vector_grads), strict=True):
            torch._foreach_add_(group["steps"], 1.0)
            aten._fused_adamw_(
                group["params"], grads, group["m"], group["v"], [], group["steps"],
                lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=group["decay"], eps=1e-8,
                amsgrad=False, maximize=False,
            )  # fmt: skip
