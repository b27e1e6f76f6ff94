"""A request's choices as they generate, and OpenAI's responses and stream chunks made of
them. The engine's thread calls each choice (its job's ``Sink``): the tokens become text there,
stop sequences end it there, and each event goes to the request's asyncio queue, which the
web side reads. No web here."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from torchneox.data.tokenizers import Tokenizer

LogProb = tuple[float, list[tuple[int, float]]]
"""A token's log-probability and the top tokens' (id, log-probability)."""


class ChoiceText:
    """Tokens to text as they come: each new piece decoded in a short window (the text a
    token adds can depend on the tokens before it), a piece that ends in a cut UTF-8
    character held back, the text cut at the first stop sequence, and what may begin one
    not sent until the next tokens say it does not."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.prefix = self.read = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Take a token; False when a stop sequence ended the text."""
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read])
        after = decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            old = len(self.text)
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            return not self._stop_from(max(0, old - max((len(s) for s in self.stops), default=0)))
        return True

    def _stop_from(self, start: int) -> bool:
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
        return self.stopped

    def ready(self) -> str:
        """The text not sent yet that no later token can take back."""
        end = len(self.text)
        if not self.stopped:
            for s in self.stops:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> str:
        """The whole text once the choice ended: the tokens decoded together (as ``generate``
        decodes them), unless a stop sequence cut them; returns what was not sent yet."""
        if not self.stopped:
            whole = self.tokenizer.decode(self.ids)
            if whole.startswith(self.text[: self.sent]):
                self.text = whole
            self._stop_from(max(0, self.sent - max((len(s) for s in self.stops), default=0)))
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass
class Event:
    index: int
    kind: str  # "prompt", "token", "done"
    text: str = ""
    token: int | None = None
    logprob: LogProb | None = None
    prompt: list[LogProb] | None = None
    reason: str | None = None
    error: str | None = None


class Choice:
    """One choice's job sink (called on the engine's thread)."""

    def __init__(self, index: int, call: Call, tokenizer: Tokenizer, stops: list[str]):
        self.index, self.call = index, call
        self.text = ChoiceText(tokenizer, stops)

    def prompt_logprobs(self, rows: list[LogProb]) -> None:
        self.call.put(Event(self.index, "prompt", prompt=rows))

    def token(self, token: int, logprob: LogProb | None) -> bool:
        go_on = self.text.add(token)
        self.call.put(Event(self.index, "token", self.text.ready(), token, logprob))
        return go_on

    def done(self, reason: str, error: str | None = None) -> None:
        tail = self.text.finish()
        if self.text.stopped and reason in ("stop", "length"):
            reason = "stop"
        self.call.put(Event(self.index, "done", tail, reason=reason, error=error))


@dataclass
class Outcome:
    """What the web side gathered of one choice."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[LogProb] = field(default_factory=list)
    prompt_logprobs: list[LogProb] | None = None
    reason: str | None = None
    error: str | None = None


class Call:
    """One request: its choices' events on an asyncio queue, gathered into outcomes and made
    into OpenAI's objects. Choice i is prompt ``i // n``'s choice ``i % n``."""

    def __init__(
        self, model: str, chat: bool, tokenizer: Tokenizer, prompts: list[list[int]], n: int
    ):
        self.n = n
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.model, self.chat, self.tokenizer, self.prompts = model, chat, tokenizer, prompts
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.outcomes: list[Outcome] = []
        self.open = 0

    def choice(self, stops: list[str]) -> Choice:
        self.outcomes.append(Outcome())
        self.open += 1
        return Choice(len(self.outcomes) - 1, self, self.tokenizer, stops)

    def put(self, event: Event) -> None:  # from the engine's thread
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self) -> Event:
        """The next event, gathered into its choice's outcome."""
        event = await self.queue.get()
        o = self.outcomes[event.index]
        if event.kind == "prompt":
            o.prompt_logprobs = event.prompt
        elif event.kind == "token":
            o.tokens.append(event.token)
            if event.logprob is not None:
                o.logprobs.append(event.logprob)
        else:
            o.reason, o.error = event.reason, event.error
            self.open -= 1
        o.text += event.text
        return event

    # ------------------------------------------------------------------ the objects

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(o.tokens) for o in self.outcomes)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, echo: bool, logprobs: int | None) -> dict:
        """The whole answer (not streamed)."""
        choices = []
        for i, o in enumerate(self.outcomes):
            if self.chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": o.text},
                        "logprobs": self._chat_logprobs(o.tokens, o.logprobs)
                        if logprobs is not None
                        else None,
                        "finish_reason": o.reason,
                    }
                )
                continue
            text, lp = o.text, None
            prompt = self.prompts[i // self.n]
            if echo:
                text = self.tokenizer.decode(prompt) + text
            if logprobs is not None:
                lp = self._completion_logprobs(o, prompt if echo else None)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": o.reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return self._head(obj) | {"choices": choices, "usage": self.usage()}

    def chunk(self, event: Event, first: bool, echo: bool, logprobs: int | None) -> dict | None:
        """The stream chunk of an event (None: nothing to send)."""
        reason = event.reason if event.kind == "done" else None
        tokens = [event.token] if event.kind == "token" else []
        lps = [event.logprob] if event.logprob is not None else []
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if event.text:
                delta["content"] = event.text
            if not delta and reason is None and not lps:
                return None
            lp = self._chat_logprobs(tokens, lps) if logprobs is not None and lps else None
            choice = {"index": event.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        text, prompt = event.text, self.prompts[event.index // self.n]
        if echo and first:
            text = self.tokenizer.decode(prompt) + text
        if not text and reason is None and not lps and event.kind != "prompt":
            return None
        lp = None
        if logprobs is not None:
            one = Outcome(tokens=tokens, logprobs=lps, prompt_logprobs=event.prompt)
            lp = self._completion_logprobs(one, prompt if event.kind == "prompt" else None)
        choice = {"index": event.index, "text": text, "logprobs": lp, "finish_reason": reason}
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": self.usage()}

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _completion_logprobs(self, o: Outcome, prompt: list[int] | None) -> dict:
        tokens, values, tops = [], [], []
        if prompt is not None:  # echo: the prompt's tokens first, the first without one
            rows = o.prompt_logprobs or []
            tokens += [self._piece(t) for t in prompt]
            values.append(None)
            tops.append(None)
            values += [lp for lp, _ in rows]
            tops += [{self._piece(t): v for t, v in top} for _, top in rows]
        tokens += [self._piece(t) for t in o.tokens]
        values += [lp for lp, _ in o.logprobs]
        tops += [{self._piece(t): v for t, v in top} for _, top in o.logprobs]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, tokens: list[int], logprobs: list[LogProb]) -> dict:
        def entry(token: int, value: float) -> dict:
            piece = self._piece(token)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

        content = [
            entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top]}
            for t, (lp, top) in zip(tokens, logprobs, strict=False)
        ]
        return {"content": content}
