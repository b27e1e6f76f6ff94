"""Speculative greedy decoding with the model's own multi-token prediction module as the draft
(``speculative: true``, ``generate --speculative``).

DeepSeek-V3's MTP depth 1 reads the last layer's output at a position and the embedding of the
token after it, and predicts the token after that (models/mtp.py). Decoding keeps, besides the
model's KV cache, one for that module's block. Each step feeds the model the token just chosen
and the draft of the one after it; the model's head at the first position checks the draft:

- it agrees: both positions are kept, and the head's choice at the second is a third token, so
  the step gives two tokens;
- it does not: the draft's keys are dropped from the cache (its length cut back by one) and the
  head's choice at the first position is the step's one token.

Either way every kept token is the model's own greedy choice, so the text is plain greedy
decoding's; the draft only decides how many tokens a forward gives. The module then drafts
again from the kept positions' outputs. One row at a time (rows would keep different numbers
of tokens), attention layers only (a recurrent layer's state cannot be cut back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchneox.base.errors import ConfigError
from torchneox.models.mixers.attention import KVCache
from torchneox.models.mtp import draft_cache, draft_logits
from torchneox.models.transformer import Transformer


@dataclass
class Drafts:
    """What speculative decoding did: tokens kept, forwards of the model, drafts kept."""

    tokens: int = 0
    forwards: int = 0
    accepted: int = 0


def check_speculative(model: Transformer, temperature: float, use_cache: bool) -> None:
    """One line naming what keeps ``model`` from speculative decoding, raised; else nothing."""
    args = model.args
    problem = None
    if not args.mtp_depth or model.mtp is None:
        problem = "drafts with the model's MTP module, and this model has none (mtp_num_layers)"
    elif temperature > 0:
        problem = f"is greedy, and temperature is {temperature}: set temperature 0"
    elif not use_cache:
        problem = "runs on the KV cache, which recompute turns off: drop one"
    elif any(not args.is_attention_layer(i) for i in range(args.num_layers)):
        problem = "cuts its cache back after a wrong draft, which a recurrent layer cannot"
    elif args.soft_prompt_tokens:
        problem = "is unbuilt for a soft prompt's model"
    if problem is not None:
        raise ConfigError(f"speculative decoding {problem}", key="speculative")


Drafter = Callable[[torch.Tensor, torch.Tensor], int]
"""(the last layer's outputs [1, T, H] at the positions kept, the tokens one ahead [1, T]) ->
the draft of the token after the last one."""


class MTPDrafter:
    """Depth 1 of ``model``'s MTP modules over its own cache (``keep``: each call's logits in
    ``logits``, in position order)."""

    def __init__(self, model: Transformer, room: int, dtype: torch.dtype, keep: bool = False):
        device = model.embed.weight.device
        self.model, self.cache = model, draft_cache(model, 1, room, dtype, device)
        self.logits: list[torch.Tensor] | None = [] if keep else None

    def __call__(self, h_BTH: torch.Tensor, ahead_BT: torch.Tensor) -> int:
        logits = draft_logits(self.model, h_BTH, ahead_BT, self.cache)
        if self.logits is not None:
            self.logits.append(logits)
        return int(logits[0, -1].argmax())


@torch.no_grad()
def speculative_greedy(
    model: Transformer,
    prompt: list[int],
    steps: int,
    stop_ids: set[int],
    dtype: torch.dtype,
    drafter: Drafter | None = None,
    drafts: Drafts | None = None,
) -> list[int]:
    """Up to ``steps`` tokens after ``prompt`` (through the first stop token), the model's greedy
    choices, drafting with ``drafter`` (None: the model's MTP module); ``drafts`` counts."""
    drafts = drafts if drafts is not None else Drafts()
    device, width = model.embed.weight.device, len(prompt) + steps
    drafter = drafter if drafter is not None else MTPDrafter(model, width, dtype)
    cache = KVCache(model.args, 1, width, dtype, device)
    hidden: list[torch.Tensor] = []  # the last layer's outputs of each forward (before the norm)
    hook = model.final_norm.register_forward_pre_hook(lambda _m, a: hidden.append(a[0]))
    try:
        tokens = list(prompt)
        chosen = _forward(model, tokens, cache, drafts)
        tokens.append(chosen[-1])
        draft = drafter(hidden[-1], torch.tensor([tokens[1:]], device=device))
        stopped = chosen[-1] in stop_ids
        while len(tokens) < width and not stopped:
            n = len(tokens) - 1  # the cache holds positions 0..n-1; token n is not fed yet
            checked = n + 1 < width
            fed = [tokens[n], draft] if checked else [tokens[n]]
            chosen = _forward(model, fed, cache, drafts)
            if checked and chosen[0] == draft:
                kept, drafts.accepted = [draft, chosen[1]], drafts.accepted + 1
            else:
                cache.length = n + 1  # (a wrong draft's keys dropped)
                kept = [chosen[0]]
            tokens += kept
            stopped = any(token in stop_ids for token in kept)
            if len(tokens) < width and not stopped:  # (no draft after the last forward)
                draft = drafter(hidden[-1][:, : len(kept)], torch.tensor([kept], device=device))
    finally:
        hook.remove()
    out = tokens[len(prompt) : width]
    for i, token in enumerate(out):
        if token in stop_ids:
            out = out[: i + 1]
            break
    drafts.tokens += len(out)
    return out


def _forward(model: Transformer, fed: list[int], cache: KVCache, drafts: Drafts) -> list[int]:
    """The model's greedy choice after each of ``fed`` (positions after the cache's)."""
    x = torch.tensor([fed], device=cache.k.device)
    logits = model(x, cache=cache)
    drafts.forwards += 1
    return logits[0].argmax(-1).tolist()
