"""soft_prompt_tuning: everything frozen but a prompt of n_tokens vectors before the text (as
GPT-NeoX's SoftEmbedding intends); the prompt from init_string's embeddings or uniform in
[-init_range, init_range]; labels lined up with the text it leaves in; save, resume, generate;
the refusals in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import BASE, losses
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_config, load_mapping
from torchneox.data.tokenizers import CharLevelTokenizer
from torchneox.inference.generate import Sampling, generate
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.train.trainer import Trainer

PROMPT = {"enabled": True, "n_tokens": 4, "init_range": 0.25}


def test_the_model_puts_the_prompt_before_the_text():
    keys = {"pos_emb": "rotary", "seq_length": 12, "max_position_embeddings": 12}
    loaded = load_mapping(BASE | keys | {"soft_prompt_tuning": PROMPT}, "x")
    model = build_model(model_args(loaded)).eval()
    prompt = model.soft_prompt.weight
    assert prompt.shape == (4, 64) and prompt.requires_grad
    assert prompt.abs().max() <= 0.25 and prompt.std() > 0.05  # uniform in [-0.25, 0.25]
    frozen = [n for n, p in model.named_parameters() if n != "soft_prompt.weight"]
    assert frozen and not any(model.get_parameter(n).requires_grad for n in frozen)
    tokens = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        logits = model(tokens)
        # by hand: the prompt, then the first 8 tokens' embeddings, through the same blocks
        x = torch.cat([prompt[None].expand(2, -1, -1), model.embed(tokens[:, :8])], dim=1)
        rope = model._rope(None, 0, 12)
        bias = model._attention_bias(12, 0, None, x.device)
        for block in model.layers.values():
            x, _ = block(x, rope, bias, None)
        by_hand = F.linear(model.final_norm(x[:, 4:]), model.embed.weight)
    assert logits.shape == (2, 8, model.args.vocab_size)  # the text the prompt left in
    torch.testing.assert_close(logits, by_hand)


def test_a_run_changes_only_the_prompt(make_config, tmp_path):
    base = make_config("base.yml", train_iters=2, save=str(tmp_path / "base"), load=None)
    assert main(["train", base]) == 0
    cfg = make_config(
        soft_prompt_tuning=PROMPT,
        finetune=True,
        load=str(tmp_path / "base"),
        train_iters=3,
        cpu_matmul="default",
    )
    trainer = Trainer(load_config([cfg]), device="cpu")
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    prompt0 = start.pop("soft_prompt.weight")
    optimized = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert optimized == [trainer.model.soft_prompt.weight]  # optimizer state for it alone
    # step 1's loss by hand: the prompt, the first 28 tokens; labels of those 28 only
    batch = torch.stack([torch.from_numpy(trainer.train_loader.samples[i]) for i in range(4)])
    with torch.no_grad():
        logits = trainer.model(batch[:, :-1])
        by_hand = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:29].flatten()).item()
    trainer.run()
    assert losses(tmp_path / "run")[1] == pytest.approx(by_hand, rel=1e-5)
    for name, param in trainer.model.named_parameters():
        if name != "soft_prompt.weight":
            assert torch.equal(param, start[name]), name  # bitwise the base's
    assert not torch.equal(trainer.model.soft_prompt.weight, prompt0)
    # saved, and read back with the prompt
    _, model = load_model(tmp_path / "run")
    assert torch.equal(model.soft_prompt.weight, trainer.model.soft_prompt.weight)


def test_init_string_gives_its_tokens_embeddings(make_config, tmp_path):
    base = make_config("base.yml", train_iters=1, save=str(tmp_path / "base"), load=None)
    assert main(["train", base]) == 0
    spec = {"enabled": True, "n_tokens": 5, "init_string": "abc"}
    cfg = make_config(
        soft_prompt_tuning=spec, finetune=True, load=str(tmp_path / "base"), train_iters=1
    )
    trainer = Trainer(load_config([cfg]), device="cpu")
    ids = CharLevelTokenizer().encode("abc")
    embed = trainer.model.embed.weight.detach()
    expected = embed[torch.tensor(ids + ids[:2])]  # repeated to n_tokens, as GPT-NeoX does
    assert torch.equal(trainer.model.soft_prompt.weight.detach(), expected)


def test_resume_keeps_the_trained_prompt(make_config, tmp_path):
    base = make_config("base.yml", train_iters=1, save=str(tmp_path / "base"), load=None)
    assert main(["train", base]) == 0
    keys = {"soft_prompt_tuning": PROMPT | {"init_string": "abc"}, "finetune": True}
    whole = make_config("w.yml", save=str(tmp_path / "w"), load=str(tmp_path / "base"), **keys)
    Trainer(load_config([whole]), device="cpu").run()
    cut = make_config(
        "s.yml", save=str(tmp_path / "s"), load=str(tmp_path / "base"), exit_interval=3, **keys
    )
    Trainer(load_config([cut]), device="cpu").run()
    keys["finetune"] = False  # (finetune loads weights only: this run resumes)
    again = make_config("r.yml", save=str(tmp_path / "s"), load=str(tmp_path / "s"), **keys)
    Trainer(load_config([again]), device="cpu").run()
    lw, ls = losses(tmp_path / "w"), losses(tmp_path / "s")
    assert {k: lw[k] for k in range(4, 7)} == {k: ls[k] for k in range(4, 7)}


def test_generation_prepends_the_prompt(make_config, tmp_path):
    cfg = make_config(soft_prompt_tuning=PROMPT, train_iters=1, load=None, cpu_matmul="default")
    assert main(["train", cfg]) == 0
    _, model = load_model(tmp_path / "run")
    model.eval()
    tokens = CharLevelTokenizer().encode("hello wor")
    cached = generate(model, [tokens], Sampling(maximum_tokens=5))
    # greedy by hand, the whole sequence (prompt first) through the model at each token
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert cached == [seq[len(tokens) :]]
    # the prompt is what the model reads first: without it the continuation is another
    with torch.no_grad():
        plain = model.layers  # the same blocks, from the text alone
        x = model.embed(torch.tensor([tokens]))
        rope = model._rope(None, 0, len(tokens))
        bias = model._attention_bias(len(tokens), 0, None, x.device)
        for block in plain.values():
            x, _ = block(x, rope, bias, None)
        alone = F.linear(model.final_norm(x), model.embed.weight)[0, -1]
        prompted = model(torch.tensor([tokens]))[0, -1]
    assert not torch.allclose(alone, prompted)
    # the verb on the checkpoint
    verb = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "hello"]
    assert main([*verb, "--maximum-tokens", "3"]) == 0


def test_hf_export_is_refused_in_one_line(make_config, tmp_path, capsys):
    cfg = make_config(soft_prompt_tuning=PROMPT, train_iters=1, load=None)
    assert main(["train", cfg]) == 0
    capsys.readouterr()
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a soft prompt" in err and "\n" not in err
    assert not (tmp_path / "hf").exists()


def test_a_prompt_left_out_by_the_next_run_is_said_and_one_of_another_size_named(
    make_config, tmp_path, capsys
):
    """A soft prompt cannot be merged into the weights as adapters are: a run started from a
    prompted checkpoint without soft_prompt_tuning says it leaves it out, and one with another
    n_tokens names the key that changed."""
    cfg = make_config(soft_prompt_tuning=PROMPT, train_iters=1, load=None)
    assert main(["train", cfg]) == 0
    plain = make_config("p.yml", load=str(tmp_path / "run"), finetune=True, save=None)
    assert main(["train", plain]) == 0
    said = capsys.readouterr().out
    assert f"warning: {tmp_path / 'run' / 'global_step1'} holds a soft prompt (4 tokens)" in said
    assert "leaves out" in said
    other = PROMPT | {"n_tokens": 2}
    longer = make_config("o.yml", load=str(tmp_path / "run"), finetune=True, save=None,
                         soft_prompt_tuning=other)  # fmt: skip
    assert main(["train", longer]) == 2
    err = capsys.readouterr().err.strip()
    assert "changed since it was saved" in err and "soft_prompt_tuning" in err, err
    assert len(err.splitlines()) == 1


RM = {"train_impl": "rm", "dataset_impl": "pairwise", "pack_impl": "unpacked", "data_path": None}
RM |= {f"{s}_train_{k}data_paths": ["d"] for s in ("pos", "neg") for k in ("", "label_")}


@pytest.mark.parametrize("keys", [{}, RM], ids=["lm", "rm"])
def test_explain_counts_the_trained_parameters(make_config, keys):
    """The prompt (a reward model: and its value head, which trains beside it)."""
    loaded = load_config([make_config(soft_prompt_tuning=PROMPT, **keys)])
    d = derive(loaded)
    assert d["trainable_parameters"] == 4 * 32 + (32 if keys else 0)
    model = build_model(model_args(loaded))
    assert d["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert d["trainable_parameters"] == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )


@pytest.mark.parametrize(
    ("spec", "keys", "message"),
    [
        ({"enabled": True, "num_tokens": 4}, {}, "unknown key num_tokens; did you mean n_tokens?"),
        ({"enabled": True, "n_tokens": 0}, {}, "n_tokens must be an integer >= 1"),
        ({"enabled": True, "n_tokens": 32}, {}, "leaves no text in seq_length 32"),
        ({"enabled": True, "init_range": -1}, {}, "init_range must be a number > 0"),
        (
            PROMPT,
            {"train_impl": "kto", "lora": {"rank": 4}},
            "with lora and train_impl kto cannot keep the reference's prompt",
        ),
    ],
)
def test_refusals_in_one_line(make_config, capsys, spec, keys, message):
    cfg = make_config(soft_prompt_tuning=spec, **keys)
    assert main(["config", "explain", cfg]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_prompt_switched_off_with_no_tokens_is_accepted(make_config, capsys):
    """enabled: false, n_tokens: 0 is how one writes "no prompt": not a mistake."""
    cfg = make_config(soft_prompt_tuning={"enabled": False, "n_tokens": 0})
    assert main(["config", "explain", cfg]) == 0
