"""`streamoe serve --cap 1` under hostile clients, one class at a time, each against a fresh server inside a
memory cgroup equal to the cap (cgroup v1, where this process may make one; else without): peak memory
against the plan's `requests` account, /health latency throughout, OOM kills and failcnt, tracebacks in the
log, and whether a greedy answer after the attack equals the one the fresh server gave before it. The
servers run without a prompt cache, so the memory an attack adds above the start is the requests'
(and, in `inflating`, that of the answers it runs).

What /health measures: a probe every 50 ms, each on a new connection (connect, request, answer: what a
monitor sees), from this process, which does nothing else while the attack runs. The attack's client side
runs in a process of its own at nice 10: on this machine it then takes the CPU the server leaves, as an
attacker on another machine would, instead of competing with the server for it (and the probe does not
wait behind the attacker's threads for a GIL). The server runs at the default priority; whatever else the
machine runs competes with it, so each class records the 1-minute load average at its end.

Classes: `slow_bodies` (hundreds of connections each sending most of a 4 MiB body, then stalling),
`inflating` (a long answer running while the queue fills with bodies that keep the most a request may:
large stop strings four bytes a character, plus `[{},{},...]` bodies refused before parsing), `oversized`
(4 MB chats that cannot fit the context, several at once), `idle_sockets` (2,000 idle connections at a
1,024 open-file limit), `non_readers` (for 30 s a request every 0.5 s, every other one streamed, each asking
for 2,000 tokens with 20 top logprobs and its end tokens banned, from a socket with a 4 KiB receive buffer that
never reads; then 45 s more holding them, then one polite request: its status, and each non-reader's state).

    python -m bench.hostile                     # the embedded model, converted in --scratch
    python -m bench.hostile --classes idle_sockets --name hostile-idle
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import scratch_dir, status_kib, write_result
from .decode import cgroup_base
from .serve import free_port

ROOT = Path(__file__).resolve().parents[1]
CODE = "def fibonacci(n):\n"
CLASSES = ("slow_bodies", "inflating", "oversized", "idle_sockets", "non_readers")


def get(url: str, timeout: float = 10) -> dict:
    import http.client

    host, _, path = url.removeprefix("http://").partition("/")
    c = http.client.HTTPConnection(host, timeout=timeout)
    try:
        c.request("GET", "/" + path)
        return json.loads(c.getresponse().read())
    finally:
        c.close()


class Watch:
    """/health every 50 ms from its own thread: each probe's latency, and how many got no `ok`."""

    def __init__(self, url: str):
        self.url, self.ms, self.failed, self.stop = url, [], 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                assert get(self.url + "/health", timeout=10)["status"] == "ok"
            except Exception:  # noqa: BLE001 - a refused, cut or wrong answer is a failed probe
                self.failed += 1
            self.ms.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.05)

    def done(self) -> dict:
        self.stop.set()
        self.thread.join()
        ms = sorted(self.ms)
        return {"probes": len(ms), "max_ms": round(ms[-1], 1), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 1),
                "median_ms": round(statistics.median(ms), 1), "over_100ms": sum(m > 100 for m in ms),
                "failed": self.failed}


class Capped:
    """A fresh `streamoe serve` (inside its own cgroup when one can be made) and what it used."""

    def __init__(self, model: Path, cap: float, args: list[str], log: Path, nofile: int | None = None):
        self.port, self.log, self.cap = free_port(), log, cap
        self.url = f"http://127.0.0.1:{self.port}"
        base = cgroup_base()
        self.cg = None
        if base is not None:
            self.cg = base / f"streamoe_hostile_{os.getpid()}"
            self.cg.mkdir(exist_ok=True)
            (self.cg / "memory.limit_in_bytes").write_text(str(int(cap * 2**30)))
        cmd = [sys.executable, "-m", "streamoe.cli", "serve", str(model), "--port", str(self.port), "--cap", str(cap), *args]
        pre = (f"echo $$ > {self.cg}/cgroup.procs && " if self.cg else "") + (f"ulimit -n {nofile} && " if nofile else "")
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["sh", "-c", pre + "exec " + shlex.join(cmd)], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"streamoe serve exited:\n{log.read_text()[-3000:]}")
            try:
                get(self.url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        self.plan = get(self.url + "/v1/plan")

    def answer(self) -> str:
        import http.client

        c = http.client.HTTPConnection(f"127.0.0.1:{self.port}", timeout=120)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": CODE, "max_tokens": 12, "temperature": 0}))
        return json.loads(c.getresponse().read())["choices"][0]["text"]

    def close(self) -> dict:
        hwm = status_kib(self.proc.pid, "VmHWM") * 1024
        self.proc.send_signal(2)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        out = {"exit": code, "peak_rss_mib": round(hwm / 2**20, 1)}
        if self.cg is not None:
            read = lambda f: (self.cg / f).read_text()  # noqa: E731
            oom = dict(ln.split() for ln in read("memory.oom_control").splitlines()).get("oom_kill")
            out.update(cgroup_peak_mib=round(int(read("memory.max_usage_in_bytes")) / 2**20, 1),
                       failcnt=int(read("memory.failcnt")), oom_kills=None if oom is None else int(oom))
            try:
                (self.cg / "memory.force_empty").write_text("1")
            except OSError:
                pass
            self.cg.rmdir()
        log = self.log.read_text()
        out.update(tracebacks=log.count("Traceback"), log_kib=round(len(log) / 1024, 1))
        return out


def send_head(port: int, length: int, body: bytes = b"", path: str = "/v1/completions") -> socket.socket | None:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n\r\n".encode() + body)
        return s
    except OSError:
        return None


def slow_bodies(port: int, n: int = 300) -> dict:
    body = b'{"prompt": "' + b"a" * (4 * 2**20 - 64)
    with ThreadPoolExecutor(32) as pool:
        socks = list(pool.map(lambda _: send_head(port, 4 * 2**20, body), range(n)))
    time.sleep(6)  # past the body deadline (--body-timeout 5): the admitted ones end in 408
    for s in socks:
        if s is not None:
            s.close()
    return {"connections": n}


def inflating(port: int, n: int = 12) -> dict:
    long = json.dumps({"prompt": CODE, "max_tokens": 1500, "temperature": 0, "stream": True}).encode()
    running = send_head(port, len(long), long)
    time.sleep(1)
    stop = "\U0001F600" + "a" * 380_000  # four bytes a character: 1.5 MiB a string in memory
    kept = json.dumps({"prompt": "hi", "max_tokens": 1, "stop": [stop] * 4}, ensure_ascii=False).encode()
    flat = b'{"prompt": "hi", "x": [' + b",".join([b"{}"] * 1_300_000) + b"]}"
    statuses: dict = {}

    def one(i: int) -> None:
        r = send_head(port, len(kept if i % 2 else flat), kept if i % 2 else flat)
        if r is None:  # refused (503) while more bodies lingered than the server reads for: the send was reset
            statuses["reset"] = statuses.get("reset", 0) + 1
            return
        r.settimeout(120)
        try:
            head = r.recv(64).split(b" ")[1].decode()
        except (OSError, IndexError):
            head = "closed"
        statuses[head] = statuses.get(head, 0) + 1
        r.close()

    with ThreadPoolExecutor(n) as pool:
        queued = [pool.submit(one, i) for i in range(n)]
        time.sleep(4)
        running.close()  # the long answer ends; the queue drains
        for f in queued:
            f.result()
    return {"bodies": n, "statuses": statuses}


def oversized(port: int, n: int = 16) -> dict:
    big = json.dumps({"messages": [{"role": "user", "content": "def " * 1_000_000}]}).encode()
    statuses: dict = {}

    def one(_):
        s = send_head(port, len(big), big, "/v1/chat/completions")
        s.settimeout(60)
        code = s.recv(64).split(b" ")[1].decode()
        statuses[code] = statuses.get(code, 0) + 1
        s.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(n)))
    return {"requests": n, "statuses": statuses, "s": round(time.perf_counter() - t0, 2)}


def idle_sockets(port: int, n: int = 2000) -> dict:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    time.sleep(4)
    for s in socks:
        s.close()
    return {"sockets": n, "file_limit": 1024}


def non_readers(port: int, seconds: float = 30, hold: float = 45) -> dict:
    import http.client

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "models" / "tiny" / "tokenizer.json"))
    ban = {str(tok.token_to_id(t)): -100 for t in ("<|im_end|>", "<|endoftext|>") if tok.token_to_id(t) is not None}
    bodies = [json.dumps({"prompt": CODE, "max_tokens": 2000, "temperature": 0, "logprobs": 20, "stream": i == 0,
                          "logit_bias": ban}).encode() for i in range(2)]
    socks = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            s.connect(("127.0.0.1", port))
            body = bodies[len(socks) % 2]
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
                      .encode() + body)
            socks.append(s)
        except OSError:
            s.close()
        time.sleep(0.5)
    time.sleep(hold)  # no more, the non-readers still connected, still not reading
    # what a polite client gets then
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(f"127.0.0.1:{port}", timeout=60)
    try:
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": CODE, "max_tokens": 8, "temperature": 0}))
        polite = c.getresponse().status
    except OSError as e:
        polite = type(e).__name__
    finally:
        c.close()
    polite_s = round(time.perf_counter() - t0, 2)
    states: dict = {}  # each connection's TCP state as its client sees it: closed (reset), close-wait (ended), open
    for s in socks:
        state = {7: "reset", 8: "ended"}.get(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0], "open")
        states[state] = states.get(state, 0) + 1
        s.close()
    return {"requests": len(socks), "seconds": seconds, "hold_s": hold, "connections": states,
            "polite_status": polite, "polite_s": polite_s}


ATTACK_NICE = 10


def attack(name: str, port: int) -> dict:
    """One class's client side, in a process of its own at nice ATTACK_NICE; what it reports."""
    out = subprocess.run([sys.executable, "-m", "bench.hostile", "--attack", name, "--port", str(port)], cwd=ROOT,
                         preexec_fn=lambda: os.nice(ATTACK_NICE), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the {name} attack failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def run(a: argparse.Namespace, scratch: Path) -> None:
    model = a.model
    if model is None:
        from streamoe.convert.convert import convert

        model = scratch / "tiny-q4"
        if not (model / "manifest.json").exists():
            convert(ROOT / "models" / "tiny", model, formats=["q4"], progress=False, force=True)
    # no prompt cache: what the attacks add above the start is then the requests account's alone
    args = ["--ctx", str(a.ctx), "--prompt-cache-mib", "0", "--body-timeout", "5", "--head-timeout", "2", "--log-level", "warning"]
    results = []
    for name in a.classes:
        srv = Capped(model, a.cap, args, scratch / f"hostile-{name}.log", nofile=1024 if name == "idle_sockets" else None)
        try:
            before = srv.answer()
            rss0 = status_kib(srv.proc.pid, "VmRSS") * 1024
            watch = Watch(srv.url)
            detail = attack(name, srv.port)
            health = watch.done()
            load = os.getloadavg()[0]
            after = srv.answer()
        finally:
            used = srv.close()
        acc = srv.plan["accounts"]
        total = sum(acc.values()) + srv.plan["hot_slots"] * srv.plan["slot"]
        results.append({"class": name, **detail, "cap_gib": a.cap, "plan_total_mib": round(total / 2**20, 1),
                        "requests_account_mib": round(acc["requests"] / 2**20, 1),
                        "rss_before_mib": round(rss0 / 2**20, 1), **used,
                        "peak_over_start_mib": round(used["peak_rss_mib"] - rss0 / 2**20, 1),
                        "health": health, "greedy_same": before == after, "load_avg_1m": round(load, 2)})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    write_result(a.name, "hostile", [{"model": str(a.model or "models/tiny"), "ctx": a.ctx,
                                      "load_avg_1m": round(os.getloadavg()[0], 2),
                                      "cgroup": cgroup_base() is not None, "classes": results}])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="converted directory (default: models/tiny, converted)")
    ap.add_argument("--cap", type=float, default=1.0, help="GiB, and the cgroup's limit")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--classes", nargs="+", choices=CLASSES, default=list(CLASSES))
    ap.add_argument("--scratch", type=Path, default=None,
                    help="work directory, kept (default: a fresh temporary directory, removed at the end)")
    ap.add_argument("--name", default="hostile")
    ap.add_argument("--attack", choices=CLASSES, help=argparse.SUPPRESS)  # one class's client side (see `attack`)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.attack:
        print(json.dumps(globals()[a.attack](a.port)))
        return
    with scratch_dir(a.scratch) as scratch:
        run(a, scratch)


if __name__ == "__main__":
    main()
