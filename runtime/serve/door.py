"""What stands between the network and `streamoe serve`'s handlers: the Host and Origin guard, admission of
request bodies within the plan's `requests` account, and the connections uvicorn may hold.

Without `--api-key` the API has no authentication, so a web page the user visits must not be able to use it: a
`Host` other
than the names this server answers to (loopback names, the bound address, `--allow-host`) is a DNS-rebinding
attempt and is refused with 421 (an HTTP/1.1 request without one with 400; an HTTP/1.0 one, which has none and no
browser sends, is this machine's); a request carrying an `Origin` other than the page's own is refused with 403
before anything runs (a `text/plain` POST needs no preflight, so omitting CORS headers is not enough), unless
`--cors-origin` allows it, in which case Starlette's CORSMiddleware answers its preflight and tags its
responses. With `--api-key` every `/v1/` route, `/metrics`, `/tokenize` and `/detokenize` also needs the key, as
`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's), else 401; the chat page and
`/health` stay open. Every refusal is OpenAI's error object (Anthropic's under `/v1/messages`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import resource
import socket
import sys
import time
import traceback

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD = ("0.0.0.0", "::", "")


# Anthropic's error types by status, on the routes of its API (an overload is its 529 there, OpenAI's 503 elsewhere)
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_route(path: str) -> bool:
    return path.startswith("/v1/messages")


def anthropic_status(status: int) -> int:
    return 529 if status == 503 else status


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ANTHROPIC_ERRORS.get(anthropic_status(status), "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(status: int, message: str, code: str | None = None, kind: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}},
                      separators=(",", ":")).encode()


REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


def raw_error(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response, closing its connection, for the protocol to write where no request could be
    made of what arrived (no route, so OpenAI's shape)."""
    body = error_body(status, message, code)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status, REASONS[status], len(body), body))


async def refuse(send, scope, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 headers: tuple = ()) -> None:
    """An error response sent straight from ASGI, the request's body left unread, in the shape of the API its path
    speaks (Anthropic's under /v1/messages, else OpenAI's)."""
    if anthropic_route(scope["path"]):
        status = anthropic_status(status)
        body = json.dumps(anthropic_error(status, message)).encode()
    else:
        body = error_body(status, message, code, kind)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


def host_name(header: str) -> str | None:
    """The name in a Host header without its port (`[::1]:8080` -> `::1`), lowercased; None if malformed."""
    h = header.strip().lower()
    if h.startswith("["):
        end, rest = h.find("]"), h[h.find("]") + 1:]
        if end < 0 or (rest and not (rest[0] == ":" and rest[1:].isascii() and rest[1:].isdigit())):
            return None
        return h[1:end] or None
    name, sep, port = h.partition(":")
    if sep and not (port.isascii() and port.isdigit()):
        return None
    return name or None


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class Door:
    """ASGI middleware: the Host check, then the Origin check (see the module's docstring)."""

    def __init__(self, app, bound: str, allow_hosts=(), cors_origins=(), api_key: str | None = None):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.any_host = "*" in allow_hosts
        self.hosts = {h.lower().strip("[]") for h in (*LOCAL_NAMES, bound, *allow_hosts)}
        self.wildcard = bound in WILDCARD  # every address of this machine is bound: any IP literal names it
        self.any_origin = "*" in cors_origins
        self.origins = {o.rstrip("/").lower() for o in cors_origins}

    def host_ok(self, name: str) -> bool:
        return self.any_host or name in self.hosts or (self.wildcard and is_ip(name))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k: v for k, v in scope["headers"] if k in (b"host", b"origin", b"authorization", b"x-api-key")}
        raw_host = headers.get(b"host", b"").decode("latin-1")
        name = host_name(raw_host) if raw_host else None
        if name is None and b"host" not in headers and scope.get("http_version") == "1.0":
            name = "localhost"  # HTTP/1.0 has no Host (a bare health probe); a browser always sends one
        if name is None:
            return await refuse(send, scope, 400, "the request has no valid Host header", "bad_host")
        if not self.host_ok(name):
            return await refuse(send, scope, 421, f"this server does not answer to the host {name!r} (start it with "
                                f"--allow-host {name} to allow that name)", "misdirected_host")
        origin = headers.get(b"origin")
        if origin is not None:
            o = origin.decode("latin-1").rstrip("/").lower()
            same = o in (f"{scope.get('scheme', 'http')}://{raw_host.lower()}",)
            if not same and not self.any_origin and o not in self.origins:
                return await refuse(send, scope, 403, f"cross-origin requests from {o} are refused (start the server "
                                    "with --cors-origin ORIGIN to allow one)", "cross_origin", "permission_error")
        if self.key is not None and not self.key_ok(scope, headers):
            return await refuse(send, scope, 401, "this server needs its API key (Authorization: Bearer KEY, or x-api-key: "
                                "KEY)", "invalid_api_key", headers=((b"www-authenticate", b"Bearer"),))
        await self.app(scope, receive, send)

    def key_ok(self, scope, headers: dict) -> bool:
        """Whether the request may pass the API key check: the page, /health and CORS preflights need no key."""
        path = scope["path"]
        if not (path.startswith("/v1/") or path in KEYED) or scope["method"] == "OPTIONS":
            return True
        auth = headers.get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, self.key)


KEYED = ("/metrics", "/tokenize", "/detokenize")  # outside /v1/, what needs the API key too


class Admission:
    """ASGI middleware: at most `slots` requests with a body admitted at once (reading it, queued or
    running), or reading a stored response (a GET under /v1/responses/: what it is written from stays in memory
    until its client has it, even if the store lets it go); one more is answered 503 with Retry-After before a byte
    of its body is read. The plan's `requests` account is sized for exactly these (`ServeOptions.requests_bytes`)."""

    METHODS = ("POST", "PUT", "PATCH")

    def __init__(self, app, slots: int):
        self.app, self.slots, self.inside = app, slots, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["method"] in self.METHODS or (
                scope["method"] == "GET" and scope["path"].startswith("/v1/responses/"))):
            return await self.app(scope, receive, send)
        if self.inside >= self.slots:
            return await refuse(send, scope, 503, f"the server is busy: {self.slots} requests are already admitted "
                                "(queued or running); retry later", "queue_full", "server_overloaded",
                                ((b"retry-after", b"1"),))
        self.inside += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inside -= 1


# Each connection's kernel socket buffers, charged to the server's memory cgroup (sock memory, cgroup v2 and v1
# with kmem accounting): set on the listening socket, which every accepted one inherits, they fix what would
# otherwise autotune up to net.ipv4.tcp_rmem/tcp_wmem's maximum (tens of MiB each) for a client that sends
# and never waits for an answer, or asks and never reads. 16 KiB each way still moves a 4 MiB body over
# loopback in ~10 ms.
SOCKET_BUFFER = 16 << 10
# The event loop's write buffer of a connection: a response waits while it holds more (its high-water mark), and
# a whole answer is written a piece at a time, so what a client leaves unread stays with its request.
WRITE_BUFFER = 16 << 10
PIECE = 16 << 10
# The kernel's queue of connections not yet accepted (net.core.somaxconn caps it): deep enough that a burst of
# 2,000 connections drops no handshake (a dropped one costs its client, a /health probe say, a 1 s retransmit).
LISTEN_BACKLOG = 4096
# Files kept free for one burst of accepts (the event loop accepts what is queued at once), before the guarded
# protocol closes idle connections to stay within its bound; past the file limit libuv closes what it cannot
# accept.
ACCEPT_BURST = 512


def bound_socket_buffers(sock: socket.socket) -> int:
    """Set the receive and send buffers of `sock` (a listening socket: the connections it accepts inherit
    them) to SOCKET_BUFFER; returns what one connection's two then hold at most, as the kernel counts them
    (it doubles what is set, for its bookkeeping)."""
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    return sum(sock.getsockopt(socket.SOL_SOCKET, opt) for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF))


def socket_bytes(max_connections: int) -> int:
    """What the server's connections hold at most: those it keeps (`guarded_protocol`'s bound), each
    `connection_bytes`, and a full listen queue, each having received what its receive buffer holds (nothing is
    sent to a connection before it is accepted)."""
    return max_connections * connection_bytes() + LISTEN_BACKLOG * 2 * SOCKET_BUFFER


def connection_bytes() -> int:
    """What one connection holds at most: both kernel buffers full (the kernel doubles the size set), the event
    loop's write buffer at its mark with one more piece written, and its requests' heads parsed (the one being
    answered, those read ahead behind it, and the next one arriving), each at the bounds on its bytes and fields."""
    return 4 * SOCKET_BUFFER + WRITE_BUFFER + PIECE + (READ_AHEAD + 2) * HEAD_OBJECT_BYTES


def raise_file_limit() -> int:
    """The soft limit on open files raised to the hard one (each connection is a file); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def open_files() -> int:
    import os

    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def connection_limit(wanted: int, reserve: int = 64) -> int:
    """Connections the server may hold: what was asked, within the file limit less the files already open
    (model, tokenizer) and a reserve for image files and the engine's reads."""
    return max(1, min(wanted, raise_file_limit() - open_files() - reserve))


MAX_HEAD_BYTES = 16 << 10  # a request line and headers: what h11 allows by default
MAX_HEADERS = 100  # header fields in one head: Apache's LimitRequestFields (each field is Python objects once parsed)
READ_AHEAD = 2  # requests a connection may send ahead of the answer it awaits (HTTP/1.1 pipelining), parsed and held
# What a parsed head at both bounds holds in Python objects (its scope, headers as pairs of bytes, the request's
# cycle): measured 23 KB for MAX_HEADERS fields in MAX_HEAD_BYTES (`test_serve_hostile`)
HEAD_OBJECT_BYTES = 32 << 10
LINGER_S = 2.0  # how long a connection answered before its body arrived reads on to the body's end
LINGER_MAX = 8  # connections doing so at once: past that (a flood of bodies), one more is closed at once


class Lingering:
    """A request's view of its connection: closing it when its answer is sent while the body is still
    arriving (a 503 before the body was read, a 421) first reads the rest of the body and drops it, for at most
    LINGER_S. Closing with unread data would reset the connection, and a client still sending its body would
    get an error in place of the answer. At most LINGER_MAX connections linger at once, and one more is
    closed at once (its client may see a reset): reading costs the event loop time per byte, and this bounds
    what a flood of bodies can make it read to LINGER_MAX bodies every LINGER_S."""

    def __init__(self, protocol, cycle):
        self.protocol, self.cycle = protocol, cycle

    def __getattr__(self, name):
        return getattr(self.protocol.transport, name)

    def close(self) -> None:
        self.protocol.linger(self.cycle)


def guarded_protocol(max_connections: int, head_timeout_s: float, send_timeout_s: float = 30.0,
                     max_head_bytes: int = MAX_HEAD_BYTES):
    """uvicorn's httptools protocol (a C parser: the least event-loop time per connection and per byte of
    body) with what it lacks: a deadline for each request head (from the connection's start, or the next
    request's first byte), a bound on a head's size (431 past it), a bound on connections that closes
    the oldest idle one (still sending its head, or kept alive between requests) when a new one arrives at
    the bound: idle sockets cannot starve the server, and its files stay within their limit; and a deadline
    for sending: a connection whose write buffer stays over its mark for `send_timeout_s`, or still holds
    bytes that long after its response was written, is aborted (a client that asks and never reads would
    otherwise keep its answer, and while that is written its request's admission, for ever). And bounds on what
    a connection makes the server hold: at most MAX_HEADERS fields a head (431), and at most READ_AHEAD requests
    read behind the one being answered, reading paused while any wait (uvicorn parses ahead without bound and reads
    on as it answers each): one more, and those read are answered and the connection closed, as a server may
    (RFC 9112 9.3.2: the client sends what went unanswered again). What no request can be made of is a 400 in
    OpenAI's shape, not uvicorn's text."""
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Refused(Exception):
        """Raised in a parser callback to stop the parser; uvicorn then calls `send_400_response`."""

    class ReadAheadFlow(FlowControl):
        """uvicorn's flow control, reading kept paused while a request read ahead waits (a handler asking whether
        its client left resumes reading)."""

        def __init__(self, transport, protocol):
            super().__init__(transport)
            self.protocol = protocol

        def resume_reading(self) -> None:
            if not self.protocol.pipeline and not self.protocol.draining:
                super().resume_reading()

    waiting: dict = {}  # idle connections (a request head incomplete, or between requests), oldest first
    lingering: set = set()  # connections reading the rest of a body their answer did not wait for
    too_large = raw_error(431, f"the request head is over {max_head_bytes:,} bytes", "head_too_large")

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        head_timer: asyncio.TimerHandle | None = None
        in_head = True  # a request head is awaited or arriving (from the start, or a message's first byte)
        head_bytes = 0  # bytes received while in it
        ended = False  # a message ended in the data being parsed (the next one then begins inside it)
        awaiting = False  # a message ended with the data it came in: the next data begins a head
        parsing = 0  # the length of that data
        fields = 0  # header fields of the head being parsed
        refused: tuple | None = None  # why the parser was stopped: (status, message, code), or () for read-ahead
        draining = False  # answering what was read ahead, then closing: nothing more is read

        send_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.flow = ReadAheadFlow(transport, self)
            transport.set_write_buffer_limits(high=WRITE_BUFFER)
            self.arm()
            if len(self.connections) > max_connections:  # the oldest idle one goes (or, with none idle, this one)
                next(iter(waiting), self).drop()

        def arm(self) -> None:
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(head_timeout_s, self.drop)
                waiting[self] = None

        def disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None
            waiting.pop(self, None)

        def drop(self) -> None:
            """Close a connection whose head is late (or evicted): nothing was asked, nothing is answered."""
            self.disarm()
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self in lingering or self.draining:
                return  # the rest of a body nobody reads, or more than was read ahead: dropped unparsed
            if self.in_head or self.awaiting:  # a head that ends in this data, measured before it is parsed (one
                end = data.find(b"\r\n\r\n")  # that goes on past it is counted below, as it arrives)
                if end >= 0 and self.head_bytes + end + 4 > max_head_bytes:
                    return self.refuse_head()
            self.ended, self.parsing = False, len(data)
            super().data_received(data)
            if self.transport.is_closing() or self.draining:
                return
            if self.in_head:
                self.head_bytes += len(data)
                if self.head_bytes > max_head_bytes:
                    self.refuse_head()
            elif self.cycle is None or self.cycle.response_complete:
                self.arm()  # bytes between requests that begin none (blank lines): a head's deadline all the same

        def refuse_head(self, response: bytes = too_large) -> None:
            self.disarm()
            self.transport.write(response)
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to data its parser stopped at: a request that is not HTTP, or a bound this protocol
            stopped the parser at."""
            refused, self.refused = self.refused, None
            if refused == ():  # one request more than READ_AHEAD: the last one read closes the connection
                self.draining = True
                self.flow.pause_reading()
                self.pipeline[0][0].keep_alive = False
                return
            self.refuse_head(raw_error(*(refused or (400, "the request is not valid HTTP/1.1", "invalid_http"))))

        def on_message_begin(self) -> None:
            if len(self.pipeline) >= READ_AHEAD:
                self.refused = ()
                raise Refused
            self.awaiting, self.fields = False, 0
            super().on_message_begin()
            # a pipelined message begun after one that ended in this data: only what follows this data counts
            self.in_head, self.head_bytes = True, -self.parsing if self.ended else 0
            self.arm()  # a kept-alive connection's next request: its head has the deadline again

        def on_header(self, name: bytes, value: bytes) -> None:
            self.fields += 1
            if self.fields > MAX_HEADERS:
                self.refused = (431, f"the request head has more than {MAX_HEADERS} header fields", "head_too_large")
                raise Refused
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.in_head = False
            self.disarm()
            super().on_headers_complete()
            if self.cycle is not None and self.cycle.transport is self.transport:
                self.cycle.transport = Lingering(self, self.cycle)

        def on_message_complete(self) -> None:
            self.ended = self.awaiting = True
            self.head_bytes = 0  # the next head's bytes are counted from here
            super().on_message_complete()

        def linger(self, cycle) -> None:
            """Close now if the request's body is all in, else when the client closes (once it has sent its body and
            read the answer) or after LINGER_S: see `Lingering`."""
            if not cycle.more_body or self.transport.is_closing() or len(lingering) >= LINGER_MAX:
                return self.transport.close()
            lingering.add(self)
            if self.transport.can_write_eof():
                self.transport.write_eof()  # the answer is whole: the client may read it to the end now
            self.flow.resume_reading()
            self.loop.call_later(LINGER_S, self.transport.close)
            waiting[self] = None  # and the connection is idle: the first to go at the bound

        def pause_writing(self) -> None:
            super().pause_writing()
            self.watch_send(None)

        def resume_writing(self) -> None:
            super().resume_writing()
            self.watch_send(None, arm=False)

        def watch_send(self, cycle, arm: bool = True) -> None:
            """The send deadline from now: for the write buffer over its mark (`cycle` None: until it drains), or
            for a written response's last bytes (until they are sent or the next request begins)."""
            if self.send_timer is not None:
                self.send_timer.cancel()
            self.send_timer = self.loop.call_later(send_timeout_s, self.send_late, cycle) if arm else None

        def send_late(self, cycle) -> None:
            """The deadline passed: the client does not read. The connection is reset: its unsent bytes go."""
            self.send_timer = None
            if self.flow.write_paused or (cycle is self.cycle and self.transport.get_write_buffer_size()):
                self.transport.abort()

        def on_response_complete(self) -> None:
            if self.transport.get_write_buffer_size() and not self.flow.write_paused:
                self.watch_send(self.cycle)  # the response's last bytes, below the mark, have the deadline too
            super().on_response_complete()
            if not self.in_head and self.cycle.response_complete:  # idle until the next request (none pipelined):
                self.disarm()  # uvicorn's keep-alive timeout closes it, and a new connection at the bound may first
                if not self.transport.is_closing():
                    waiting[self] = None

        def connection_lost(self, exc) -> None:
            self.disarm()
            if self.send_timer is not None:
                self.send_timer.cancel()
            lingering.discard(self)
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol


class RateLimitedLoopErrors:
    """The event loop's exception handler: an error the loop reports (an accept failing at the file limit
    would otherwise print a traceback on every retry) is logged as one line, once per interval and kind,
    with a count of what was left out; only an exception other than an OSError (a bug) brings its traceback."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s, self.last, self.left = interval_s, {}, {}

    def __call__(self, loop, context: dict) -> None:
        msg = context.get("message", "event loop error")
        exc = context.get("exception")
        now = time.monotonic()
        if now - self.last.get(msg, -1e9) < self.interval_s:
            self.left[msg] = self.left.get(msg, 0) + 1
            return
        extra = f" ({self.left.pop(msg)} more in the last {self.interval_s:g} s)" if self.left.get(msg) else ""
        self.last[msg] = now
        if exc is not None and not isinstance(exc, OSError):  # a bug: its traceback, once per interval
            traceback.print_exception(exc, file=sys.stderr)
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        print(f"streamoe: {msg}{detail}{extra}", file=sys.stderr, flush=True)
