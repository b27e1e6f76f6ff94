"""``soft_prompt_tuning``: a trained prompt of ``n_tokens`` vectors before the text, read and
checked once.

As GPT-NeoX's SoftEmbedding intends: the prompt goes after the word embeddings, prepended to
the sequence, which is then cut back to its length (the last ``n_tokens`` tokens of each
training sample are dropped; their labels are not scored), and everything but the prompt is
frozen. Every objective runs with it: DPO's chosen and rejected rows, KTO's, a reward model's
and reinforce's rollouts each get the prompt, and their log-probabilities, rewards and values
are read on the text the model kept. The frozen reference of DPO, KTO and reinforce is the
policy as training starts, so it carries the prompt's initial values (as a copy of GPT-NeoX's
model with its SoftEmbedding would): at the first step policy and reference agree. Under LoRA
the reference is the policy with its adapters off, which would carry the trained prompt: that
pair is refused where a reference runs. The prompt starts from ``init_string``'s token embeddings (repeated or cut to
``n_tokens``), or uniform in [-init_range, init_range].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchneox.base.errors import did_you_mean
from torchneox.config.checker import Checker
from torchneox.config.numbers import number, whole
from torchneox.config.refusals import refusal

NAME = "soft_prompt_tuning"
KEYS = ("enabled", "n_tokens", "init_string", "init_range")


@dataclass(frozen=True)
class SoftPrompt:
    n_tokens: int = 10
    init_string: str = ""
    init_range: float = 0.5

    def describe(self) -> str:
        start = (
            f"the embeddings of {self.init_string!r}"
            if self.init_string
            else f"uniform in [-{self.init_range:g}, {self.init_range:g}]"
        )
        return (
            f"{self.n_tokens} trained vectors before the text (from {start}); every other "
            "parameter frozen"
        )


def soft_prompt(cfg: Any) -> SoftPrompt | None:
    """The soft prompt of a checked config; None when soft_prompt_tuning is off."""
    s = cfg.model.soft_prompt_tuning
    if not s or not s.get("enabled", False):
        return None
    return SoftPrompt(
        int(s.get("n_tokens", 10)), str(s.get("init_string", "")), float(s.get("init_range", 0.5))
    )


def check_soft_prompt(ch: Checker) -> None:
    """Each mistake in the dict, and the layouts the prompt does not run with, in one line."""
    c = ch.c
    s = c.model.soft_prompt_tuning
    if s is None:
        return
    if not isinstance(s, dict):
        ch.fail(NAME, f"must be a mapping (enabled, n_tokens, ...), got {s!r}")
    for name in s:
        if name not in KEYS:
            hint = did_you_mean(str(name), KEYS)
            ch.fail(NAME, f"unknown key {name}{hint}", path=str(name))
    if not isinstance(s.get("enabled", False), bool):
        ch.fail(NAME, f"enabled must be true or false, got {s['enabled']!r}", path="enabled")
    # text such as 1e-2 (YAML reads it as a string) counts as the number, as for a flat key
    n = whole(s.get("n_tokens", 10))
    low = 1 if s.get("enabled", False) else 0  # (0 tokens with the prompt off is fine)
    if n is None or n < low:
        ch.fail(
            NAME, f"n_tokens must be an integer >= {low}, got {s['n_tokens']!r}", path="n_tokens"
        )
    if not isinstance(s.get("init_string", ""), str):
        ch.fail(NAME, "init_string must be a string", path="init_string")
    r = number(s.get("init_range", 0.5))
    if r is None or not r > 0:
        ch.fail(
            NAME, f"init_range must be a number > 0, got {s['init_range']!r}", path="init_range"
        )
    s.update({k: v for k, v in (("n_tokens", n), ("init_range", r)) if k in s})
    if not s.get("enabled", False):
        return
    seq = c.model.seq_length
    if seq is not None and n >= seq:
        ch.fail(NAME, f"n_tokens {n} leaves no text in seq_length {seq}; make it smaller")
    _check_layout(ch)


def _check_layout(ch: Checker) -> None:
    c = ch.c
    impl = c.training.train_impl
    if c.training.lora is not None and _live_reference(c):
        ch.fail(
            NAME,
            f"with lora and train_impl {impl} {refusal('soft prompt', f'lora + {impl}')}; "
            "drop one of them",
        )
    if c.model.inter_document_attention_masking:
        ch.fail(
            NAME,
            f"with inter_document_attention_masking {refusal('soft prompt', 'document masking')}"
            "; set it false",
        )


def _live_reference(c: Any) -> bool:
    """Whether train_impl scores against a frozen reference model run beside the policy."""
    impl, t = c.training.train_impl, c.training
    if impl == "dpo":
        return not t.dpo_reference_free and not c.textgen.precompute_model_name
    if impl == "kto":
        return not c.textgen.precompute_model_name
    return impl == "reinforce" and c.rollout.kl_div_beta > 0
