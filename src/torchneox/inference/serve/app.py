"""The OpenAI-compatible HTTP server: FastAPI routes over the engine, and uvicorn running them
until SIGTERM or Ctrl-C, which stop taking connections and let the requests in flight finish.

GET /v1/models, POST /v1/completions and /v1/chat/completions (``stream``: server-sent
events), GET /health (the engine's counts, no key needed). Every mistake in a request is
OpenAI's error body with its 4xx status; a fault of the server's own is a 500 with the same
body, and the server goes on."""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from torchneox.base.errors import DataError
from torchneox.data.chat import ChatTokenizer
from torchneox.data.tokenizers import Tokenizer
from torchneox.inference.generate import Sampling
from torchneox.inference.serve import protocol
from torchneox.inference.serve.engine import Engine, Job, QueueFull
from torchneox.inference.serve.protocol import APIError, Params
from torchneox.inference.serve.responses import Call

DISCONNECT_LOOK = 0.25
COMPLETION_MAX_TOKENS = 16
"""OpenAI's default max_tokens of a completion (a chat's runs to the context's end)."""


@dataclass
class Served:
    """What the routes serve: the model names (the base first, then the adapters), their
    tokenizer, chat template and stop tokens, and the engine decoding them."""

    names: list[str]
    tokenizer: Tokenizer
    chat: ChatTokenizer | None
    no_chat: str
    """Why the chat endpoint is refused, when ``chat`` is None."""
    stop_ids: set[int]
    max_seq_len: int
    vocab: int
    engine: Engine
    api_key: str | None = None
    max_body: int = 8 << 20


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="torchneox", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{e.detail}: see GET /v1/models, POST /v1/completions, /v1/chat/completions"
        return JSONResponse(APIError(e.status_code, message, code=code).body(), e.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:
        error = APIError(500, f"the server failed: {type(e).__name__}: {e}", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"} | served.engine.stats()

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _authorize(served, request)
        return {"object": "list", "data": [_model(name) for name in served.names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict:
        _authorize(served, request)
        if name not in served.names:
            raise protocol.unknown_model(name, served.names)
        return _model(name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completions(served, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _chat(served, request)

    return app


async def _completions(served: Served, request: Request):
    body = await _body(served, request)
    p = protocol.common(body, chat=False)
    _known(served, p.model)
    ids = [
        (served.tokenizer.encode(x) or [served.tokenizer.eod_id]) if isinstance(x, str) else x
        for x in protocol.prompts(body, served.vocab)
    ]
    budgets = [
        protocol.context_check(
            "prompt", len(i), p.max_tokens, served.max_seq_len, COMPLETION_MAX_TOKENS
        )
        for i in ids
    ]
    call = Call(p.model, False, served.tokenizer, ids, p.n)
    return await _answer(served, request, call, p, budgets, served.stop_ids)


async def _chat(served: Served, request: Request):
    body = await _body(served, request)
    p = protocol.common(body, chat=True)
    _known(served, p.model)
    messages = protocol.messages(body)
    if served.chat is None:
        raise protocol.invalid("messages", served.no_chat, code="no_chat_template")
    try:
        ids = served.chat.apply(messages, add_generation_prompt=True, where="messages")
    except DataError as e:
        raise protocol.invalid("messages", str(e)) from None
    budget = protocol.context_check("messages", len(ids), p.max_tokens, served.max_seq_len, None)
    stops = served.stop_ids | ({served.chat.eos_id} - {None})
    call = Call(p.model, True, served.tokenizer, [ids], p.n)
    return await _answer(served, request, call, p, [budget], stops)


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "torchneox"}


def _authorize(served: Served, request: Request) -> None:
    if served.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), served.api_key):
        raise APIError(
            401,
            "Incorrect API key provided: give the server's --api-key as the Bearer token "
            "(Authorization: Bearer KEY, or the OpenAI client's api_key)",
            code="invalid_api_key",
        )


def _known(served: Served, name: str) -> None:
    if name not in served.names:
        raise protocol.unknown_model(name, served.names)


async def _body(served: Served, request: Request) -> dict:
    """The request's JSON object, refused past ``max_body`` bytes (413) before it is read."""
    _authorize(served, request)
    limit = served.max_body
    too_large = APIError(
        413,
        f"the body is over this server's limit of {limit} bytes (serve --max-body); send "
        "a shorter prompt",
        code="request_too_large",
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > limit:
            raise too_large
    return protocol.parse_json(bytes(raw))


def _jobs(call: Call, p: Params, budgets: list[int], lane: str, stops: set[int]) -> list[Job]:
    jobs = []
    for prompt, budget in zip(call.prompts, budgets, strict=True):
        for j in range(p.n):
            seed = None if p.seed is None else (p.seed + j) % 2**63
            stop_ids = set() if p.ignore_eos else set(stops)
            s = Sampling(p.temperature, p.top_k, p.top_p, budget, stop_ids, seed=seed)
            jobs.append(
                Job(
                    lane,
                    prompt,
                    budget,
                    s,
                    call.choice(p.stop),
                    logprobs=p.logprobs,
                    prompt_logprobs=p.echo and p.logprobs is not None,
                )
            )
    return jobs


async def _answer(
    served: Served, request: Request, call: Call, p: Params, budgets: list[int], stops: set[int]
):
    engine = served.engine
    jobs = _jobs(call, p, budgets, p.model, stops)
    if len(jobs) > engine.max_batch + engine.max_queue:
        raise protocol.invalid(
            "n" if len(call.prompts) == 1 else "prompt",
            f"{len(jobs)} choices are more than this server holds at once "
            f"({engine.max_batch} running + {engine.max_queue} waiting): ask for fewer",
        )
    try:
        engine.submit(jobs)
    except QueueFull:
        raise APIError(
            429,
            f"the server is busy: {engine.max_batch} requests running and {engine.max_queue} "
            "waiting; retry shortly",
            code="rate_limit_exceeded",
            kind="rate_limit_error",
        ) from None
    if p.stream:
        return StreamingResponse(_stream(engine, call, jobs, p), media_type="text/event-stream")
    watcher = asyncio.create_task(_cancel_when_gone(request, engine, jobs))
    try:
        while call.open:
            await call.next()
    finally:
        watcher.cancel()
        if call.open:
            engine.cancel(jobs)
    _raise_failures(call)
    return call.response(p.echo, p.logprobs)


async def _cancel_when_gone(request: Request, engine: Engine, jobs: list[Job]) -> None:
    """A client waiting for a whole answer that goes away: its jobs cancelled (looked at every
    DISCONNECT_LOOK seconds; a stream's client is seen gone when a chunk cannot be sent)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_LOOK)
    engine.cancel(jobs)


def _raise_failures(call: Call) -> None:
    failed = [o.error for o in call.outcomes if o.reason == "error"]
    if failed:
        raise APIError(500, f"generation failed: {failed[0]}", kind="server_error")


async def _stream(engine: Engine, call: Call, jobs: list[Job], p: Params) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, then usage when asked, then [DONE]. A
    client that goes away cancels its jobs (the ``finally``)."""
    started: set[int] = set()
    try:
        while call.open:
            event = await call.next()
            if event.reason == "error":
                body = APIError(500, f"generation failed: {event.error}", kind="server_error")
                yield f"data: {json.dumps(body.body())}\n\n"
                return
            chunk = call.chunk(event, event.index not in started, p.echo, p.logprobs)
            if chunk is not None:
                started.add(event.index)
                yield f"data: {json.dumps(chunk)}\n\n"
        if p.include_usage:
            yield f"data: {json.dumps(call.usage_chunk())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if call.open:
            engine.cancel(jobs)


def run(app: FastAPI, host: str, port: int, on_ready: Callable[[str, int], None]) -> None:
    """Serve until SIGTERM or Ctrl-C; then stop listening and let the requests in flight
    finish (SIGTERM then returns normally: exit status 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and self.servers:
                bound = self.servers[0].sockets[0].getsockname()
                on_ready(bound[0], bound[1])

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured and captured[-1] == sig:
                captured.pop()  # drained: not raised again once the server is down

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="off"
    )
    Server(config).run()
