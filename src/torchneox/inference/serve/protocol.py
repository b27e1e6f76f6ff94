"""OpenAI's request bodies read and checked: each mistake an ``APIError`` with the status,
the parameter and a message a user can act on, as OpenAI's API answers it. No web here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from torchneox.base.errors import DataError, shown


class APIError(Exception):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}} and its status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "the body is not UTF-8 JSON", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(
            400,
            f"the body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); send "
            "a JSON object",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deep", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body is {_kind(body)}; send a JSON object", code="invalid_json")
    return body


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name, f"{name} is {_kind(value)}; give a number from {low} to {high}")
    if not low <= value <= high:
        raise invalid(name, f"{name} {value} is out of range: give a number from {low} to {high}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"{name} is {_kind(value)}; give an integer from {low} to {high}")
    if not low <= value <= high:
        raise invalid(name, f"{name} {value} is out of range: give an integer from {low} to {high}")
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"{name} is {_kind(value)}; give true or false")
    return value


def _stops(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or not 1 <= len(stops) <= 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise invalid("stop", "stop is a string or a list of 1 to 4 non-empty strings")
    return stops


UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "suffix": "",
    "tools": [],
    "functions": [],
}
"""Parameters the server does not build, accepted only at the value that changes nothing."""


@dataclass
class Params:
    """What a completion or chat request asks of generation."""

    model: str
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    """Top tokens beside each token's log-probability (None: no log-probabilities)."""
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    """vLLM's extension: generate past the stop tokens (a benchmark's fixed lengths)."""


def common(body: dict, chat: bool) -> Params:
    """The parameters both endpoints take, range-checked as OpenAI checks them."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model is required: the name of a served model (GET /v1/models)")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in (None, neutral):
            raise invalid(name, f"{name} is not supported by this server; leave it out")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise invalid("best_of", "best_of is not supported by this server; leave it out")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise invalid("response_format", "only the text response_format is supported")
    tokens_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    max_tokens = _integer(body, tokens_key or "max_tokens", None, 0, 2**31 - 1)
    p = Params(model=model, max_tokens=max_tokens)
    p.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    p.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    p.top_k = _integer(body, "top_k", 0, -1, 2**31 - 1) or 0
    p.top_k = max(p.top_k, 0)
    p.stop = _stops(body)
    p.seed = _integer(body, "seed", None, -(2**63), 2**63 - 1)
    p.n = _integer(body, "n", 1, 1, 128) or 1
    p.stream = _boolean(body, "stream")
    p.ignore_eos = _boolean(body, "ignore_eos")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", "stream_options is an object: {include_usage: bool}")
        if not p.stream:
            raise invalid("stream_options", "stream_options is only allowed with stream true")
        p.include_usage = _boolean(options, "include_usage")
    if chat:
        if _boolean(body, "logprobs"):
            p.logprobs = _integer(body, "top_logprobs", 0, 0, 20)
        elif body.get("top_logprobs") is not None:
            raise invalid("top_logprobs", "top_logprobs needs logprobs true")
    else:
        p.logprobs = _integer(body, "logprobs", None, 0, 5)
        p.echo = _boolean(body, "echo")
    if max_tokens == 0 and not p.echo:
        raise invalid(tokens_key or "max_tokens", "max_tokens 0 is only allowed with echo")
    return p


def prompts(body: dict, vocab: int) -> list[list[int] | str]:
    """The completions endpoint's prompt: a string, a list of strings, a list of token ids,
    or a list of those lists."""
    value = body.get("prompt")
    what = "prompt is a string, a list of strings, a list of token ids or a list of such lists"
    if value is None:
        raise invalid("prompt", f"prompt is required; {what}")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid("prompt", f"prompt is {_kind(value)}; {what}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    out: list[list[int] | str] = []
    for item in value:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and not item:
            raise invalid("prompt", "a prompt of token ids is empty; give at least one token")
        elif isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise invalid(
                    "prompt", f"token id {bad[0]} is outside the vocabulary (0-{vocab - 1})"
                )
            out.append(item)
        else:
            raise invalid("prompt", f"a prompt item is {_kind(item)}; {what}")
    return out


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


def messages(body: dict) -> list[dict]:
    """The chat's messages, each content a string (text parts joined); a developer message is
    given to the template as a system one."""
    from torchneox.data.chat import check_messages

    try:
        checked = check_messages(body.get("messages"), "messages", "messages", ROLES)
    except DataError as e:
        raise invalid("messages", str(e).removeprefix("messages: ")) from None
    return [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in checked]


def context_check(
    param: str, prompt_tokens: int, max_tokens: int | None, limit: int, default: int | None
) -> int:
    """The tokens a choice may generate: ``max_tokens`` (or ``default``, None: up to the last
    position), refused as OpenAI does when the prompt and it pass the context."""
    if prompt_tokens >= limit or (max_tokens is not None and prompt_tokens + max_tokens > limit):
        asked = prompt_tokens + (max_tokens or 0)
        where = "messages" if param == "messages" else "prompt"
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{asked} tokens ({prompt_tokens} in the {where}, {max_tokens or 0} in the "
            f"completion). Please reduce the length of the {where} or completion.",
            param,
            "context_length_exceeded",
        )
    room = limit - prompt_tokens
    if max_tokens is not None:
        return max_tokens
    return room if default is None else min(default, room)


def unknown_model(name: str, served: list[str]) -> APIError:
    return APIError(
        404,
        f"The model {shown(name)} does not exist: this server serves "
        + ", ".join(served)
        + " (GET /v1/models)",
        "model",
        "model_not_found",
    )
