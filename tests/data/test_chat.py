"""Chat data: `torchneox preprocess --chat` writes the token, label and reward datasets GPT-NeoX's
preprocess_data_with_chat_template.py wrote for the same jsonl and tokenizer (the golden files),
renders chats as Hugging Face's apply_chat_template does, and names a bad record in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_dir
from tests.helpers import TEMPLATE, make_chat_tokenizer
from torchneox.cli import main
from torchneox.data.chat import IGNORE, ChatOptions, ChatTokenizer, chat_document
from torchneox.data.indexed import IndexedDataset

SHARED = shared_dir()
POST = SHARED / "golden" / "neox_runs" / "post_training" if SHARED else None
needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "A model."},
]


@needs_shared
@pytest.mark.parametrize(
    "jsonl, prefix, keys, flags",
    [
        ("pairs_train.jsonl", "dpo_train", ["chosen", "rejected"], ["--only-last"]),
        ("pairs_valid.jsonl", "rm_valid", ["chosen", "rejected"], ["--for-rm"]),
        ("sft_train.jsonl", "sft_train", ["messages"], []),
        ("kto_test.jsonl", "kto_test", ["messages"], ["--reward-key", "reward"]),
    ],
)
def test_chat_preprocess_writes_gpt_neox_bytes(tmp_path, jsonl, prefix, keys, flags):
    args = ["preprocess", "--input", str(POST / "data" / jsonl), "--jsonl-keys", *keys]
    out = tmp_path / prefix
    args += ["--output-prefix", str(out), "--tokenizer-path", str(POST / "tokenizer"), *flags]
    assert main(args) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    kinds = ["", "_label"] + (["_reward"] if "--reward-key" in flags else [])
    expected = sorted(
        f"{prefix}_{k}{kind}_document.{ext}"
        for k in keys
        for kind in kinds
        for ext in ("bin", "idx")
    )
    assert written == expected
    for name in written:
        assert (tmp_path / name).read_bytes() == (POST / "data" / name).read_bytes(), name


def test_turns_render_as_hugging_face_renders_them(tmp_path):
    """Each turn's tokens are the chat template's own (transformers' apply_chat_template); the
    model's turns are learnt, the others masked; --only-last masks the earlier answers."""
    transformers = pytest.importorskip("transformers")
    folder = make_chat_tokenizer(tmp_path / "tok")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    hf.chat_template = TEMPLATE
    tok = ChatTokenizer.from_file(folder)
    tokens, labels = chat_document(tok, CHAT, ChatOptions(), "chat")
    ids = hf.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    assert tokens == list(ids) + [tok.eos_id]
    assert len(labels) == len(tokens)
    learnt = tok.backend.decode([t for t, lab in zip(tokens, labels, strict=True) if lab != IGNORE])
    assert learnt == "Hello.\nA model.\n"  # both answers (their "\n"), and the end-of-text
    assert labels[-1] == tok.eos_id
    _, last = chat_document(tok, CHAT, ChatOptions(only_last=True), "chat")
    only = tok.backend.decode([t for t, lab in zip(tokens, last, strict=True) if lab != IGNORE])
    assert only == "A model.\n"
    # the prompt of each answer (<|assistant|>) belongs to the user's turn: masked
    assistant = tok.backend.token_to_id("<|assistant|>")
    assert all(lab == IGNORE for t, lab in zip(tokens, labels, strict=True) if t == assistant)


def test_reward_model_data_ends_with_one_labelled_end_of_text(tmp_path):
    tok = ChatTokenizer.from_file(make_chat_tokenizer(tmp_path / "tok"))
    tokens, labels = chat_document(tok, CHAT, ChatOptions(for_rm=True), "chat")
    assert tokens[-2:] == [tok.eos_id, tok.eos_id]
    assert [i for i, lab in enumerate(labels) if lab != IGNORE] == [len(tokens) - 1]


def _chat_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_chat_preprocess_from_the_cli_with_rewards(tmp_path):
    folder = make_chat_tokenizer(tmp_path / "tok")
    data = _chat_jsonl(
        tmp_path / "kto.jsonl",
        [{"messages": CHAT, "reward": 1.0}, {"messages": CHAT[:3], "reward": -1}],
    )
    prefix = tmp_path / "out" / "kto"
    args = ["preprocess", "--input", str(data), "--output-prefix", str(prefix)]
    args += ["--tokenizer-path", str(folder), "--jsonl-keys", "messages", "--reward-key", "reward"]
    assert main(args) == 0
    tokens = IndexedDataset(f"{prefix}_messages_document")
    labels = IndexedDataset(f"{prefix}_messages_label_document")
    rewards = IndexedDataset(f"{prefix}_messages_reward_document")
    assert tokens.dtype == labels.dtype == rewards.dtype == np.int32
    assert list(tokens.sizes) == list(labels.sizes) and len(tokens) == 2
    assert [int(rewards[i][0]) for i in range(2)] == [1, -1]
    # the same outputs again are refused unless --force
    assert main(args) == 2
    assert main([*args, "--force"]) == 0


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "x"}, "data.jsonl:2: no key 'messages' (keys: text)"),
        (
            {"messages": [{"role": "narrator", "content": "x"}]},
            "data.jsonl:2: 'messages' message 0 has the unknown role 'narrator'",
        ),
        ({"messages": "hello"}, "data.jsonl:2: 'messages' is not a list of messages"),
        ({"messages": [{"role": "user"}]}, "data.jsonl:2: 'messages' message 0 has no 'role' and"),
    ],
)
def test_a_bad_chat_record_is_one_line_naming_it(tmp_path, capsys, record, message):
    folder = make_chat_tokenizer(tmp_path / "tok")
    data = _chat_jsonl(tmp_path / "data.jsonl", [{"messages": CHAT}, record])
    args = ["preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "out" / "x")]
    assert main([*args, "--tokenizer-path", str(folder), "--jsonl-keys", "messages"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.bin"))


def test_chat_flags_without_chat_and_a_tokenizer_without_template_are_refused(tmp_path, capsys):
    data = _chat_jsonl(tmp_path / "data.jsonl", [{"messages": CHAT}])
    args = ["preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "x")]
    assert main([*args, "--tokenizer-type", "CharLevelTokenizer", "--only-last"]) == 2
    assert "--only-last is for chat data; add --chat" in capsys.readouterr().err
    folder = make_chat_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main([*args, "--tokenizer-path", str(folder), "--jsonl-keys", "messages"]) == 2
    assert "tokenizer_config.json: no chat_template" in capsys.readouterr().err


def _preprocess(tmp_path, records: list, *flags: str) -> int:
    folder = tmp_path / "tok"
    if not folder.exists():
        make_chat_tokenizer(folder)
    data = _chat_jsonl(tmp_path / "data.jsonl", records)
    args = ["preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "out" / "x")]
    return main([*args, "--tokenizer-path", str(folder), "--jsonl-keys", "messages", *flags])


def _refused(tmp_path, capsys, code: int, message: str) -> None:
    """Exit 2, one line holding ``message``, and no dataset written."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "data.jsonl:2: 'messages' message 1: the content is null; give a string or"),
        (3, "data.jsonl:2: 'messages' message 1: the content is the number 3;"),
        ({"text": "x"}, "data.jsonl:2: 'messages' message 1: the content is the dict"),
        (
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
            "data.jsonl:2: 'messages' message 1 part 1 is a 'image_url' part; only text parts",
        ),
        (["a"], "data.jsonl:2: 'messages' message 1 part 0 is the str \"a\"; only text parts"),
    ],
)
def test_chat_content_that_is_no_text_is_refused_naming_the_message(
    tmp_path, capsys, content, message
):
    chat = [CHAT[1], {"role": "assistant", "content": content}]
    _refused(
        tmp_path, capsys, _preprocess(tmp_path, [{"messages": CHAT}, {"messages": chat}]), message
    )


def test_a_parts_list_s_text_parts_are_joined(tmp_path):
    """OpenAI-style content parts render as their texts concatenated, as a string would."""
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo."}]
    chat = [CHAT[1], {"role": "assistant", "content": parts}]
    assert _preprocess(tmp_path, [{"messages": chat}, {"messages": CHAT[1:3]}]) == 0
    tokens = IndexedDataset(tmp_path / "out" / "x_messages_document")
    labels = IndexedDataset(tmp_path / "out" / "x_messages_label_document")
    assert list(tokens[0]) == list(tokens[1]) and list(labels[0]) == list(labels[1])


def test_a_template_that_does_not_compile_is_one_line_naming_its_file(tmp_path, capsys):
    make_chat_tokenizer(tmp_path / "tok", template="{% for m in messages %}{{ m['content'] }}")
    code = _preprocess(tmp_path, [{"messages": CHAT}])
    _refused(tmp_path, capsys, code, "tokenizer_config.json: the chat template does not compile")


def test_a_template_s_raise_exception_is_one_line_naming_the_record(tmp_path, capsys):
    template = (
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ '<|' + message['role'] + '|>' + message['content'] + '\\n' }}{% endfor %}"
    )
    make_chat_tokenizer(tmp_path / "tok", template=template)
    code = _preprocess(tmp_path, [{"messages": CHAT[1:3]}, {"messages": CHAT}])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "data.jsonl:2: 'messages': the chat template of " in err
    assert err.strip().endswith("refused it: System role not supported")


@pytest.mark.parametrize(
    "reward, flags, message",
    [
        ("NaN", [], "data.jsonl:2: 'reward' is nan; a reward must be a finite number"),
        ("Infinity", [], "data.jsonl:2: 'reward' is inf; a reward must be a finite number"),
        ("1e12", [], "data.jsonl:2: 'reward' is 1000000000000.0, outside int32"),
        ("-3000000000", [], "data.jsonl:2: 'reward' is -3000000000, outside int32"),
        ('"yes"', ["--binary-reward"], "data.jsonl:2: 'reward' is 'yes'; --binary-reward reads"),
        ("-1", ["--binary-reward"], "data.jsonl:2: 'reward' is -1; --binary-reward reads"),
        ("0.5", ["--binary-reward"], "data.jsonl:2: 'reward' is 0.5; --binary-reward reads"),
        ("[" * 5000 + "]" * 5000, [], "data.jsonl:2: the record is nested too deeply to read"),
    ],
    ids=lambda v: v[:20] if isinstance(v, str) else None,
)
def test_a_reward_that_is_not_finite_within_int32_or_a_truth_is_refused(
    tmp_path, capsys, reward, flags, message
):
    good = json.dumps({"messages": CHAT, "reward": 1})
    make_chat_tokenizer(tmp_path / "tok")
    folder = tmp_path / "tok"
    data = tmp_path / "data.jsonl"
    data.write_text(
        good + "\n" + '{"messages": ' + json.dumps(CHAT) + ', "reward": ' + reward + "}\n"
    )
    args = ["preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "out" / "x")]
    args += ["--tokenizer-path", str(folder), "--jsonl-keys", "messages", "--reward-key", "reward"]
    _refused(tmp_path, capsys, main([*args, *flags]), message)


def test_fractional_rewards_are_stored_whole_and_binary_rewards_parsed_strictly(tmp_path):
    """A fractional reward is kept (float32), never truncated to 0; whole ones stay int32 as
    GPT-NeoX writes them; --binary-reward reads "false" as -1."""
    rewards = [0.5, -0.25, 2]
    records = [{"messages": CHAT, "reward": r} for r in rewards]
    assert _preprocess(tmp_path, records, "--reward-key", "reward") == 0
    stored = IndexedDataset(tmp_path / "out" / "x_messages_reward_document")
    assert stored.dtype == np.float32
    assert [float(stored[i][0]) for i in range(3)] == rewards
    # ... and KTO's samples carry them (not 0)
    from torchneox.data.documents import Column, document_samples

    text = IndexedDataset(tmp_path / "out" / "x_messages_document")
    columns = [Column("text", text), Column("reward", stored, per_document=True, dtype=np.float32)]
    samples = document_samples(columns, "unpacked", 3, 128, 1234, True, False)
    assert {float(samples[i]["reward"][0]) for i in range(3)} == set(rewards)
    truths = [True, "false", "TRUE", 0, "1", False]
    records = [{"messages": CHAT, "reward": t} for t in truths]
    assert (
        _preprocess(tmp_path, records, "--reward-key", "reward", "--binary-reward", "--force") == 0
    )
    stored = IndexedDataset(tmp_path / "out" / "x_messages_reward_document")
    assert stored.dtype == np.int32
    assert [int(stored[i][0]) for i in range(6)] == [1, -1, 1, -1, 1, -1]
