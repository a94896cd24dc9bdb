"""`streamoe serve`: the OpenAI-compatible HTTP API and the chat page, a Starlette app run by uvicorn.

Handlers read a request's body and hand it to the prepare thread, which parses and checks it (`openai_api`)
and prepares it into a job (rendered, tokenized, inside the planned context), so that the event loop only
moves bytes; they queue the job for the one engine thread (`worker`), and turn the events that come back
into an OpenAI response: one JSON object, or server-sent events ending in `data: [DONE]`. Every refusal is OpenAI's
error object with its status; nothing a request sends is ever a path or a URL the server opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ...formats.errors import StreamoeError
from .. import ranks
from ..plan import current_rss
from ..tool_calls import dumps_exact
from . import anthropic_api, responses_api
from .chat_output import collect
from .door import (
    ACCEPT_BURST,
    LISTEN_BACKLOG,
    PIECE,
    Admission,
    Door,
    RateLimitedLoopErrors,
    anthropic_route,
    anthropic_status,
    bound_socket_buffers,
    connection_limit,
    guarded_protocol,
)
from .lockstep import follow
from .metrics import exposition
from .openai_api import (
    APIError,
    GenRequest,
    Limits,
    bad,
    call_text,
    call_verdict,
    check_shape,
    kept_bytes,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from .response_store import ResponseStore
from .worker import Job, Server, open_engine

STATIC = Path(__file__).resolve().parent / "static"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


async def read_body(request: Request, limits: Limits, timeout_s: float) -> bytearray:
    """The raw body, read no further than the size limit and no longer than `timeout_s` (a stalled body
    would hold its admission). A body in a content coding (gzip...) is refused, not read as JSON: none is taken."""
    coding = request.headers.get("content-encoding", "identity").strip().lower()
    if coding != "identity":
        raise APIError(415, f"Content-Encoding {coding[:40]!r} is not supported: send the body uncompressed",
                       code="unsupported_content_encoding")
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limits.max_body:
        raise APIError(413, f"request body of {int(declared):,} bytes; at most {limits.max_body:,} are accepted")
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if len(raw) + len(chunk) > limits.max_body:
                    raise APIError(413, f"request body over {limits.max_body:,} bytes")
                raw += chunk
    except ClientDisconnect:
        raise APIError(400, "the client went away while sending the request") from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout") from None
    return raw


def decode_json(raw: bytearray, limits: Limits) -> dict:
    """The body as a JSON object: its shape checked before it is parsed (values, depth), and what it keeps
    once parsed within `Limits.max_kept`; the raw bytes are freed as soon as it is parsed."""
    check_shape(raw, limits)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        if "int_max_str_digits" in str(e):  # Python's bound on an integer's digits, said in JSON's words
            raise bad(f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
        raise bad(f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise bad("the body is not valid JSON (nested too deeply)") from None
    finally:
        raw.clear()
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    if (kept := kept_bytes(body)) > limits.max_kept:
        raise APIError(413, f"the body parses into {kept / 2**20:.1f} MiB of objects; at most "
                            f"{limits.max_kept / 2**20:.1f} MiB are kept per request")
    return body


HEARD_S = 0.25  # how often a handler asks whether its client is still there


async def next_event(job: Job, request: Request, timeout_s: float | None = None) -> tuple | None:
    """Wait for the worker's next event, giving up (and cancelling the job) if the client disconnects, which is
    asked every `HEARD_S` whether events come or not (a whole answer's tokens come every few milliseconds, and a
    client that gave up must not hold the engine to its max_tokens); after `timeout_s` without one,
    ("keepalive", None)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if time.monotonic() - job.heard >= HEARD_S:
            job.heard = time.monotonic()
            if await request.is_disconnected():
                job.cancel.set()
                return None
        try:
            return await job.next(HEARD_S)
        except asyncio.TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                return ("keepalive", None)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def tool_call(call: dict, i: int, job: Job, streamed: bool = False, choice: int = 0) -> dict:
    """The i-th call of an answer (of the request's `choice`-th) as OpenAI writes it: `index` only in a stream's
    delta, where it says which call the delta belongs to; a non-streamed message has none, as OpenAI's."""
    body = {"id": f"call_{job.id[:8]}{f'{choice}_' if choice else ''}{i}", "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}
    return {"index": i, **body} if streamed else body


class API:
    """The routes, over one `Server` (the engine thread)."""

    def __init__(self, server: Server):
        self.server, self.so = server, server.so
        self.worker = server.worker
        self.requests: Counter = Counter()  # requests queued, by API
        self.store = ResponseStore(self.so.response_store_bytes) if self.so.response_store_bytes else None
        # bodies are decoded and parsed, and prompts rendered and tokenized, here: one at a time, off the event
        # loop (which then only moves bytes, and answers /health between them)
        self.prep = ThreadPoolExecutor(1, thread_name_prefix="streamoe-prepare")

    def served(self, req: GenRequest) -> GenRequest:
        """The request, if its `model` is one this server serves (absent, where the API lets it be: the served
        model); another name is a 404 naming it and the served ones, as vLLM and Anthropic's API answer it."""
        self.check_model(req.model)
        return req

    def check_model(self, model: str | None) -> None:
        names = self.so.served_names
        if model is not None and model not in names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(map(repr, names))}", "model", kind="invalid_request_error",
                           code="model_not_found")

    async def prepared(self, request: Request, make: Callable[[dict], object]):
        """`make(body)` run on the prepare thread, once the body is read (here, within the size limit and the
        body deadline) and decoded there (`decode_json`)."""
        raw = await read_body(request, self.so.limits, self.so.body_timeout_s)
        return await asyncio.get_running_loop().run_in_executor(
            self.prep, lambda: make(decode_json(raw, self.so.limits)))

    # ---- small GET endpoints
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "queue": self.server.queue.qsize()})

    def model_card(self, name: str) -> dict:
        """A served name as both APIs list a model: OpenAI's fields (vLLM's `max_model_len` too) and Anthropic's."""
        return {"id": name, "object": "model", "created": 0, "owned_by": "streamoe", "max_model_len": self.worker.eng.opts.ctx,
                "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}

    async def models(self, request: Request) -> Response:
        names = self.so.served_names  # the list as OpenAI's API sends it, with the fields of Anthropic's page
        return JSONResponse({"object": "list", "data": [self.model_card(n) for n in names], "has_more": False,
                             "first_id": names[0], "last_id": names[-1]})

    async def plan(self, request: Request) -> Response:
        p = self.worker.eng.plan
        return JSONResponse({**p.to_json(), "notes": p.notes, "text": p.render(), "model": self.so.model_name,
                             "images": self.worker.eng.opts.images, "max_tokens": self.so.max_tokens})

    async def stats(self, request: Request) -> Response:
        live = dict(self.worker.live)
        if live.get("state") == "idle":
            live["rss"] = current_rss()
        p = self.worker.eng.plan
        split = {"device": self.worker.eng.device_memory(), "host_cap": p.host_cap} if p.split else {}
        return JSONResponse({**live, **split, "cap": p.cap, "queue": self.server.queue.qsize(),
                             "served": self.worker.served})

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        self.served(GenRequest(kind="chat", model=name))
        return JSONResponse(self.model_card(name))

    async def metrics(self, request: Request) -> Response:
        return Response(exposition(self.worker, self.server.queue.qsize(), self.requests, self.store),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation
    async def submit(self, request: Request, api: str, parse: Callable[[dict], GenRequest]) -> tuple[Job, tuple | None]:
        """Read and check the body, parse it with `parse`, prepare and queue the job; returns the job and its
        first event (None for a stream whose first event is not there within the keep-alive interval: the
        response then starts without it)."""
        job = await self.prepared(request, lambda body: self.worker.prepare(self.served(parse(body))))  # the body goes once parsed
        req = job.req
        job.loop, job.events, job.max_answer = asyncio.get_running_loop(), asyncio.Queue(), self.so.limits.max_answer
        self.server.submit(job)
        self.requests[api] += 1
        wait = self.so.keepalive_s if req.stream else None
        deadline = None if wait is None else time.monotonic() + wait
        ev = await next_event(job, request, wait)
        # the prompt's usage, kept for the answer's start; the wait goes on, so that a refusal before the first
        # token is still the response's status
        while ev is not None and ev[0] == "started":
            job.started = ev[1]
            ev = await next_event(job, request, None if deadline is None else max(0.0, deadline - time.monotonic()))
        if ev is None:
            self.server.withdraw(job)
            return job, ("done", {"finish_reason": None, "cancelled": True})
        if ev[0] == "keepalive":
            return job, None
        if ev[0] == "error":
            raise ev[1]
        return job, ev

    async def events(self, job: Job, first: tuple | None, request: Request | None = None,
                     keepalive_s: float | None = None) -> AsyncIterator[tuple]:
        """The job's events from `first` to its end; with `request`, ends early if that client disconnects
        (a streamed response learns it from the server instead); with `keepalive_s`, ("keepalive", None)
        after each such interval without an event."""
        ev = first
        while True:
            if ev is not None:
                if ev[0] == "started":
                    job.started = ev[1]
                yield ev
                if ev[0] in ("done", "error"):
                    return
            if request is not None:
                ev = await next_event(job, request)
                if ev is None:
                    self.server.withdraw(job)
                    return
            else:
                try:
                    ev = await job.next(keepalive_s)
                except asyncio.TimeoutError:
                    ev = ("keepalive", None)

    async def answer(self, job: Job, first: tuple | None, request: Request, out: Output) -> Response:
        """The job's events through one API's `out`: server-sent events when the request streams, else
        the whole answer as one JSON object."""
        if job.req.stream:
            return StreamingResponse(self._stream(job, first, out), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        done = False
        async for ev in self.events(job, first, request):
            if ev[0] == "error":
                raise ev[1]
            if ev[0] == "done" and ev[1].get("cancelled"):
                break
            done = done or ev[0] == "done"
            out.feed(ev)
        if not done:
            return Response(status_code=204)  # its client went away: nobody reads this
        return PacedJSONResponse(out.result())

    async def _stream(self, job: Job, first: tuple | None, out: Output) -> AsyncIterator[str]:
        try:
            if first is None:  # still queued (or prefilling): say so now, not at the first token
                yield ": keep-alive\n\n"
            for text in out.start():
                yield text
            async for ev in self.events(job, first, keepalive_s=self.so.keepalive_s):
                if ev[0] == "keepalive":
                    yield ": keep-alive\n\n"
                    continue
                if ev[0] == "done" and ev[1].get("cancelled"):
                    return
                for text in out.feed(ev):  # written a piece at a time, as a whole answer is (`PacedJSONResponse`)
                    for at in range(0, len(text), PIECE // 4):
                        yield text[at:at + PIECE // 4]
        finally:
            self.server.withdraw(job)  # a client that went away: out of the queue, or stopped at its next token

    def answered_by(self, job: Job) -> str:
        """The `model` an answer names: the name its request gave (one of the served names), else the model's."""
        return job.req.model or self.so.model_name

    async def chat(self, request: Request) -> Response:
        job, first = await self.submit(request, "chat", lambda body: parse_chat(body, self.so.limits))
        return await self.answer(job, first, request, OpenAIOutput(job, self.answered_by(job)))

    async def completions(self, request: Request) -> Response:
        job, first = await self.submit(request, "completions", parse_completion)
        return await self.answer(job, first, request, OpenAIOutput(job, self.answered_by(job)))

    async def responses(self, request: Request) -> Response:
        job, first = await self.submit(request, "responses", lambda body: responses_api.parse(body, self.so,
                                                                                                store=self.store))
        return await self.answer(job, first, request, responses_api.Output(job, self.answered_by(job), self.store))

    def missing(self, rid: str) -> APIError:
        why = "" if self.store is not None else f": {responses_api.KEEPS_NONE}"
        return APIError(404, f"no response found with id {rid!r}{why}", kind="invalid_request_error")

    def query(self, request: Request, allowed: set[str]) -> dict[str, str]:
        """The query's parameters, each one the route takes (else a 400 naming it)."""
        for key in request.query_params:
            if key not in allowed:
                raise bad(f"query parameter {key!r} is not supported here"
                          + (f" ({', '.join(sorted(allowed))} are)" if allowed else ""), key)
        return dict(request.query_params)

    async def response(self, request: Request) -> Response:
        """A stored response, as it was answered (`GET`), or deleted (`DELETE`). GET takes the SDK's `include`,
        held where the response was answered with it (what it was answered without was never kept: a 400 says so),
        and `stream` and `include_obfuscation` false (a stored response is not replayed as events here)."""
        rid = request.path_params["rid"]
        if request.method == "DELETE":
            self.query(request, set())
            if self.store is None or not self.store.delete(rid):
                raise self.missing(rid)
            return JSONResponse({"id": rid, "object": "response", "deleted": True})
        q = self.query(request, {"include", "include[]", "stream", "include_obfuscation"})
        for key in ("stream", "include_obfuscation"):
            if q.get(key, "false") != "false":
                raise bad(f"'{key}': a stored response is returned whole here, not replayed as events", key)
        include = request.query_params.getlist("include") + request.query_params.getlist("include[]")
        raw = self.store.response(rid) if self.store is not None else None
        if raw is None:
            raise self.missing(rid)
        if include:
            responses_api.check_kept(json.loads(raw), include)
        return PacedResponse([raw])

    async def input_items(self, request: Request) -> Response:
        """A stored response's input items (those its request gave; the chain before it is the earlier responses'),
        OpenAI's page of them: `order` (desc, the default, or asc), `limit` (1-100, 20), `after` (an item id),
        `include` (each item is listed as given, so it holds whatever an includable adds). Written from the stored
        texts, unparsed: they may hold images."""
        q = self.query(request, {"order", "limit", "after", "include", "include[]"})
        for value in request.query_params.getlist("include") + request.query_params.getlist("include[]"):
            if value not in responses_api.INCLUDABLE:
                raise bad(f"'include' value {value!r} is not one of {', '.join(responses_api.INCLUDABLE)}", "include")
        rid = request.path_params["rid"]
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad("'order' must be 'asc' or 'desc'", "order")
        given = q.get("limit", "20")
        limit = int(given) if given.isascii() and given.isdigit() else 0
        if not 1 <= limit <= 100:
            raise bad("'limit' must be an integer from 1 to 100", "limit")
        items = self.store.input_items(rid) if self.store is not None else None
        if items is None:
            raise self.missing(rid)
        items = items[::-1] if order == "desc" else items
        if "after" in q:
            at = next((n for n, (i, _) in enumerate(items) if i == q["after"]), None)
            if at is None:
                raise bad(f"'after': no input item {q['after']!r} in this response", "after")
            items = items[at + 1:]
        page = items[:limit]
        parts = [b'{"object":"list","data":[']
        for n, (_, text) in enumerate(page):
            parts += [b","] * (n > 0) + [text]
        tail = {"first_id": page[0][0] if page else None, "last_id": page[-1][0] if page else None,
                "has_more": len(items) > limit}
        return PacedResponse([*parts, b"]," + json.dumps(tail, separators=(",", ":"))[1:].encode()])

    async def messages(self, request: Request) -> Response:
        job, first = await self.submit(request, "messages", lambda body: anthropic_api.parse(body, self.so))
        return await self.answer(job, first, request, anthropic_api.Output(job, self.answered_by(job)))

    async def tokenize(self, request: Request) -> Response:
        def make(body: dict) -> dict:
            req, special, strs = parse_tokenize(body, self.so.limits)
            ids = self.worker.tokenize(self.served(req), special)
            words = [self.worker.eng.text.tokenizer.id_to_token(t) for t in ids] if strs else None
            return {"count": len(ids), "max_model_len": self.worker.eng.opts.ctx, "tokens": ids, "token_strs": words}

        return JSONResponse(await self.prepared(request, make))

    async def detokenize(self, request: Request) -> Response:
        def make(body: dict) -> dict:
            ids = parse_detokenize(body)
            self.check_model(body.get("model"))
            return {"prompt": self.worker.detokenize(ids)}

        return JSONResponse(await self.prepared(request, make))

    async def input_tokens(self, request: Request) -> Response:
        n = await self.prepared(request, lambda body: self.worker.prompt_tokens(
            self.worker.prepare(self.served(responses_api.parse(body, self.so, counting=True, store=self.store)))))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": n})

    async def count_tokens(self, request: Request) -> Response:
        def make(body: dict) -> tuple[int, dict]:
            job = self.worker.prepare(self.served(anthropic_api.parse(body, self.so, counting=True)))
            return self.worker.prompt_tokens(job), job.req.api

        n, api = await self.prepared(request, make)
        edits = api.get("context_management")
        return JSONResponse({"input_tokens": n, **({} if edits is None else {"context_management": {
            "original_input_tokens": n + api.get("cleared_tokens", 0)}})})


def finish_reason(engine: str | None, calls: int) -> str | None:
    """A chat choice's finish_reason: "tool_calls" where it made calls, unless -n cut it ("length": a client must
    not run calls of an answer that did not end, one of them perhaps cut short)."""
    return "tool_calls" if calls and engine != "length" else engine


class PacedJSONResponse(JSONResponse):
    """A whole answer written a piece at a time (`door.PIECE`): each piece waits while the connection's write
    buffer is over its mark, so an answer its client does not read stays with its request (inside the `requests`
    account, until the send deadline drops the connection) rather than all in the event loop's buffer. A tool
    call's numbers are written as the model wrote them (`dumps_exact`)."""

    def render(self, content) -> bytes:
        return dumps_exact(content, allow_nan=False, separators=(",", ":")).encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        await send_paced(send, self, [self.body])


class PacedResponse(Response):
    """JSON text kept in parts (a stored response's texts, shared with the store), written as `PacedJSONResponse`
    writes a whole answer, a piece at a time, never joined: a client reading it holds one piece beyond what its
    connection's buffers hold, however many ask for it at once."""

    def __init__(self, parts: list[bytes]):
        self.parts = parts
        super().__init__(None, headers={"content-length": str(sum(map(len, parts)))}, media_type="application/json")

    async def __call__(self, scope, receive, send) -> None:
        await send_paced(send, self, self.parts)


async def send_paced(send, response: Response, parts: list[bytes]) -> None:
    """`response`'s head, then the bytes of `parts` in pieces of PIECE bytes (the last shorter), each sent once the
    connection's write buffer is under its mark (uvicorn's `send` waits for that)."""
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    total, sent, piece = sum(map(len, parts)), 0, bytearray()
    for part in parts:
        view = memoryview(part)
        while view:
            take = view[:PIECE - len(piece)]
            piece += take
            view = view[len(take):]
            if len(piece) == PIECE:
                sent += PIECE
                await send({"type": "http.response.body", "body": bytes(piece), "more_body": sent < total})
                piece.clear()
    if piece or not total:
        await send({"type": "http.response.body", "body": bytes(piece), "more_body": False})


class Output(Protocol):
    """How one API turns a job's events into its answer: `start` and `feed` give the text of its event
    stream (`feed` takes every event: "logprobs", "delta", then "done" or "error"; "choice_done" between the
    choices of a chat or text completion with `n`), `result` the whole answer once every event was fed."""

    def start(self) -> list[str]: ...

    def feed(self, ev: tuple) -> list[str]: ...  # "started" too, where it came after the stream began

    def result(self) -> dict: ...


def completion_token(entry: dict) -> str:
    """A token as the legacy completions API names it: its text, or, where its bytes are part of a character (no
    text of their own), `bytes:\\xNN...` as OpenAI writes such a token: the tokens of one position's
    `top_logprobs` are keys of one object, and every partial token's text is the same U+FFFD."""
    raw = entry.get("bytes")
    if raw is not None:
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return entry["token"]


def top_completion_tokens(entry: dict) -> dict[str, float]:
    """A position's `top_logprobs` object of the legacy completions API: the chosen token first, with its own
    log-probability (another token of the same text does not overwrite it), then the likeliest."""
    chosen = completion_token(entry)
    return {chosen: entry["logprob"], **{k: t["logprob"] for t in entry["top_logprobs"]
                                         if (k := completion_token(t)) != chosen}}


class OpenAIOutput:
    """Chat and text completions: `chat.completion(.chunk)` / `text_completion` objects, with logprobs in
    each API's own shape (chat: `content` entries; completions: parallel lists) on the chunk whose text
    holds their tokens. The choices of a request with `n` come one after another, each chunk naming its own."""

    def __init__(self, job: Job, model: str):
        self.job, self.chat = job, job.req.kind == "chat"
        self.base = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{job.id}",
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": job.created, "model": model}
        self.index, self.finished = 0, []  # the choice being written, and those written before it
        self.tokens, self.before = 0, 0  # the choice's tokens so far and the choices' before it (continuous usage)
        self.first_prompt_ids: list[int] | None = None  # vLLM's `prompt_token_ids`: the first choice's prompt
        self._next_choice()

    def _next_choice(self) -> None:
        self.evs, self.lps, self.pending, self.n_calls, self.info = [], [], [], 0, {}
        self.ids: list[int] = []  # a stream's token ids not yet on a chunk (vLLM's `return_token_ids`)
        self.prompt_ids: list[int] | None = None  # the choice's prompt ids, for its next chunk
        self.offset = 0  # completions' text_offset of the next token
        self.echoed = ""  # completions' `echo`: the prompt, before the answer
        self.kept_calls = 0  # tool calls the answer keeps so far (`_honour`)

    def _logprobs(self, entries: list[dict], whole: bool = False) -> dict | None:
        if not self.job.req.logprobs:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets, at = [], 0 if whole else self.offset
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        if not whole:
            self.offset = at
        # each position's likeliest tokens and the one chosen, which "the API will always return" (OpenAI's legacy
        # completions: up to logprobs + 1 of them; vLLM's the same, the chosen first)
        return {"tokens": [completion_token(e) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e["top_logprobs"] is None else top_completion_tokens(e) for e in entries],
                "text_offset": offsets}

    def _chunk(self, delta: dict | None = None, finish=None, text: str | None = None, **extra) -> str:
        """One chunk; the logprobs waiting go on a chunk of content (the tokens they are of), or on the last."""
        choice = {"index": self.index, "delta": delta or {}} if self.chat else {"index": self.index, "text": text or ""}
        lps = []
        if not self.chat or "content" in choice["delta"] or finish is not None:
            lps, self.pending = self.pending, []
        choice["logprobs"] = self._logprobs(lps) if lps else None
        if self.job.req.return_token_ids and self.job.req.stream:  # vLLM's: each chunk's tokens, its prompt first
            choice["token_ids"], self.ids = self.ids, []
            if self.prompt_ids is not None:
                if self.chat:
                    extra = {"prompt_token_ids": self.prompt_ids, **extra}
                else:
                    choice["prompt_token_ids"] = self.prompt_ids
                self.prompt_ids = None
        if self.job.req.continuous_usage:  # vLLM's: the usage so far, on every chunk
            prompt, done = (self.job.started or {}).get("prompt_tokens", 0), self.before + self.tokens
            extra = {"usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done},
                     **extra}
        if finish is not None:  # vLLM's: the stop string or stop token id that ended the answer, else null
            choice["stop_reason"] = self.info.get("stop_reason")
        return sse({**self.base, "choices": [{**choice, "finish_reason": finish}], **extra})

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})] if self.chat else []

    def _honour(self, events: list) -> list:
        """The answer's events under the request's tool options (`call_verdict`): a strict tool's call whose
        arguments break its schema becomes text, a call past the first is dropped without parallel calls."""
        out = []
        for what, x in events:
            if what == "tool_call":
                verdict = call_verdict(self.job.req.api, x, self.kept_calls)
                if verdict == "drop":
                    continue
                if verdict == "text":
                    what, x = "content", call_text(x)
                else:
                    self.kept_calls += 1
            out.append((what, x))
        return out

    def feed(self, ev: tuple) -> list[str]:
        kind, v = ev
        if kind == "started":
            return []
        if kind == "count":
            self.tokens = v
            return []
        if kind == "logprobs":
            self.pending += v
            self.lps += v
            return []
        if kind == "ids":
            self.ids += v
            return []
        if kind == "prompt_ids":
            self.prompt_ids = v
            return []
        if kind == "prompt":  # completions' `echo`: the prompt's text and its tokens' logprobs come first
            self.echoed = v["text"]
            self.pending, self.lps = v["logprobs"] + self.pending, v["logprobs"] + self.lps
            return [self._chunk(text=v["text"])]
        if kind == "delta":
            v = self._honour(v)
            self.evs += v
            out = []
            for what, x in v:
                if not self.chat:
                    out.append(self._chunk(text=str(x)))
                elif what == "tool_call":
                    out.append(self._chunk({"tool_calls": [tool_call(x, self.n_calls, self.job, streamed=True, choice=self.index)]}))
                    self.n_calls += 1
                else:
                    out.append(self._chunk({"reasoning_content" if what == "reasoning" else "content": x}))
            return out
        if kind == "error":
            return [sse(v.body()), "data: [DONE]\n\n"]
        self.info = v
        usage = v.get("usage") or {}
        if "completion_tokens" in usage:  # the choice's own at "choice_done", every choice's at the end
            self.tokens = usage["completion_tokens"] - (self.before if kind == "done" else 0)
        out = [self._chunk(finish=finish_reason(v["finish_reason"], self.n_calls), streamoe=v.get("telemetry"))]
        if kind == "choice_done":  # the next choice follows
            self.before, self.tokens = self.before + self.tokens, 0
            self.first_prompt_ids = self.first_prompt_ids or v.get("prompt_token_ids")
            if not self.job.req.stream:  # a stream has sent it: nothing to build
                self.finished.append(self._choice())
            self.index += 1
            self._next_choice()
            return out + self.start()
        if self.job.req.include_usage:
            out.append(sse({**self.base, "choices": [], "usage": v["usage"]}))
        return out + ["data: [DONE]\n\n"]

    def _choice(self) -> dict:
        """The choice written so far, whole."""
        lps = self._logprobs(self.lps, whole=True)
        if self.chat:
            msg = {"role": "assistant", **collect(self.evs)}
            if msg["tool_calls"]:
                msg["tool_calls"] = [tool_call(c, i, self.job, choice=self.index) for i, c in enumerate(msg["tool_calls"])]
            else:
                del msg["tool_calls"]
            if msg["reasoning_content"] is None:
                del msg["reasoning_content"]
            finish = finish_reason(self.info.get("finish_reason"), len(msg.get("tool_calls") or ()))
            choice = {"index": self.index, "message": msg, "finish_reason": finish, "logprobs": lps}
        else:
            text = self.echoed + "".join(str(v) for _, v in self.evs)
            choice = {"index": self.index, "text": text, "finish_reason": self.info.get("finish_reason"), "logprobs": lps}
        choice["stop_reason"] = self.info.get("stop_reason")  # vLLM's: the stop string or token id that ended it
        if self.job.req.return_token_ids:
            choice["token_ids"] = self.info.get("token_ids", [])
            if len(self.job.req.prompts) > 1:  # a batch of prompts: each choice's own
                choice["prompt_token_ids"] = self.info.get("prompt_token_ids", [])
        return choice

    def result(self) -> dict:
        info, choices = self.info, [*self.finished, self._choice()]
        extra = {}
        if self.job.req.return_token_ids:  # vLLM's: the (first) prompt as rendered
            extra["prompt_token_ids"] = self.first_prompt_ids or info.get("prompt_token_ids", [])
        return {**self.base, "object": "chat.completion" if self.chat else "text_completion", **extra,
                "choices": choices, "usage": info.get("usage"), "streamoe": info.get("telemetry")}


def error_response(err: APIError, request: Request | None = None) -> Response:
    """The error in the shape of the API the request spoke: Anthropic's under /v1/messages, else OpenAI's."""
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None
    if request is not None and anthropic_route(request.url.path):  # its overload is 529
        return JSONResponse(anthropic_api.error_body(err), status_code=anthropic_status(err.status), headers=headers)
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def on_api_error(request: Request, exc: Exception) -> Response:
    return error_response(exc, request)  # type: ignore[arg-type]


async def on_http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    return error_response(APIError(status, str(getattr(exc, "detail", "error")), kind="invalid_request_error"), request)


async def on_internal_error(request: Request, exc: Exception) -> Response:
    """A bug in streamoe, not a bad request: the API's error object all the same (Starlette then logs the
    traceback and the server goes on)."""
    return error_response(APIError(500, "internal error in streamoe (the server's log has its traceback)"), request)


def create_app(server: Server, host: str = "127.0.0.1") -> Starlette:
    """The routes behind the door: the Host/Origin guard (`door.Door`), CORS for the origins allowed, and
    admission of bodies within the `requests` account (`door.Admission`), outermost first."""
    api = API(server)
    so = server.so
    routes = [
        Route("/", api.index),
        Route("/health", api.health),
        Route("/v1/models", api.models),
        Route("/v1/models/{model:path}", api.model),
        Route("/metrics", api.metrics),
        Route("/v1/plan", api.plan),
        Route("/v1/stats", api.stats),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/responses/input_tokens", api.input_tokens, methods=["POST"]),
        Route("/v1/responses/{rid}", api.response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{rid}/input_items", api.input_items),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [Middleware(Door, bound=host, allow_hosts=so.allow_hosts, cors_origins=so.cors_origins,
                             api_key=so.api_key)]
    if so.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(so.cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["*"], max_age=600))
    middleware.append(Middleware(Admission, slots=so.admitted))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        asyncio.get_running_loop().set_exception_handler(RateLimitedLoopErrors())
        yield
        api.prep.shutdown(wait=False, cancel_futures=True)

    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                         Exception: on_internal_error})


def exposure(host: str, keyed: bool = False) -> str | None:
    """The warning for an address other machines can reach, where the API has no key (`--api-key`)."""
    if host in LOOPBACK or host.startswith("127.") or keyed:
        return None
    return (f"streamoe: warning: listening on {host}, reachable from other machines; the API has no authentication "
            "(give it --api-key)")


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a busy port is one clear error before anything else runs."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound_socket_buffers(sock)  # before listen: the connections it accepts inherit them
        sock.bind(addr)
    except OSError as e:
        raise StreamoeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def bind(host: str, port: int, group: ranks.Group | None) -> socket.socket | None:
    """The listening socket; across ranks rank 0's alone (None on the others), and every rank learns whether
    rank 0 could bind it before any opens the model."""
    if group is None:
        return listen(host, port)
    held: list[socket.socket] = []
    ranks.open_together(group, lambda: held.append(listen(host, port)) if group.rank() == 0 else None,
                        lambda: [s.close() for s in held])
    return held[0] if held else None


def follow_rank0(root: Path, opts, so, group: ranks.Group) -> None:
    """A rank other than 0: its engine (the prompt cache's account as rank 0's: it keeps the same snapshots),
    making rank 0's engine calls until rank 0 stops. Ctrl+C reaches every rank of a terminal's process group:
    rank 0 stops, and tells the others; SIGTERM keeps its default, ending this rank at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    eng = open_engine(root, opts, so, group)
    p = eng.plan
    print(f"streamoe: {ranks.where(group)} follows rank 0's server: experts e % {p.ranks} == {p.rank} of every layer, "
          f"{p.hot_slots} of {p.n_layers * p.n_experts} in its hot tier, cap {p.cap / 2**30:.2f} GiB", file=sys.stderr,
          flush=True)
    try:
        follow(eng)
    except RuntimeError as e:
        if (lost := ranks.lost_peer(e, group)) is None:
            raise
        raise lost from None
    except StreamoeError as e:
        raise StreamoeError(f"{ranks.where(group)}: {e}") from None
    finally:
        eng.close()


def serve(root: Path, opts, so, host: str, port: int, log_level: str = "info", note: str | None = None) -> None:
    """Open the engine on this thread (its plan printed to stderr, then `note`), run the HTTP server on another, and
    answer queued requests here until SIGINT or SIGTERM: then the running and queued requests end with a
    `shutting_down` error (streams with that event and `[DONE]`), the HTTP server drains for up to 2 s,
    and the process exits 0. A second signal exits at once.

    Under `mlx.launch` rank 0 does all that, and every other rank follows its engine calls (`lockstep`) until
    rank 0 stops. Images reach rank 0 alone, so none are planned for (a request with one is refused)."""
    import uvicorn

    group = ranks.find_group()
    if group is not None:
        opts = dataclasses.replace(opts, images=False)
    sock = bind(host, port, group)
    if group is not None:  # every rank keeps the snapshots rank 0's prompt cache holds, inside its own plan
        try:
            ranks.same_work(group, {"--prompt-cache-mib": so.prompt_cache_bytes / 2**20})
        except BaseException:
            if sock is not None:
                sock.close()
            raise
    if sock is None:
        return follow_rank0(root, opts, so, group)
    server = Server(root, opts, so, group)
    print(server.worker.eng.plan.render(), file=sys.stderr)
    if note is not None:
        print(note, file=sys.stderr)
    if (notice := exposure(host, so.api_key is not None)) is not None:
        print(notice, file=sys.stderr)
    # the event loop accepts what is queued at once, before the guarded protocol evicts any idle one: the
    # connection bound leaves room for such a burst within the file limit (`door.connection_limit`);
    # uvicorn's own concurrency limit (503 to a request beyond it) stays above what the guarded protocol holds,
    # evicted connections included until they are gone: only runaway tasks meet it
    conns = connection_limit(so.max_connections, reserve=64 + ACCEPT_BURST)
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["handlers"]["access"]["stream"] = "ext://sys.stderr"  # uvicorn's default is stdout: a log is no result
    config = uvicorn.Config(create_app(server, host), log_level=log_level, log_config=logs,
                            access_log=log_level in ("debug", "info"),
                            timeout_graceful_shutdown=2, http=guarded_protocol(conns, so.head_timeout_s, so.send_timeout_s), loop="uvloop",
                            ws="none",  # an Upgrade is ignored (RFC 9110 7.8): the request is answered as HTTP
                            limit_concurrency=conns + ACCEPT_BURST + 1, timeout_keep_alive=max(1, round(so.idle_timeout_s)),
                            backlog=LISTEN_BACKLOG)
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="streamoe-http", daemon=True)

    def terminate(signum, frame):
        if server.stopping.is_set():
            print("streamoe: stopped at once (second signal)", file=sys.stderr, flush=True)
            os._exit(1)
        busy = server.current is not None or not server.queue.empty()
        print(f"streamoe: {signal.Signals(signum).name}: stopping"
              + (" (the running and queued requests end with an error)" if busy else ""), file=sys.stderr, flush=True)
        server.stop()

    # both, explicitly: a process started in the background by a shell inherits SIGINT as ignored, and Python
    # then installs no Ctrl+C handler of its own (the server would only stop when killed)
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    thread.start()
    try:
        while not http.started and thread.is_alive() and not server.stopping.is_set():
            time.sleep(0.05)
        if http.started:
            shown = f"[{host}]" if ":" in host else host
            print(f"streamoe: serving {so.model_name} on http://{shown}:{sock.getsockname()[1]}/ (OpenAI API under /v1)",
                  file=sys.stderr, flush=True)
            server.run(alive=thread.is_alive)
    finally:
        server.stop()
        time.sleep(0.2)  # the error events reach their streams before the HTTP server stops taking writes
        http.should_exit = True
        thread.join(timeout=10)
        server.close()
        sock.close()
    print("streamoe: stopped", file=sys.stderr)
