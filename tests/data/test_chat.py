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
