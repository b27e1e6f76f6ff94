"""Speculative greedy decoding with the MTP module as the draft (inference/speculative.py): the
tokens are plain greedy decoding's, whatever the drafts; a right draft gives two tokens a
forward; the module's drafts over its own cache are its training forward's predictions; what
cannot run is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import BASE
from torchneox.base.errors import ConfigError
from torchneox.config.load import load_mapping
from torchneox.inference.generate import Sampling, generate
from torchneox.inference.speculative import Drafts, MTPDrafter, speculative_greedy
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

MTP = {"pos_emb": "rotary", "norm": "rmsnorm", "mtp_num_layers": 1, "hidden_dropout": 0.0}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]


def _model(**keys):
    model = build_model(model_args(load_mapping(BASE | MTP | keys, "mtp")), seed=3)
    return model.eval()


def test_the_tokens_are_plain_greedy_decodings():
    model = _model()
    plain = generate(model, PROMPTS, Sampling(maximum_tokens=20))
    assert generate(model, PROMPTS, Sampling(maximum_tokens=20, speculative=True)) == plain
    stop = plain[0][6]  # a stop token ends the row there, as plain decoding's
    cut = Sampling(maximum_tokens=20, speculative=True, stop_ids={stop})
    assert generate(model, PROMPTS[:1], cut)[0] == plain[0][: plain[0].index(stop)]
    # near the model's last position (64): the draft is not fed past it
    long = [list(range(1, 60))]
    asked = Sampling(maximum_tokens=20, speculative=True)
    assert generate(model, long, asked) == generate(model, long, Sampling(maximum_tokens=20))


class Oracle:
    """Drafts plain greedy decoding's token after next (``wrong``: every other draft wrong),
    while the MTP module drafts over its own cache beside it (its logits kept)."""

    def __init__(self, model, prompt: list[int], plain: list[int], wrong: bool):
        self.sequence, self.wrong, self.calls = prompt + plain, wrong, 0
        self.mtp = MTPDrafter(model, len(self.sequence), torch.float32, keep=True)
        self.position = 0  # positions the module has read

    def __call__(self, h, ahead) -> int:
        self.mtp(h, ahead)
        self.position += ahead.shape[1]
        self.calls += 1
        right = self.sequence[self.position + 1] if self.position + 1 < len(self.sequence) else 0
        return right + 1 if self.wrong and self.calls % 2 else right


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "every-other-wrong"])
def test_right_drafts_give_two_tokens_a_forward_and_the_module_drafts_as_it_trains(wrong):
    model = _model()
    prompt = PROMPTS[0]
    plain = generate(model, [prompt], Sampling(maximum_tokens=20))[0]
    oracle, drafts = Oracle(model, prompt, plain, wrong), Drafts()
    out = speculative_greedy(model, prompt, 20, set(), torch.float32, oracle, drafts)
    assert out == plain
    # the prompt's forward gives 1 token, each later one 2 (a right draft) or 1 (a wrong one):
    # 20 tokens (a 21st cut) in 11 forwards, or with half the drafts wrong in 14
    assert drafts.forwards + drafts.accepted in (20, 21)
    assert (drafts.forwards, drafts.accepted) == ((14, 6) if wrong else (11, 10)), drafts
    # every position the module read, drafted through its cache across kept and cut drafts,
    # equals the training forward's depth-1 logits (models/mtp.py)
    seen = torch.cat(oracle.mtp.logits, dim=1)
    sequence = torch.tensor([prompt + plain])
    whole = model(sequence, mtp_tokens_BT=sequence)[1]
    assert len(prompt) + len(plain) - 3 <= seen.shape[1] < len(prompt) + len(plain)
    torch.testing.assert_close(seen, whole[:, : seen.shape[1]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("keys", "sampling", "said"),
    [
        ({"mtp_num_layers": 0}, {}, "this model has none (mtp_num_layers)"),
        ({}, {"temperature": 0.7}, "is greedy, and temperature is 0.7"),
        ({}, {"use_cache": False}, "runs on the KV cache"),
    ],
    ids=["no-mtp", "temperature", "recompute"],
)
def test_what_cannot_draft_is_one_line(keys, sampling, said):
    with pytest.raises(ConfigError, match="speculative decoding") as e:
        generate(_model(**keys), PROMPTS, Sampling(speculative=True, **sampling))
    assert said in str(e.value) and len(str(e.value).splitlines()) == 1


def test_generate_speculative_prints_plain_greedy_text_and_what_the_drafts_did(tmp_path, capsys):
    from tests.inference.test_generate import _char_checkpoint
    from torchneox.cli import main

    _char_checkpoint(tmp_path / "mtp", mtp_num_layers=1)
    args = ["generate", "--checkpoint", str(tmp_path / "mtp"), "--prompt", "abcd"]
    args += ["--maximum-tokens", "8", "--temperature", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative"]) == 0
    got = capsys.readouterr()
    assert got.out == plain
    assert "speculative decoding: " in got.err and " forwards of the model, " in got.err
    assert main([*args, "--speculative", "--decode-loop", "static"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "decode_loop: speculative decoding keeps" in err, err
    _char_checkpoint(tmp_path / "plain")
    args[2] = str(tmp_path / "plain")
    assert main([*args, "--speculative"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "speculative: speculative decoding drafts" in err, err
