"""Context parallelism's state passing for the recurrent mixers, in one process: each context
rank is a thread that runs its two chunks of the sequence (parallel/context_parallel.py's
split), the all-gather a barrier over the threads. Each rank's outputs, and the gradients of
the whole input, equal the mixer run over the whole sequence, with and without documents."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers import build
from torchneox.models.mixers.attention import AttentionBias
from torchneox.parallel.context_parallel import chunk_positions

CP, T = 2, 24  # 4 chunks of 6 positions: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2


class FakeGather:
    """``bias.gather`` for ``ranks`` threads: every rank's tensors, in rank order (dim 2)."""

    def __init__(self, ranks: int):
        self.barrier, self.slots, self.ranks = threading.Barrier(ranks), {}, ranks

    def of(self, rank: int):
        def gather(k: torch.Tensor, v: torch.Tensor):
            self.slots[rank] = (k, v)
            self.barrier.wait()
            ks, vs = zip(*(self.slots[r] for r in range(self.ranks)), strict=True)
            out = torch.cat(ks, 2), torch.cat(vs, 2)
            self.barrier.wait()  # (every rank has read this call's tensors)
            return out

        return gather


def run_ranks(
    mixer, x_BTH: torch.Tensor, docs_BT: torch.Tensor | None, ranks: int = CP
) -> torch.Tensor:
    """The whole sequence's outputs, each rank's positions computed by its own thread."""
    length = x_BTH.shape[1]
    keys = torch.cat([chunk_positions(length, ranks, r, x_BTH.device) for r in range(ranks)])
    fake, outs, errors = FakeGather(ranks), {}, []

    def rank(r: int) -> None:
        try:
            mine = chunk_positions(length, ranks, r, x_BTH.device)
            documents = None if docs_BT is None else docs_BT[:, keys]
            bias = AttentionBias(None, False, fake.of(r), None, (mine, keys), documents, r)
            outs[r] = (mine, mixer(x_BTH[:, mine], None, bias, None))
        except BaseException as e:  # (seen by the main thread)
            errors.append(e)
            fake.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out = torch.empty_like(x_BTH)
    for mine, o in outs.values():
        out = out.index_copy(1, mine, o)
    return out


def assert_split_like_whole(
    mixer, x: torch.Tensor, docs: torch.Tensor | None, ranks: int = CP
) -> None:
    """The ranks' outputs and the input's gradients (of a random weighting of the outputs)
    equal the whole sequence's, to 1e-9 (float64)."""
    whole_x, split_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    whole = mixer(whole_x, None, AttentionBias(None, True, documents=docs), None)
    split = run_ranks(mixer, split_x, docs, ranks)
    torch.testing.assert_close(split, whole, rtol=1e-9, atol=1e-9)
    weight = torch.randn(whole.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    (whole * weight).sum().backward()
    (split * weight).sum().backward()
    torch.testing.assert_close(split_x.grad, whole_x.grad, rtol=1e-9, atol=1e-9)


# documents start inside a chunk, on a chunk's first position and one after a chunk's end
DOCUMENTS = [[0] * 4 + [1] * 8 + [2] * 7 + [3] * 5, [0] * 13 + [1] * 11]
# 4 ranks' chunks of 1 position: the convolution's 3 inputs before come from 3 chunks back
SHORT = [[0] * 3 + [1] * 2 + [2] * 3, [0] * 8]


@pytest.mark.parametrize(
    "ranks,documents",
    [(CP, None), (CP, DOCUMENTS), (4, None), (4, SHORT)],
    ids=["one-document", "documents", "short-chunks", "short-chunks-documents"],
)
def test_mamba_passes_its_state_between_context_ranks(ranks, documents):
    _, model = build("mamba")
    mixer = model.layers["0"].mamba.double()
    assert mixer.passes_state
    g = torch.Generator().manual_seed(0)
    t = T if ranks == CP else 8
    x = torch.randn(2, t, model.args.hidden_size, generator=g, dtype=torch.float64)
    docs = None if documents is None else torch.tensor(documents)
    assert_split_like_whole(mixer, x, docs, ranks)


@pytest.mark.parametrize("mix", ["time_mix", "channel_mix"])
def test_rwkv_passes_its_shift_and_state_between_context_ranks(mix, monkeypatch):
    """The time mix: its token shift's input and WKV state from the chunk before; the
    channel mix: its token shift's (RWKV runs on across documents, as GPT-NeoX's). In float64
    (the WKV's fp32 casts made float64 here): equal to 1e-9, so nothing but rounding differs."""
    _, model = build("rwkv")
    mixer = getattr(model.layers["0"], mix).double()
    with torch.no_grad():  # lively: decays and mixes away from their initial curves
        for p in mixer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    monkeypatch.setattr(torch.Tensor, "float", torch.Tensor.double)
    assert mixer.passes_state
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, T, model.args.hidden_size, generator=g, dtype=torch.float64)
    assert_split_like_whole(mixer, x, None)


def test_a_context_rank_holds_half_the_recurrent_layers_activations():
    """estimate traces a context rank's forward (its gather a stand-in, on fake tensors): with
    the state passed on, a rank of 2 keeps about half of one process's activations of a mamba
    and an RWKV layer (gathering the sequence, it kept more than the whole)."""
    from tests.helpers import BASE
    from torchneox.config.load import load_mapping
    from torchneox.estimate.search import estimate

    held = {}
    for cp in (1, 2):
        keys = {"attention_config": [[["mamba", "rwkv"], 1]], "num_layers": 2, "seq_length": 128}
        keys |= {"max_position_embeddings": 128, "train_micro_batch_size_per_gpu": 2}
        loaded = load_mapping(BASE | keys | {"context_parallel_size": cp}, "x")
        held[cp] = estimate(loaded, gpus=cp, gpu="h100")["activations_after_forward_bytes"]
    assert 0.4 * held[1] < held[2] < 0.6 * held[1], held
