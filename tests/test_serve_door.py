"""The server's door: a forged Host is refused (DNS rebinding), a foreign Origin generates nothing (a page the
user visits cannot drive the API), allowed origins get CORS, streamed requests hear keep-alive comments
while they wait, and SIGINT ends every stream with an error event and `[DONE]`, with no traceback."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from .serve_util import fetch, start_server, stop_server

SERVE = ["--cap", 2, "--ctx", 1024, "--runtime-mib", 256, "--prompt-cache-mib", 0, "--max-queue", 2,
         "--allow-host", "example.test", "--cors-origin", "http://app.test", "--sse-keepalive", 0.3]


@pytest.fixture(scope="module")
def conv(trained_conv) -> Path:
    return trained_conv


@pytest.fixture(scope="module")
def server(conv, tmp_path_factory):
    s = start_server(conv, tmp_path_factory.mktemp("log") / "door.log", *SERVE)
    yield s
    stop_server(s)


def raw(port: int, head: str, body: bytes = b"", timeout: float = 30) -> tuple[int, dict, bytes]:
    """One request written by hand (any Host, any headers); returns (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


def post(port: int, path: str, body: dict, host: str | None = None, **headers) -> tuple[int, dict, bytes]:
    """A POST as a browser sends it (Host with the port)."""
    host = host or f"127.0.0.1:{port}"
    data = json.dumps(body).encode()
    extra = "".join(f"{k.replace('_', '-')}: {v}\n" for k, v in headers.items())
    head = f"POST {path} HTTP/1.1\nHost: {host}\nContent-Length: {len(data)}\nConnection: close\n{extra}"
    return raw(port, head, data)


def generated(server) -> int:
    return len(re.findall(r"prompt tokens \(\d+ cached\)", server.text()))


def test_host_must_name_this_server(server):
    p = server.port
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", f"[::1]:{p}", "LOCALHOST", "example.test", f"example.test:{p}"):
        status, _, body = raw(p, f"GET /health HTTP/1.1\nHost: {host}\nConnection: close\n")
        assert status == 200, (host, body)
    for host in ("evil.test", f"evil.test:{p}", "127.0.0.1.evil.test", "localhost.", "[::1]x", "a:b"):
        status, _, body = raw(p, f"GET /health HTTP/1.1\nHost: {host}\nConnection: close\n")
        err = json.loads(body)["error"]
        assert status in (400, 421) and err["message"] and err["type"], (host, status, body)
    status, _, body = raw(p, "GET /health HTTP/1.1\nConnection: close\n")  # no Host, which HTTP/1.1 requires
    assert status == 400 and "Host" in json.loads(body)["error"]["message"]
    status, _, body = raw(p, "GET /health HTTP/1.0\n")  # HTTP/1.0 has none (a bare probe): this machine's
    assert status == 200, body
    # a rebinding page's POST never reaches the engine
    before = generated(server)
    status, _, _ = post(p, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, host="evil.test")
    assert status == 421 and generated(server) == before


def test_a_foreign_origin_generates_nothing(server):
    p = server.port
    before = generated(server)
    # a form or fetch(..., {mode: "no-cors"}) from any web page: text/plain needs no preflight
    status, headers, body = post(p, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                                 Origin="http://evil.test", Content_Type="text/plain")
    assert status == 403 and json.loads(body)["error"]["code"] == "cross_origin"
    assert "access-control-allow-origin" not in headers
    status, _, _ = post(p, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, Origin="null")
    assert status == 403
    # on Anthropic's route, in Anthropic's shape
    status, _, body = post(p, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": []}, Origin="http://evil.test")
    assert status == 403 and json.loads(body)["error"]["type"] == "permission_error", body
    status, _, body = post(p, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": []}, host="evil.test")
    assert status == 421 and json.loads(body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": json.loads(body)["error"]["message"]}}, body
    assert generated(server) == before
    # the page itself (same origin) and an allowed origin generate
    status, _, _ = post(p, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0},
                        Origin=f"http://127.0.0.1:{p}")
    assert status == 200
    status, headers, _ = post(p, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0},
                              Origin="http://app.test")
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.test"
    assert generated(server) == before + 2


def test_preflight_is_answered_for_allowed_origins_only(server):
    p = server.port
    ask = (f"OPTIONS /v1/chat/completions HTTP/1.1\nHost: 127.0.0.1:{p}\nOrigin: {{}}\nConnection: close\n"
           "Access-Control-Request-Method: POST\nAccess-Control-Request-Headers: content-type, authorization\n")
    status, headers, _ = raw(p, ask.format("http://app.test"))
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.test"
    assert "POST" in headers["access-control-allow-methods"]
    assert "content-type" in headers["access-control-allow-headers"].lower()
    status, headers, _ = raw(p, ask.format("http://evil.test"))
    assert status == 403 and "access-control-allow-origin" not in headers


def read_events(s: socket.socket, until: bytes, timeout: float = 60) -> bytes:
    s.settimeout(timeout)
    data = b""
    while until not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def stream(port: int, prompt: str, max_tokens: int) -> socket.socket:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def test_a_queued_stream_hears_keep_alive_comments(server):
    first = stream(server.port, "def main():\n", 400)
    read_events(first, b"data: ")
    second = stream(server.port, "import os\n", 4)
    head = read_events(second, b": keep-alive\n\n", timeout=20)
    assert b" 200 " in head.split(b"\r\n")[0] and b"text/event-stream" in head
    assert b"data: {" not in head.partition(b": keep-alive")[0]  # the comment came before any token
    first.close()
    rest = read_events(second, b"data: [DONE]")
    assert rest.count(b"data: {") >= 4
    second.close()


def test_sigint_ends_every_stream_with_an_error_and_done(conv, tmp_path):
    s = start_server(conv, tmp_path / "stop.log", "--cap", 2, "--ctx", 1024, "--runtime-mib", 256, "--prompt-cache-mib", 0,
                     "--sse-keepalive", 0.3)
    try:
        running = stream(s.port, "def main():\n", 900)
        read_events(running, b"data: {")
        queued = stream(s.port, "import sys\n", 900)
        read_events(queued, b": keep-alive")  # its response has begun: it is in flight, waiting in the queue
        assert fetch(s.url + "/health").json()["queue"] == 1
        s.proc.send_signal(signal.SIGINT)
        for sock in (running, queued):
            got = read_events(sock, b"data: [DONE]\n\n", timeout=20)
            events = [ln for ln in got.split(b"\n") if ln.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]", got[-500:]
            assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
            sock.close()
        s.proc.wait(30)
    finally:
        code = stop_server(s)
    assert code == 0, s.text()
    log = s.text()
    assert "Traceback" not in log and "ERROR" not in log and "streamoe: stopped" in log, log[-3000:]
    assert "streamoe: SIGINT: stopping (the running and queued requests end with an error)" in log, log[-3000:]


def test_sigterm_while_idle_exits_cleanly(conv, tmp_path):
    s = start_server(conv, tmp_path / "term.log", "--cap", 2, "--ctx", 512, "--runtime-mib", 256, "--prompt-cache-mib", 0)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0 and time.monotonic() - t0 < 10
    assert "Traceback" not in s.text() and "streamoe: stopped" in s.text()
    assert "streamoe: SIGTERM: stopping\n" in s.text()  # nothing running: no request ends with an error



def test_an_api_key_guards_the_api_and_not_the_page(conv, tmp_path):
    """`--api-key` (here from STREAMOE_API_KEY): every /v1/ route, /metrics, /tokenize and /detokenize answer 401
    without it, in the shape of
    the route's API, and take it as OpenAI's and Anthropic's clients send it; /health, the page and CORS preflights
    need none; a wrong key is refused like a missing one."""
    import anthropic
    import openai

    key = "sk-test-5f0c"
    s = start_server(conv, tmp_path / "keyed.log", "--cap", 2, "--ctx", 1024, "--runtime-mib", 256, "--prompt-cache-mib", 0,
                     "--cors-origin", "http://app.test", env={"STREAMOE_API_KEY": key})
    try:
        assert fetch(s.url + "/health").status == 200 and fetch(s.url + "/").status == 200
        for path in ("/v1/models", "/v1/plan", "/metrics"):
            r = fetch(s.url + path)
            assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/tokenize", "/detokenize"):
            status, _, body = post(s.port, path, {"prompt": "hi", "tokens": [1]})
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (path, body)
        status, _, body = post(s.port, "/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": []})
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"  # Anthropic's shape
        status, _, _ = post(s.port, "/v1/chat/completions", {"messages": []}, authorization="Bearer sk-wrong")
        assert status == 401
        ask = (f"OPTIONS /v1/chat/completions HTTP/1.1\nHost: 127.0.0.1:{s.port}\nOrigin: http://app.test\n"
               "Connection: close\nAccess-Control-Request-Method: POST\nAccess-Control-Request-Headers: authorization\n")
        assert raw(s.port, ask)[0] == 200
        oc = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)
        r = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        ac = anthropic.Anthropic(base_url=s.url, api_key=key, max_retries=0, timeout=120)
        assert ac.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]).usage.output_tokens == 2
        assert fetch(s.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).status == 200
        assert "no authentication" not in s.text()
    finally:
        stop_server(s)
