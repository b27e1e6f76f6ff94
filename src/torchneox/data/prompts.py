"""The prompts online reinforcement learning samples its rollouts from (``rollout_prompts``).

A JSON-lines file, one record a line (blank lines are skipped), each record either

- ``{"prompt": "text"}``: the text encoded with the run's tokenizer as it is (no end-of-text
  appended), or
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: the chat rendered with the chat
  template of the Hugging Face tokenizer.json (and its tokenizer_config.json) with
  ``add_generation_prompt=True``, as ``preprocess --chat`` renders a chat up to the model's
  turn; the completion sampled is the model's answer.

A record may carry other keys (an ``answer`` a reward function checks, say): the whole record
is kept with the prompt and handed to the reward function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchneox.base.errors import DataError
from torchneox.data.chat import ROLES, ChatTokenizer, check_messages
from torchneox.data.text_input import TOO_DEEP


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its text (a chat's rendering) and its whole record."""

    ids: list[int]
    text: str
    record: dict[str, Any]


def read_prompts(path: str | Path, tokenizer, chat_tokenizer_json: str | None) -> list[Prompt]:
    """Every prompt of the file at ``path``, in order. ``tokenizer`` encodes the plain prompts;
    ``chat_tokenizer_json`` (a tokenizer.json with its tokenizer_config.json beside it; None:
    no chat records) renders the chats. A record that cannot be a prompt is a DataError naming
    the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (rollout_prompts names the prompts file)") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); the prompts file holds "
            "JSON lines"
        ) from None
    chat: list[ChatTokenizer] = []  # read at the first chat record
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt(line, f"{path}:{number}", tokenizer, chat_tokenizer_json, chat))
    if not prompts:
        raise DataError(
            f"{path}: no prompts; write one JSON record a line, "
            '{"prompt": "text"} or {"messages": [{"role": "user", "content": "text"}]}'
        )
    return prompts


def _prompt(
    line: str, where: str, tokenizer, chat_tokenizer_json: str | None, chat: list
) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: {TOO_DEEP}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON object is expected, got {type(record).__name__}")
    if ("prompt" in record) == ("messages" in record):
        what = "both" if "prompt" in record else "neither"
        raise DataError(
            f"{where}: the record has {what} 'prompt' and 'messages'; give one: "
            '{"prompt": "text"} or {"messages": [{"role": "user", "content": "text"}]}'
        )
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str):
            raise DataError(f"{where}: 'prompt' is not a string")
        ids = tokenizer.encode(text) if text else []
    else:
        if chat_tokenizer_json is None:
            raise DataError(
                f"{where}: a 'messages' record is rendered with a chat template, which needs a "
                "Hugging Face tokenizer.json with its tokenizer_config.json "
                '(tokenizer_type HFTokenizer); or write the prompt as text, {"prompt": ...}'
            )
        messages = check_messages(record["messages"], where, "messages", ROLES)
        if not chat:
            chat.append(ChatTokenizer.from_file(chat_tokenizer_json))
        text = chat[0].render(messages, add_generation_prompt=True)
        ids = chat[0].apply(messages, add_generation_prompt=True, where=where)
    if not ids:
        raise DataError(f"{where}: the prompt is empty (no tokens); give it some text")
    return Prompt(ids=list(ids), text=text, record=record)
