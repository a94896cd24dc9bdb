"""Helpers for the server tests: a live `streamoe serve` in a subprocess (optionally inside a memory cgroup),
the embedded model's reference answers straight from the engine, and the demo picture."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from streamoe.runtime.engine import Engine, Options, plan_for
from streamoe.runtime.plan import MiB
from streamoe.runtime.sampling import Sampler
from streamoe.runtime.serve.openai_api import Limits
from streamoe.runtime.serve.worker import ServeOptions, requests_bytes

from .conftest import REPO

TINY = REPO / "models" / "tiny"


def quarter_cap(conv: Path, ctx: int, runtime_mib: int, cache_mib: float, body_mib: float = 4, queue: int = 8) -> float:
    """A cap (GiB) whose hot tier holds a quarter of the experts, with the server's accounts in the plan."""
    so = ServeOptions("t", limits=Limits(max_body=int(body_mib * MiB)), max_queue=queue)
    extra = int(cache_mib * MiB) + requests_bytes(so, conv, ctx) + so.response_store_bytes
    p = plan_for(conv, Options(cap_gib=64, ctx=ctx, images=True, runtime_bytes=runtime_mib * MiB + extra))
    return (p.fixed + p.n_layers * p.n_experts // 4 * p.slot_bytes + p.slot_bytes // 2) / 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text()


def start_server(conv: Path, log: Path, *args, cgroup: Path | None = None, timeout: float = 120,
                 sigint_ignored: bool = False, env: dict[str, str] | None = None, stdout: Path | None = None) -> Served:
    """`streamoe serve CONV ARGS` on a free port, its stdout and stderr in `log` (its stdout in `stdout` where
    given); returns once /health answers. `sigint_ignored`: started as a shell's background job is, with SIGINT
    ignored; `env`: added to its environment."""
    import shlex

    port = free_port()
    cmd = [sys.executable, "-m", "streamoe.cli", "serve", str(conv), "--port", str(port), *map(str, args)]
    if cgroup is not None or sigint_ignored:
        join = f"echo $$ > {cgroup}/cgroup.procs && " if cgroup is not None else ""
        cmd = ["sh", "-c", ("trap '' INT; " if sigint_ignored else "") + f"{join}exec {shlex.join(cmd)}"]
    with open(log, "w") as out, open(stdout or os.devnull, "w") as apart:
        proc = subprocess.Popen(cmd, stdout=apart if stdout else out, stderr=out, env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                                                                                  "PYTHONFAULTHANDLER": "1"})
    served = Served(proc, port, log)
    if answers_health(served.url, proc, timeout, lambda: f"streamoe serve exited with {proc.returncode}:\n{served.text()}"):
        return served
    stop_server(served)
    raise AssertionError(f"streamoe serve did not answer /health in {timeout} s:\n{served.text()}")


def answers_health(url: str, proc: subprocess.Popen, timeout: float, exited) -> bool:
    """Whether URL/health answers 200 within `timeout` seconds; a `proc` that exits first fails the test with
    `exited()`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(exited())
        try:
            if fetch(url + "/health", timeout=1).status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


@dataclass
class Reply:
    status: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


def fetch(url: str, method: str = "GET", body: bytes | dict | None = None, timeout: float = 60,
          headers: dict[str, str] | None = None) -> Reply:
    """One plain HTTP request (the standard library's client: no second HTTP stack beside openai's)."""
    host, _, path = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        conn.request(method, "/" + path, body=data,
                     headers={**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})})
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace"))
    finally:
        conn.close()


def sse_lines(url: str, body: dict, timeout: float = 60) -> tuple[Reply, list[str]]:
    """A streamed POST, read to its end: (status and headers, the non-empty lines of the event stream)."""
    r = fetch(url, "POST", body, timeout)
    return r, [ln for ln in r.text.split("\n") if ln]


def stop_server(served: Served) -> int:
    """Interrupt the server as Ctrl+C would; returns its exit status."""
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGINT)
        try:
            served.proc.wait(30)
        except subprocess.TimeoutExpired:  # a hang: every thread's Python stack into the log (faulthandler), then kill
            served.proc.send_signal(signal.SIGABRT)
            try:
                served.proc.wait(5)
            except subprocess.TimeoutExpired:
                served.proc.kill()
                served.proc.wait()
    return served.proc.returncode


def wait_for(predicate, timeout: float = 20, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def triangle_png(path: Path) -> Path:
    """The demo picture (examples/demo.py): an orange triangle in the top-right quadrant."""
    im = Image.new("RGB", (160, 128), "white")
    ImageDraw.Draw(im).polygon([(112, 22), (129.1, 53.5), (94.9, 53.5)], fill=(245, 130, 15))
    im.save(path)
    return path


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def greedy(eng: Engine, ids: list[int], n: int, images: list | None = None) -> list[int]:
    """What `streamoe run` generates for these prompt tokens (greedy), from a fresh state."""
    eng.reset()
    return [t for t, _ in eng.generate(ids, n, Sampler(), images=images)]


def chat_ids(eng: Engine, messages: list[dict], think: bool = True, tools: list | None = None) -> list[int]:
    """The prompt `streamoe run` renders for these messages (the template, with tools when given)."""
    return eng.text.chat_ids(messages, tools=tools, enable_thinking=think)


def raw_request(port: int, path: str, body: bytes) -> socket.socket:
    """A POST sent on a plain socket whose reading is left to the caller (to hang up mid-answer)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s
