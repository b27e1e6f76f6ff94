"""The CPU loss (softmax over cache-sized blocks of rows, gradient written into the logits'
storage) against F.cross_entropy: the same loss and the same gradients, masked or not, fp32
and bf16, one block or many."""

import pytest
import torch
from torch.nn import functional as F

from torchneox.train import loss as loss_module
from torchneox.train.loss import lm_loss, lm_loss_and_z


def reference(logits, labels, mask):
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    )
    if mask is None:
        return losses.mean()
    m = mask.reshape(-1).float()
    return (losses * m).sum() / m.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("block_bytes", [4 << 20, 3 * 4 * 1000])  # one block; 3 rows per block
def test_blocked_loss_equals_cross_entropy(dtype, masked, block_bytes, monkeypatch):
    monkeypatch.setattr(loss_module, "BLOCK_BYTES", block_bytes)
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, dtype=dtype)
    weight = torch.randn(1000, 16, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 7))
    mask = torch.rand(2, 7) > 0.3 if masked else None

    expected = reference(hidden @ weight.t(), labels, mask)
    (want,) = torch.autograd.grad(expected, weight)
    logits = hidden @ weight.t()
    got = lm_loss(logits, labels, mask)
    (have,) = torch.autograd.grad(got, weight)

    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # evaluation: the blocked forward alone
        torch.testing.assert_close(lm_loss(hidden @ weight.t(), labels, mask), expected.detach())
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-5}
    torch.testing.assert_close(have, want, **tol)
    assert have.abs().sum() > 0


def test_leaf_logits_are_left_alone():
    """A caller's own tensor (a leaf) is never overwritten: the plain path is taken."""
    logits = torch.randn(5, 11, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.randint(0, 11, (5,))
    lm_loss(logits, labels, None).backward()
    assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(
        logits.grad, torch.autograd.grad(reference(logits, labels, None), logits)[0]
    )


@pytest.mark.parametrize("other_first", [False, True])
def test_another_reader_of_the_logits_is_never_misled(other_first):
    """If something else saved the logits for its backward, it either ran before the loss's
    backward (and read them intact) or autograd refuses: never a silently wrong gradient."""
    torch.manual_seed(0)
    hidden = torch.randn(5, 4)
    weight = torch.randn(11, 4, requires_grad=True)
    labels = torch.randint(0, 11, (5,))

    def total(loss_fn):
        logits = hidden @ weight.t()
        if other_first:
            square = logits.pow(2).sum()  # pow keeps the logits for its backward
            return square + loss_fn(logits)
        ce = loss_fn(logits)
        return ce + logits.pow(2).sum()

    (want,) = torch.autograd.grad(total(lambda x: reference(x, labels, None)), weight)
    try:
        (have,) = torch.autograd.grad(total(lambda x: lm_loss(x, labels, None)), weight)
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
    else:
        torch.testing.assert_close(have, want)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("block_bytes", [4 << 20, 3 * 4 * 1000])
def test_z_loss_and_its_gradient_equal_a_plain_autograd_reference(masked, block_bytes, monkeypatch):
    """lm_z_loss: PaLM's z-loss, the mean of logsumexp(logits)^2, through the blocked loss."""
    monkeypatch.setattr(loss_module, "BLOCK_BYTES", block_bytes)
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16)
    weight = torch.randn(1000, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 7))
    mask = torch.rand(2, 7) > 0.3 if masked else None
    logits = hidden @ weight.t()
    lse = torch.logsumexp(logits.reshape(-1, 1000), -1).square()
    m = torch.ones(14) if mask is None else mask.reshape(-1).float()
    want_z = (lse * m).sum() / m.sum()
    want = reference(logits, labels, mask) + 1e-3 * want_z
    (want_grad,) = torch.autograd.grad(want, weight)

    ce, z = lm_loss_and_z(hidden @ weight.t(), labels, mask)
    (have_grad,) = torch.autograd.grad(ce + 1e-3 * z, weight)
    assert z.item() == pytest.approx(want_z.item(), rel=1e-6)
    assert ce.item() == pytest.approx(reference(logits, labels, mask).item(), rel=1e-6)
    torch.testing.assert_close(have_grad, want_grad, rtol=1e-5, atol=1e-6)
