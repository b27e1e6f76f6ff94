"""``train_epochs``: the checks of the key and GPT-NeoX's count of iterations from it.

GPT-NeoX (training.py ``update_iterations``) builds the training split for one epoch,
(tokens of the split - 1) // seq_length samples, loads it in global micro-batches of
micro-batch x data-parallel samples dropping the last partial one, and trains for
(micro-batches of an epoch x train_epochs) // gradient_accumulation_steps steps, cycling the
loader, so every epoch sees the samples in the same order.
"""

from __future__ import annotations

from torchneox.config.checker import Checker


def check_train_epochs(ch: Checker) -> None:
    """GPT-NeoX's refusals (data_utils.py ``validate_train_epochs``), and blends (torchneox)."""
    c = ch.c
    if c.training.train_epochs is None:
        return
    if c.training.train_iters is not None:
        ch.fail("train_epochs", "given together with train_iters; give one of them")
    d = c.data
    if d.dataset_impl != "gpt2":
        ch.fail("train_epochs", f"needs dataset_impl gpt2, not {d.dataset_impl}; give train_iters")
    if d.pack_impl != "packed":
        ch.fail("train_epochs", f"needs pack_impl packed, not {d.pack_impl}; give train_iters")
    if c.training.train_impl != "normal" or not d.data_path:
        ch.fail(
            "train_epochs",
            "counts the epochs of one data_path (its train split); with train_data_paths or "
            "another train_impl give train_iters",
        )


def epoch_iterations(
    epoch_samples: int, micro_batch: int, dp: int, grad_accum: int, epochs: int
) -> tuple[int, int, str]:
    """(train_iters, micro-batches of one epoch, the reason) as GPT-NeoX computes them."""
    batches = epoch_samples // (micro_batch * dp)
    iters = batches * epochs // grad_accum
    why = (
        f"{iters} = ({epoch_samples} samples in an epoch // (micro-batch {micro_batch} x "
        f"data-parallel {dp}) = {batches} batches) x train_epochs {epochs} // "
        f"gradient_accumulation_steps {grad_accum}"
    )
    return iters, batches, why
