"""The rollout prompts file: text prompts encoded, chats rendered up to the model's turn as
`preprocess --chat` renders them, the records kept whole, and every bad line one line naming
the file and line."""

from __future__ import annotations

import json

import pytest

from tests.helpers import make_chat_tokenizer
from torchneox.base.errors import DataError
from torchneox.data.chat import IGNORE, ChatOptions, ChatTokenizer, chat_document
from torchneox.data.prompts import read_prompts
from torchneox.data.tokenizers import CharLevelTokenizer, HFTokenizer


def _write(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_text_and_chat_prompts_with_their_records(tmp_path):
    folder = make_chat_tokenizer(tmp_path / "tok")
    user = {"role": "user", "content": "Reverse abc."}
    path = _write(
        tmp_path / "prompts.jsonl",
        json.dumps({"prompt": "Say hi", "answer": "hi"}),
        "",
        json.dumps({"messages": [user], "answer": "cba"}),
    )
    chat = ChatTokenizer.from_file(folder / "tokenizer.json")
    hf = HFTokenizer(chat.backend, str(folder / "tokenizer.json"))
    plain, rendered = read_prompts(path, hf, str(folder / "tokenizer.json"))
    assert plain.ids == chat.backend.encode("Say hi").ids and plain.text == "Say hi"
    assert plain.record == {"prompt": "Say hi", "answer": "hi"}
    assert rendered.text == "<|user|>Reverse abc.\n<|assistant|>"
    assert rendered.record["answer"] == "cba"
    # what preprocess --chat makes of the chat with an answer: the prompt, then the learnt turn
    tokens, labels = chat_document(
        chat, [user, {"role": "assistant", "content": "cba"}], ChatOptions(), "test"
    )
    assert tokens[: len(rendered.ids)] == rendered.ids
    assert set(labels[: len(rendered.ids)]) == {IGNORE}
    assert labels[len(rendered.ids)] != IGNORE


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "prompts.jsonl:2: invalid JSON"),
        ("[1, 2]", "prompts.jsonl:2: a JSON object is expected, got list"),
        ('{"answer": "x"}', "prompts.jsonl:2: the record has neither 'prompt' and 'messages'"),
        ('{"prompt": "", "answer": "x"}', "prompts.jsonl:2: the prompt is empty"),
        ('{"prompt": 3}', "prompts.jsonl:2: 'prompt' is not a string"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "prompts.jsonl:2: a 'messages'"),
        ('{"messages": [{"role": "king", "content": "hi"}]}', "unknown role 'king'"),
        # nested too deep for json (a RecursionError), or for a message's repr of it
        ("[" * 100_000 + "]" * 100_000, "prompts.jsonl:2: the record is nested too deeply"),
        (  # (as deep as json still reads where the stack is shallow; deeper under xdist)
            '{"messages": [{"role": ' + "[" * 950 + "]" * 950 + ', "content": "hi"}]}',
            (
                "prompts.jsonl:2: 'messages' message 0 has the unknown role [[[[...]]]]; roles are",
                "prompts.jsonl:2: the record is nested too deeply",
            ),
        ),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_a_bad_record_is_one_line_naming_its_line(tmp_path, line, says):
    path = _write(tmp_path / "prompts.jsonl", '{"prompt": "fine"}', line)
    chat = str(make_chat_tokenizer(tmp_path / "tok") / "tokenizer.json")
    with pytest.raises(DataError) as e:
        read_prompts(path, CharLevelTokenizer(), None if 'role": "user' in line else chat)
    either = says if isinstance(says, tuple) else (says,)
    assert any(s in str(e.value) for s in either) and "\n" not in str(e.value), str(e.value)


def test_an_empty_or_missing_file_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"empty\.jsonl: no prompts; write one JSON record"):
        read_prompts(_write(tmp_path / "empty.jsonl", "", "  "), CharLevelTokenizer(), None)
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        read_prompts(tmp_path / "missing.jsonl", CharLevelTokenizer(), None)
