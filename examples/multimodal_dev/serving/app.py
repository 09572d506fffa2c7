"""The HTTP side of the endpoint (Starlette, served by uvicorn in a thread of rank 0): OpenAI's
``POST /v1/chat/completions`` and ``GET /v1/models``.

A request is checked (``chat_request.py``) and its prompt encoded by the data path's reader, as
training reads a conversation, before it queues: a bad request is answered at once with a 4xx JSON
error naming the field, and never reaches the decoding loop. Answers come back from the loop as events
(``engine.Job``); with ``stream`` they go out as server-sent events as the text grows.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..data.sample import DataError
from ..generation.decode import Prompt, Sampling
from .chat_request import ChatRequest, Limits, RequestError, parse_chat_request
from .engine import Engine, Job, QueueFull, Row, Stopping

if TYPE_CHECKING:
    from ..data.jsonl import JsonlConversations


@dataclass
class Served:
    name: str  # the model name requests give
    engine: Engine
    reader: JsonlConversations  # the prompt reader (the processor, media as training reads them)
    limits: Limits
    max_prompt_tokens: int


def error_response(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def build_app(served: Served) -> Starlette:
    created = int(time.time())
    media_dir = tempfile.mkdtemp(prefix="serve_media_")  # relative paths are refused before it matters

    async def models(_: Request) -> JSONResponse:
        model = {"id": served.name, "object": "model", "created": created, "owned_by": "multimodal_dev"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat_completions(request: Request):
        try:
            chat = parse_chat_request(await _body(request, served.limits.max_body_bytes), served.name, served.limits)
            prompt = await run_in_threadpool(_encode, served, chat, media_dir)
            events: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            row = Row(prompt, _sampling(chat), chat.max_tokens, chat.stop)
            job = Job(row, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            try:
                served.engine.submit(job)
            except QueueFull as full:
                raise RequestError(429, f"the server is busy: {full}; try again later") from None
            except Stopping as stopping:
                raise RequestError(503, str(stopping), code="server_stopping") from None
        except RequestError as err:
            return error_response(err)
        answer_id, started = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": answer_id, "created": started, "model": served.name}
        if chat.stream:
            return StreamingResponse(_stream(events, head, chat.include_usage), media_type="text/event-stream")
        parts = []
        while True:
            event = await events.get()
            if "delta" in event:
                parts.append(event["delta"])
            elif "error" in event:
                return error_response(_answer_error(event))
            else:
                done = event["done"]
                message = {"role": "assistant", "content": "".join(parts)}
                choice = {"index": 0, "message": message, "finish_reason": done["finish_reason"], "logprobs": None}
                if chat.return_token_ids:
                    choice["token_ids"] = done["token_ids"]
                body = {**head, "object": "chat.completion", "choices": [choice], "usage": done["usage"]}
                return JSONResponse(body)

    async def not_found(request: Request, _exc) -> JSONResponse:
        return error_response(RequestError(404, f"no route {request.method} {request.url.path}"))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


async def _body(request: Request, limit: int) -> bytes:
    """The body, read no further than ``limit`` bytes: a declared length over it is refused unread,
    and a chunked one (no Content-Length) as soon as it passes it."""
    header = request.headers.get("content-length", "")
    if header.isdigit() and int(header) > limit:
        raise RequestError(413, f"the body is {header} bytes, over the server's --max-request-bytes {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"the body passed {limit} bytes, the server's --max-request-bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the client went, or was cut off at --request-timeout (http_timeout.py)
        raise RequestError(408, "the request was not received in full") from None
    return b"".join(chunks)


def _answer_error(event: dict) -> RequestError:
    """The error a request hears from the decoding loop: 503 while the server stops, else 500."""
    status = event.get("status", 500)
    return RequestError(status, event["error"], code="server_stopping" if status == 503 else "server_error")


def _encode(served: Served, chat: ChatRequest, media_dir: str) -> Prompt:
    """The request's prompt as the data path encodes a conversation (chat template with the generation
    prompt, images read and sized as in training)."""
    try:
        sample, _ = served.reader.prompt_sample(chat.record, media_dir, "request")
    except DataError as err:
        raise RequestError(400, str(err).removeprefix("request: "), "messages") from None
    ids = sample["input_ids"].tolist()
    if len(ids) > served.max_prompt_tokens:
        raise RequestError(
            400,
            f"messages: the prompt is {len(ids)} tokens, over the server's --max-prompt-tokens "
            f"{served.max_prompt_tokens}",
            "messages",
        )
    return Prompt(ids, **{k: v for k, v in sample.items() if k != "input_ids"})


def _sampling(chat: ChatRequest) -> Sampling:
    seed = chat.seed if chat.seed is not None else secrets.randbits(63)  # unseeded: a draw of its own
    return Sampling(chat.temperature, chat.top_k, chat.top_p, seed)


async def _stream(events: asyncio.Queue, head: dict, include_usage: bool):
    """Server-sent events: a first chunk with the role, the text as it grows, the finish reason, the
    usage where asked, then ``[DONE]``."""

    def chunk(delta: dict, finish=None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        body = {**head, "object": "chat.completion.chunk", "choices": [choice], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    while True:
        event = await events.get()
        if "delta" in event:
            yield chunk({"content": event["delta"]})
        elif "error" in event:
            yield f"data: {json.dumps(_answer_error(event).body())}\n\n"
            return
        else:
            done = event["done"]
            yield chunk({}, done["finish_reason"])
            if include_usage:
                body = {**head, "object": "chat.completion.chunk", "choices": [], "usage": done["usage"]}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
