"""Chat records as token and label documents, as GPT-NeoX's
tools/datasets/preprocess_data_with_chat_template.py makes them.

A record's messages (``[{"role": ..., "content": ...}, ...]``) are rendered with the tokenizer's
own chat template (the ``chat_template`` of the Hugging Face ``tokenizer_config.json`` beside
``tokenizer.json``) one turn at a time: turn i's tokens are what rendering messages[: i + 1]
adds to the rendering of messages[: i] (with the generation prompt when the next turn is the
model's). The label of a token is the token itself where the model learns it (the model's
turns; with ``only_last`` only the last turn) and -100 elsewhere; end-of-text follows, learnt
when the turn before it is. ``for_rm``: the whole chat masked, then end-of-text twice, the
second one labelled: the one position a reward model reads its value at.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from torchneox.base.errors import DataError, shown

IGNORE = -100  # the label of a token the loss leaves out (GPT-NeoX's and Hugging Face's)
ROLES = ("system", "user", "assistant", "tool", "ipython")


def _special(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class ChatTokenizer:
    """A tokenizer.json with the chat template and special tokens of its tokenizer_config.json."""

    backend: Any  # tokenizers.Tokenizer
    template: str
    specials: dict[str, str]  # bos_token, eos_token, pad_token, unk_token as the template sees them
    eos_id: int | None
    source: str

    @classmethod
    def from_file(cls, tokenizer_json: str | Path) -> ChatTokenizer:
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{path}: no such file (a chat template needs the tokenizer.json)")
        config_path = path.with_name("tokenizer_config.json")
        beside = path.with_name("chat_template.jinja")  # where transformers >= 4.52 saves it
        if not config_path.is_file() and not beside.is_file():
            raise DataError(
                f"{config_path}: no such file; chat preprocessing renders messages with the "
                "chat_template of the Hugging Face tokenizer_config.json beside tokenizer.json "
                "(or the chat_template.jinja newer transformers save)"
            )
        try:
            config = (
                json.loads(config_path.read_text(encoding="utf-8"))
                if config_path.is_file()
                else {}  # the template from chat_template.jinja, as transformers reads it
            )
            backend = Tokenizer.from_file(str(path))
        except (ValueError, OSError) as e:
            raise DataError(f"{config_path.parent}: cannot read the tokenizer ({e})") from None
        if not isinstance(config, dict):
            raise DataError(f"{config_path}: not a JSON object; download it again")
        template = config.get("chat_template")
        if template is None and beside.is_file():
            template = beside.read_text(encoding="utf-8")
        if isinstance(template, list):  # several named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            raise DataError(
                f"{config_path}: no chat_template; add one (a Jinja template over 'messages') "
                "or preprocess plain text without --chat"
            )
        specials = {
            name: text
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _special(config.get(name))) is not None
        }
        eos = specials.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos is not None else None
        try:
            _compiled(template)  # a template that does not compile is said before any reading
        except DataError as e:
            raise DataError(f"{config_path}: {e}") from None
        return cls(backend, template, specials, eos_id, str(config_path))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return _compiled(self.template)(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.specials
        )

    def apply(
        self, messages: list[dict], add_generation_prompt: bool = False, where: str = "a chat"
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes its own special tokens); a
        template that fails (its own ``raise_exception`` too) is a DataError naming ``where``."""
        from jinja2.exceptions import TemplateError

        render = _compiled(self.template)  # outside the try: its DataError is a ValueError
        try:
            text = render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.specials
            )
        except TemplateError as e:  # raise_exception's message, or an undefined name
            raise DataError(
                f"{where}: the chat template of {self.source} refused it: {e}"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise DataError(
                f"{where}: the chat template of {self.source} failed on it "
                f"({type(e).__name__}: {e})"
            ) from None
        return self.backend.encode(text, add_special_tokens=False).ids


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str):
    """The template compiled as Hugging Face compiles chat templates: a sandbox, trimmed
    blocks, loop controls, ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps
    non-ASCII text."""
    if template not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            _TEMPLATES[template] = env.from_string(template).render
        except TemplateError as e:
            raise DataError(f"the chat template does not compile ({e})") from None
    return _TEMPLATES[template]


@dataclass(frozen=True)
class ChatOptions:
    generation_role: str = "assistant"
    mask: bool = True  # False (--no-mask): every token is learnt, no label dataset is written
    only_last: bool = False
    for_rm: bool = False


def _content(value: Any, where: str) -> str:
    """A message's content as its template reads it: a string, or an OpenAI-style list of
    parts whose text parts are concatenated (as Hugging Face's multimodal chat templates render
    them: each text part's text, no separator); anything else a DataError."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for n, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
                continue
            what = f"a {kind!r} part" if isinstance(kind, str) else f"{_shown(part)}"
            raise DataError(
                f"{where} part {n} is {what}; only text parts ({{'type': 'text', 'text': ...}}) "
                "can be learnt: remove the others or describe them in text"
            )
        return "".join(texts)
    raise DataError(
        f"{where}: the content is {_shown(value)}; give a string or a list of text parts "
        "({'type': 'text', 'text': ...})"
    )


def _shown(value: Any) -> str:
    """A JSON value as a message names it (short)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (RecursionError, TypeError, ValueError):  # nested too deep; not JSON
        text = shown(value)
    return f"the {type(value).__name__} " + (text if len(text) <= 40 else text[:37] + "...")


def check_messages(messages: Any, where: str, key: str, roles: tuple[str, ...]) -> list[dict]:
    """The record's messages, each content a string (a parts list's text joined), or a
    DataError naming the record, the message and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} is not a list of messages ({{'role', 'content'}})")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: {key!r} message {n} has no 'role' and 'content'")
        if not isinstance(m["role"], str) or m["role"] not in roles:
            raise DataError(
                f"{where}: {key!r} message {n} has the unknown role {shown(m['role'])}; roles are "
                + ", ".join(roles)
            )
        out.append({**m, "content": _content(m["content"], f"{where}: {key!r} message {n}")})
    return out


def chat_document(
    tok: ChatTokenizer, messages: list[dict], opts: ChatOptions, where: str
) -> tuple[list[int], list[int]]:
    """The chat's token ids and labels (GPT-NeoX's build_chat)."""
    if not opts.mask:
        tokens = tok.apply(messages, where=where)
        return tokens, list(tokens)
    if opts.for_rm:
        if tok.eos_id is None:
            raise DataError(f"{tok.source}: no eos_token, which a reward model's data ends with")
        tokens = tok.apply(messages, where=where)
        return [*tokens, tok.eos_id, tok.eos_id], [IGNORE] * (len(tokens) + 1) + [tok.eos_id]
    tokens: list[int] = []
    labels: list[int] = []
    for i, turn in enumerate(messages):
        gen = i + 1 < len(messages) and messages[i + 1]["role"] == opts.generation_role
        rendered = tok.apply(messages[: i + 1], add_generation_prompt=gen, where=where)
        if rendered[: len(tokens)] != tokens:
            raise DataError(
                f"{where}: the chat template does not render turn by turn (turn {i} changes the "
                "tokens of the turns before it), so the turns cannot be masked apart"
            )
        new = rendered[len(tokens) :]
        tokens.extend(new)
        learnt = turn["role"] == opts.generation_role and (
            not opts.only_last or i == len(messages) - 1
        )
        labels.extend(new if learnt else [IGNORE] * len(new))
    if tok.eos_id is not None:
        labels.append(tok.eos_id if labels and labels[-1] != IGNORE else IGNORE)
        tokens.append(tok.eos_id)
    return tokens, labels


INT32 = 2**31 - 1
TRUE, FALSE = ("true", "1"), ("false", "0")


def reward_value(record: dict, key: str, binary: bool, where: str) -> float:
    """A record's reward: a finite number within int32 (GPT-NeoX's reward dtype), stored as
    int32 when every reward is whole and as float32 otherwise (GPT-NeoX truncates); with
    ``binary`` +1 / -1 from true / false, 1 / 0 (booleans, numbers or strings; GPT-NeoX takes
    any value's truthiness, so its "false" is +1)."""
    if key not in record:
        raise DataError(f"{where}: no key {key!r} (keys: {', '.join(record)})")
    value = record[key]
    if binary:
        word = value.strip().lower() if isinstance(value, str) else value
        if word is True or (not isinstance(word, bool) and word in (*TRUE, 1)):
            return 1
        if word is False or (not isinstance(word, bool) and word in (*FALSE, 0)):
            return -1
        raise DataError(
            f"{where}: {key!r} is {shown(value)}; --binary-reward reads true / false or 1 / 0 "
            "(booleans, numbers or strings): fix the record, or drop --binary-reward to store "
            "the numbers themselves"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(f"{where}: {key!r} is {shown(value)}, not a number")
    if not math.isfinite(value):
        raise DataError(f"{where}: {key!r} is {value!r}; a reward must be a finite number")
    if abs(value) > INT32:
        raise DataError(
            f"{where}: {key!r} is {value!r}, outside int32 (+-{INT32:,}, GPT-NeoX's reward "
            "type); scale the rewards down"
        )
    return value
