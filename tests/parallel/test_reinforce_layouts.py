"""Online REINFORCE in the layouts: given the same rollouts (GPT-NeoX's data servers on
loopback, one per data-parallel rank), 2 processes under ZeRO-1, ZeRO-3 and tensor parallelism
train exactly as one process: the same losses, rewards, KL (the full form, gathered over the
vocabulary shards under tensor parallelism), gradient norms and weights."""

from __future__ import annotations

import contextlib
import random

import pytest

from tests.data.dataserver import start_server
from tests.helpers import (
    assert_resumes_bitwise,
    assert_same_training,
    losses,
    reference,
    train,
)
from tests.train.rl.test_reinforce_run import EXAMPLE, tiny
from torchneox.data.online import Group

STEPS = 3
COMMON = tiny(
    rollout_prompts=None,
    dataset_impl="online",
    train_iters=STEPS,
    lr_decay_iters=STEPS,
    checkpoint_factor=STEPS,
    train_micro_batch_size_per_gpu=2,
    reinforce_leave_one_out=True,
    advantage_normalization="none",
    kl_div_beta=0.1,
    kl_impl="full",
    no_weight_tying=True,  # (tied embeddings do not split over tensor ranks)
    padded_vocab_size=36,
    min_lr=1e-4,
    # Adam moves a weight whose gradient is float noise (~1e-9, which the layouts sum in
    # different orders) by about lr * g / (|g| + eps): at eps 1e-8 nearly a whole step
    **{
        "optimizer.params.lr": 1e-3,
        "optimizer.params.eps": 1e-6,
    },  # one vocabulary in every layout (padding follows the tensor ranks)
)


def _answers(rank: int) -> list[list[Group]]:
    """Data-parallel rank ``rank``'s answer to each step: one prompt, two completions (RLOO
    compares them; every rank's advantages are its own groups')."""
    rng = random.Random(rank)
    out = []
    for _ in range(STEPS):
        prompt = [rng.randrange(1, 34) for _ in range(rng.randrange(3, 9))]
        completions = [
            [rng.randrange(1, 34) for _ in range(rng.randrange(1, 6))] + [0] for _ in range(2)
        ]
        out.append([Group(prompt, completions, [rng.random(), rng.random()])])
    return out


@contextlib.contextmanager
def servers(tmp_path, per_rank: bool):
    """One server answering both ranks' groups, in rank order (one process, or a tensor-parallel
    pair); or one server per data-parallel rank. Yields the ports override."""
    with contextlib.ExitStack() as stack:
        if per_rank:
            ports = [stack.enter_context(start_server(tmp_path, _answers(r), sequence=True))[1]
                     for r in range(2)]  # fmt: skip
            yield f"online_dataserver_ports={ports}"
        else:
            both = [a + b for a, b in zip(_answers(0), _answers(1), strict=True)]
            _, port = stack.enter_context(start_server(tmp_path, both, sequence=True))
            yield f"online_dataserver_ports={port}"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    with servers(tmp, per_rank=False) as ports:
        train(str(EXAMPLE), *COMMON, "gradient_accumulation_steps=2", f"save={tmp}", ports)
    return tmp


@pytest.mark.parametrize(
    "layout, per_rank",
    [
        (["zero_optimization.stage=1", "gradient_accumulation_steps=1"], True),
        (["zero_optimization.stage=3", "gradient_accumulation_steps=1"], True),
        (["model_parallel_size=2", "gradient_accumulation_steps=2"], False),
        # each rank's part of every sequence; the outputs gathered whole for the objective
        (["context_parallel_size=2", "gradient_accumulation_steps=2"], False),
    ],
    ids=["zero1", "zero3", "tp2", "cp2"],
)
def test_two_processes_equal_one_given_the_same_rollouts(tmp_path, baseline, layout, per_rank):
    out = tmp_path / "run"
    with servers(tmp_path, per_rank) as ports:
        train(str(EXAMPLE), *COMMON, *layout, f"save={out}", ports, nproc=2)
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    for key in ("reward", "kl", "completion_length"):  # (the last a mean over the ranks)
        assert losses(out, key) == pytest.approx(losses(baseline, key), rel=1e-4), key
    assert_same_training(out, reference(baseline))


def test_rollouts_sampled_under_tensor_parallelism_and_pipeline_stages_equal_one_process(
    tmp_path,
):
    """LoRA adapters trained by rollouts sampled in the run (the reference: the policy with
    its adapters left out). Under tensor parallelism 2: both ranks sample what one process
    samples (the same generator, the logits gathered whole), score it once, and train alike.
    Through 2 pipeline stages: each new token is a whole forward through the stages (they keep
    no cache), the last stage's logits shared with the first, both drawing with the same
    generator; stopped after step 2, the pipeline resumes to the bit."""
    sampled = tiny(train_iters=STEPS, lr_decay_iters=STEPS, checkpoint_factor=2, lora=LORA)
    sampled += [s for s in COMMON if s.split("=")[0] in LAYOUT_KEYS]
    train(str(EXAMPLE), *sampled, f"save={tmp_path / 'one'}")
    baseline = reference(tmp_path / "one")
    assert any(".lora_B." in name for name in baseline[2])
    for name, layout in (("tp", "model_parallel_size=2"), ("pp", "pipe_parallel_size=2")):
        train(str(EXAMPLE), *sampled, layout, f"save={tmp_path / name}", nproc=2)
        for key in ("reward", "completion_length", "kl"):
            one, two = losses(tmp_path / "one", key), losses(tmp_path / name, key)
            assert two == pytest.approx(one, rel=1e-4), (name, key)
        assert_same_training(tmp_path / name, baseline)
    assert_resumes_bitwise(str(EXAMPLE), tmp_path / "pp", 2, [*sampled, layout], nproc=2)


LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


LAYOUT_KEYS = ("no_weight_tying", "padded_vocab_size", "min_lr", "optimizer.params.lr",
               "optimizer.params.eps")  # fmt: skip


def test_two_pipeline_stages_equal_one_process_given_the_same_rollouts(tmp_path):
    """Through a pipeline of 2 stages the served rollouts (asked once, by the first stage, and
    sent to the other) train as in one process, the reference's log-probabilities of the
    labels computed by its own pipeline pass for the abs penalty."""
    sets = [*COMMON, "kl_impl=abs", "gradient_accumulation_steps=2"]
    with servers(tmp_path, per_rank=False) as ports:
        train(str(EXAMPLE), *sets, f"save={tmp_path / 'one'}", ports)
    with servers(tmp_path, per_rank=False) as ports:
        train(str(EXAMPLE), *sets, "pipe_parallel_size=2", f"save={tmp_path / 'pp'}", ports,
              nproc=2)  # fmt: skip
    for key in ("reward", "kl", "advantage"):
        one, pp = losses(tmp_path / "one", key), losses(tmp_path / "pp", key)
        assert pp == pytest.approx(one, rel=1e-4), key
    assert_same_training(tmp_path / "pp", reference(tmp_path / "one"))
