"""Generation: the KV cache changes nothing, batched (left-padded) prompts equal one at a time,
stop tokens end a row, sampling is seeded, and top-k / top-p keep what they should."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import build
from torchneox.inference.generate import Sampling, filter_logits, generate


@pytest.mark.parametrize(
    "variant", ["neox-rotary", "alibi", "learned", "window", "rmsnorm-swiglu-gqa"]
)
def test_generation_with_cache_equals_without(variant):
    _, model = build(variant)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    with_cache = generate(model, prompts, Sampling(maximum_tokens=12))
    without = generate(model, prompts, Sampling(maximum_tokens=12, use_cache=False))
    assert with_cache == without
    assert all(len(c) == 12 for c in with_cache)


def test_batched_prompts_equal_one_at_a_time():
    _, model = build("neox-rotary")
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    batched = generate(model, prompts, Sampling(maximum_tokens=10))
    alone = [generate(model, [p], Sampling(maximum_tokens=10))[0] for p in prompts]
    assert batched == alone


def test_stop_token_ends_a_row():
    _, model = build("neox-rotary")
    first = generate(model, [[5, 6, 7]], Sampling(maximum_tokens=10))[0]
    stop = first[3]
    cut = generate(model, [[5, 6, 7]], Sampling(maximum_tokens=10, stop_ids={stop}))[0]
    assert cut == first[: first.index(stop)]


def test_sampling_is_seeded():
    _, model = build("neox-rotary")
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9, maximum_tokens=15, seed=4)
    assert generate(model, [[1, 2, 3]], s) == generate(model, [[1, 2, 3]], s)
    other = Sampling(temperature=1.0, maximum_tokens=15, seed=5)
    assert generate(model, [[1, 2, 3]], s) != generate(model, [[1, 2, 3]], other)


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 0.0)).tolist() == [[False, False, True, True]]
    # 0.5 + 0.3 reaches 0.8: the rest is dropped
    assert torch.isinf(filter_logits(logits, 0, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.1)).tolist() == [[False, True, True, True]]
