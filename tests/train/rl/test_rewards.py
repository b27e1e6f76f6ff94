"""Rewards of online RL: a function named by module or file (records passed when it takes
them), every way it can fail one line that stops the run, and a reward model's score read at
the position train_impl rm reads."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from torchneox.base.errors import ConfigError, TrainingStopped
from torchneox.train.rl.rewards import RewardFunction, RewardModelScorer

REWARDS = """
import sys
import time

def exact(prompts, completions):
    return [float(c == p[::-1]) for p, c in zip(prompts, completions)]

def with_answers(prompts, completions, records):
    return [float(c == r["answer"]) for c, r in zip(completions, records)]

def keyword(prompts, completions, **kwargs):
    return [len(kwargs["records"][i]["answer"]) for i in range(len(completions))]

def raises(prompts, completions):
    raise KeyError("answer")

def array(prompts, completions):
    return {"a": 1}

def short(prompts, completions):
    return [1.0]

def nan(prompts, completions):
    return [float("nan")] * len(completions)

def text(prompts, completions):
    return ["1"] * len(completions)

def exits(prompts, completions):
    sys.exit(0)

def huge(prompts, completions):  # inf in float32
    return [1e39] * len(completions)

class Opaque:
    def __repr__(self):
        raise RuntimeError("no repr")

class BadFloat(float):
    def __repr__(self):
        raise RuntimeError("no repr")

def opaque(prompts, completions):
    return [Opaque()] * len(completions)

def bad_nan(prompts, completions):
    return [BadFloat("nan")] * len(completions)

def _deep():
    x = []
    for _ in range(100_000):
        x = [x]
    return x

def deep(prompts, completions):
    return [_deep()] * len(completions)

def raises_deep(prompts, completions):
    raise KeyError(_deep())

def sleeps(prompts, completions):
    time.sleep(10)
    return [0.0] * len(completions)

NOT_A_FUNCTION = 3
"""


FINITE = "a reward must be a finite number float32"


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "broken.py").write_text("import nowhere_to_be_found\n")
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(3)\n")
    return tmp_path


def test_a_function_in_a_file_beside_the_config_with_and_without_records(config_dir):
    records = [{"prompt": "abc", "answer": "cba"}, {"prompt": "xy", "answer": "zz"}]
    args = (["abc", "xy"], ["cba", "xy"], records)
    assert RewardFunction("rewards.py:exact", config_dir)(*args) == [1.0, 0.0]
    assert RewardFunction("rewards.py:with_answers", config_dir)(*args) == [1.0, 0.0]
    assert RewardFunction(f"{config_dir}/rewards.py:keyword", None)(*args) == [3.0, 2.0]


def test_a_module_on_the_import_path(config_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(config_dir))
    assert RewardFunction("rewards:exact", None)(["ab"], ["ba"], [{}]) == [1.0]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("rewards.py", "names no function; write module:function"),
        ("missing.py:exact", "missing.py: no such file"),
        ("rewards.py:exakt", "has no function exakt; did you mean exact?"),
        ("rewards.py:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
        ("broken.py:f", "failed (ModuleNotFoundError: No module named 'nowhere_to_be_found')"),
        ("no_such_package.rewards:f", "no module no_such_package on the import path"),
        ("quits.py:f", "quits.py exited (sys.exit(3))"),
    ],
)
def test_a_function_that_cannot_be_loaded_is_one_line(config_dir, spec, says):
    with pytest.raises(ConfigError) as e:
        RewardFunction(spec, config_dir)
    assert e.value.key == "reward_function"
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("raises", "raised KeyError: 'answer'"),
        ("array", "returned a dict, not a list of 2 numbers"),
        ("short", "returned 1 rewards for 2 completions"),
        ("nan", "returned nan at 0 (prompt 'a'); a reward must be a finite number"),
        ("text", "returned str '1' at 0 (prompt 'a'), not a number"),
        ("exits", "exited (sys.exit(0)) instead of returning rewards"),
        ("huge", f"returned 1e+39 at 0 (prompt 'a'); {FINITE} holds (at most 3.403e+38 in size)"),
        ("opaque", "returned Opaque <Opaque> at 0 (prompt 'a'), not a number"),
        ("bad_nan", "returned <BadFloat> at 0 (prompt 'a'); a reward must be a finite number"),
        ("deep", "returned list [[[[...]]]] at 0 (prompt 'a'), not a number"),
        ("raises_deep", "raised KeyError: KeyError;"),
    ],
)
def test_a_reward_function_that_fails_stops_the_run_in_one_line(config_dir, name, says):
    fn = RewardFunction(f"rewards.py:{name}", config_dir)
    with pytest.raises(TrainingStopped) as e:
        fn(["a", "b"], ["c", "d"], [{"answer": "x"}] * 2)
    message = str(e.value)
    assert message.startswith(f"the reward function rewards.py:{name} {says}")
    assert message.endswith("; nothing of this step was saved") and "\n" not in message


def test_ctrl_c_interrupts_a_reward_function_that_hangs(config_dir):
    """SIGINT while the function runs (the trainer's handler would only ask for a stop after
    the step) interrupts it: one line naming it; the handler it replaced is back after."""
    fn = RewardFunction("rewards.py:sleeps", config_dir)
    asked = []

    def trainers(*args):  # the trainer's: stop after this step
        asked.append(args)

    previous = signal.signal(signal.SIGINT, trainers)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    began = time.monotonic()
    timer.start()
    try:
        with pytest.raises(TrainingStopped) as e:
            fn(["a"], ["b"], [{}])
    finally:
        timer.cancel()
        restored = signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - began < 5
    assert re.fullmatch(
        r"the reward function rewards\.py:sleeps was interrupted by SIGINT \(Ctrl-C\) after "
        r"[0-4] s; nothing of this step was saved",
        str(e.value),
    )
    assert restored is trainers and asked == []


def _saved(folder, train_impl: str, **extra):
    """A tiny random model of ``train_impl`` saved as a torchneox checkpoint (``extra``: its
    other keys, the tokenizer's say)."""
    from torchneox.checkpoint import files as checkpoint_format
    from torchneox.config.derive import derive
    from torchneox.config.load import load_mapping
    from torchneox.config.report import render_yaml
    from torchneox.models.args import model_args
    from torchneox.models.transformer import build_model

    keys = {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16}
    keys |= {"tokenizer_type": "CharLevelTokenizer", "make_vocab_size_divisible_by": 64}
    keys |= {"pos_emb": "rotary", "train_impl": train_impl, **extra}
    if train_impl == "rm":
        keys |= {"dataset_impl": "pairwise", "pack_impl": "unpacked"}
    loaded = load_mapping(keys, "test")
    model = build_model(model_args(loaded), seed=0)
    state = {"model": model.state_dict()}
    checkpoint_format.save_checkpoint(folder, 0, state, render_yaml(loaded, derive(loaded)))
    return model


def test_the_reward_model_scores_at_the_end_of_text_after_the_completion(tmp_path):
    model = _saved(tmp_path / "rm", "rm")
    scorer = RewardModelScorer(str(tmp_path / "rm"), "cpu")
    eos = 0  # the character tokenizer's end-of-text
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    completions = [[20, 21, eos], [22], []]  # stopped, cut at the token limit, nothing
    got = scorer(prompts, completions)
    with torch.no_grad():
        # as preprocess --chat --for-rm ends a chat: the value at the first end-of-text
        want = [model(torch.tensor([row]))[0, -1, 0].item() for row in (
            [5, 6, 7, 20, 21, eos], [8, 9, 22, eos], [10, 11, 12, 13, eos])]  # fmt: skip
    assert got == pytest.approx(want, abs=1e-6)
    assert len(set(got)) == 3


def test_a_language_model_is_not_a_reward_model(tmp_path):
    _saved(tmp_path / "lm", "normal")
    with pytest.raises(ConfigError, match="is not a reward model") as e:
        RewardModelScorer(str(tmp_path / "lm"), "cpu")
    assert e.value.key == "reward_model"


HERE = Path(__file__).resolve().parents[3] / "configs" / "reinforce_tiny"
POLICY = {"tokenizer_type": "HFTokenizer", "vocab_file": str(HERE / "tokenizer.json")}


def _policy(**keys):
    """The tokenizer keys of a policy (the example's 34-token tokenizer)."""
    from torchneox.config.load import load_mapping

    values = {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16}
    return load_mapping(values | POLICY | keys, "policy").config.tokenizer


def test_the_reward_model_must_have_the_policys_tokenizer(tmp_path):
    """Its tokenizer is the policy's: the same file (a copy), or the same size, end-of-text and
    ids of a probe text (the file written again); another, or a vocabulary the policy's ids
    overrun, is one line at start-up."""
    _saved(tmp_path / "char", "rm")  # the character tokenizer: 512 tokens
    with pytest.raises(ConfigError) as e:
        RewardModelScorer(str(tmp_path / "char"), "cpu", policy=_policy(), policy_vocab=34)
    message = str(e.value)
    assert e.value.key == "reward_model" and "\n" not in message
    assert message.endswith(
        "the reward model's tokenizer (CharLevelTokenizer) is not the policy's (HFTokenizer "
        "tokenizer.json): 512 tokens, the policy's 34; a reward model reads the policy's token "
        "ids, so train it with the policy's tokenizer"
    )
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_text(json.dumps(json.loads((HERE / "tokenizer.json").read_text()), indent=1))
    same = {"tokenizer_type": "HFTokenizer", "vocab_file": str(copy)}
    _saved(tmp_path / "same", "rm", make_vocab_size_divisible_by=2, **same)
    scorer = RewardModelScorer(str(tmp_path / "same"), "cpu", policy=_policy(), policy_vocab=34)
    assert len(scorer([[14, 5]], [[15, 24]])) == 1
    with pytest.raises(ConfigError) as e:  # the policy's make_vocab_size_divisible_by 64
        RewardModelScorer(str(tmp_path / "same"), "cpu", policy=_policy(), policy_vocab=64)
    assert str(e.value).endswith(
        "has 34 vocabulary rows, fewer than the policy's 64 (padded), any of which the policy "
        "may sample; train the reward model with the policy's make_vocab_size_divisible_by"
    )


def test_a_reward_model_score_that_is_not_finite_stops_the_run(tmp_path):
    _saved(tmp_path / "rm", "rm")
    scorer = RewardModelScorer(str(tmp_path / "rm"), "cpu")
    with torch.no_grad():
        scorer.model.value_head.weight.fill_(float("nan"))
    with pytest.raises(TrainingStopped) as e:
        scorer([[5, 6]], [[7]], ["say it"])
    assert str(e.value) == (
        f"the reward model {tmp_path / 'rm' / 'global_step0'} scored the completion at 0 (prompt 'say it') nan; "
        "a reward must be a finite number (check the reward model's weights); nothing of this "
        "step was saved"
    )
