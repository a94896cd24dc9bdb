"""`streamoe serve` under load: time to first token and tok/s for 1, 4 and 8 concurrent clients (streamed
completions, read as a client reads them), and the prefill tokens the prompt cache saves on a 5-turn chat and
on a 5-turn agent that renders its own prompts (each turn a text completion: the last prompt, its answer and a
tool's output), each against a second server started with --prompt-cache-mib 0.

    python -m bench.serve                                   # the embedded model, converted in --scratch
    python -m bench.serve --model ~/models/qwen36-streamoe --cap 4 --ctx 4096 --name serve-full
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import scratch_dir, write_result

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
           "import json\n\n\ndef load(path):\n", "def parse_args(argv=None):\n", "class Reader:\n    def read(self):\n",
           "import re\n\nWORD = re.compile(", "def merge_sort(items):\n"]
TURNS = ["What shape is in the image?", "What colour is it?", "Where is it?", "Is it a star?", "How many shapes are there?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600):
    """A POST with the standard library's client (the bench needs nothing beyond the runtime install)."""
    host, _, path = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host, timeout=timeout)
    conn.request("POST", "/" + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def start(model: Path, args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "streamoe.cli", "serve", str(model), "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"streamoe serve exited ({proc.returncode}); see {log}")
        try:
            conn = http.client.HTTPConnection(f"127.0.0.1:{port}", timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"streamoe serve did not start; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def one_stream(url: str, prompt: str, tokens: int) -> dict:
    """A streamed greedy completion: seconds to the first text, tokens, seconds in all, server telemetry."""
    t0 = time.perf_counter()
    first, n, tele = None, 0, None
    conn, resp = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
            first = time.perf_counter() - t0
        if chunk.get("usage"):
            n = chunk["usage"]["completion_tokens"]
        tele = chunk.get("streamoe") or tele
    conn.close()
    return {"ttft_s": first, "tokens": n, "s": time.perf_counter() - t0, "decode_tok_s": tele and tele["tok_s"]}


def load(url: str, clients: int, tokens: int) -> dict:
    one_stream(url, PROMPTS[0], 4)  # warm-up: first-use costs are not the server's steady state
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda i: one_stream(url, PROMPTS[i % len(PROMPTS)], tokens), range(clients)))
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] for r in runs]
    return {"clients": clients, "max_tokens": tokens, "tokens": sum(r["tokens"] for r in runs), "wall_s": round(wall, 2),
            "ttft_s_median": round(statistics.median(ttft), 3), "ttft_s_max": round(max(ttft), 3),
            "tok_s_total": round(sum(r["tokens"] for r in runs) / wall, 2),
            "tok_s_per_client_median": round(statistics.median(r["tokens"] / (r["s"] - r["ttft_s"]) for r in runs), 2),
            "decode_tok_s_median": round(statistics.median(r["decode_tok_s"] for r in runs), 2)}


def conversation(url: str, picture: str | None) -> list[dict]:
    """Five chat turns, thinking on (the template drops past thinking when it re-renders): per turn the
    prompt tokens, those restored from a snapshot, and the time to the whole answer."""
    msgs: list[dict] = []
    out = []
    for i, q in enumerate(TURNS):
        content = [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": q}] if i == 0 and picture else q
        msgs.append({"role": "user", "content": content})
        t0 = time.perf_counter()
        conn, resp = post(url + "/v1/chat/completions", {"messages": msgs, "temperature": 0, "max_tokens": 16})
        r = json.loads(resp.read())
        conn.close()
        s = time.perf_counter() - t0
        answer = r["choices"][0]["message"]["content"]
        msgs.append({"role": "assistant", "content": answer})
        out.append({"prompt_tokens": r["usage"]["prompt_tokens"], "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "s": round(s, 3), "answer": answer})
    return out


def completion_agent(url: str) -> list[dict]:
    """Five turns of an agent that renders its prompts itself: each a text completion of the last prompt, its answer
    and a tool's output; per turn the prompt tokens, those restored from a snapshot, and the time to the answer."""
    prompt = "# A tool log: each call, then its output.\n" + "".join(f"call {i}: read(page={i})\n  -> {i * 7} lines\n"
                                                                     for i in range(20))
    out = []
    for turn in range(5):
        t0 = time.perf_counter()
        conn, resp = post(url + "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 16})
        r = json.loads(resp.read())
        conn.close()
        s = time.perf_counter() - t0
        answer = r["choices"][0]["text"]
        out.append({"prompt_tokens": r["usage"]["prompt_tokens"], "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "s": round(s, 3), "answer": answer})
        prompt += answer + f"\n  -> tool output {turn}: " + "ok, " * 12 + "done\n"
    return out


def saved_by_cache(cached: list[dict], fresh: list[dict]) -> dict:
    """What the prompt cache saved over the same turns against a server without one."""
    total, saved = sum(t["prompt_tokens"] for t in fresh), sum(t["cached_tokens"] for t in cached)
    return {"turns": len(cached), "prompt_tokens": total, "prefilled_with_cache": total - saved, "saved": saved,
            "saved_fraction": round(saved / total, 3), "s_with_cache": round(sum(t["s"] for t in cached), 2),
            "s_without_cache": round(sum(t["s"] for t in fresh), 2),
            "same_answers": [t["answer"] for t in cached] == [t["answer"] for t in fresh], "per_turn": cached}


def triangle_url(scratch: Path) -> str:
    import base64

    from PIL import Image, ImageDraw

    im = Image.new("RGB", (160, 128), "white")
    ImageDraw.Draw(im).polygon([(112, 22), (129.1, 53.5), (94.9, 53.5)], fill=(245, 130, 15))
    p = scratch / "bench-triangle.png"
    im.save(p)
    return "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode()


def quarter_cap(model: Path, ctx: int, runtime_mib: int, cache_mib: float) -> float:
    """A cap whose hot tier holds a quarter of the experts, with the accounts the server adds (`serve_accounts`)."""
    from streamoe.runtime.engine import Options, plan_for
    from streamoe.runtime.serve.worker import ServeOptions, serve_accounts

    so = ServeOptions("bench", prompt_cache_bytes=int(cache_mib * 2**20))
    p = plan_for(model, Options(cap_gib=64, ctx=ctx, images=True, runtime_bytes=runtime_mib * 2**20,
                                extra_accounts=serve_accounts(model, ctx, so)))
    return (p.fixed + p.n_layers * p.n_experts // 4 * p.slot_bytes + p.slot_bytes // 2) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="converted directory (default: models/tiny, converted)")
    ap.add_argument("--cap", type=float, default=None, help="GiB (default: a quarter of the experts in the hot tier)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each load request")
    ap.add_argument("--runtime-mib", type=int, default=256)
    ap.add_argument("--prompt-cache-mib", type=float, default=64)
    ap.add_argument("--scratch", type=Path, default=None,
                    help="work directory, kept (default: a fresh temporary directory, removed at the end)")
    ap.add_argument("--name", default="serve")
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        run(a, scratch)


def run(a: argparse.Namespace, scratch: Path) -> None:
    model = a.model
    if model is None:
        from streamoe.convert.convert import convert

        model = scratch / "tiny-q4"
        if not (model / "manifest.json").exists():
            convert(ROOT / "models" / "tiny", model, formats=["q4"], progress=False, force=True)
    cap = a.cap or quarter_cap(model, a.ctx, a.runtime_mib, a.prompt_cache_mib)
    common = ["--cap", str(cap), "--ctx", str(a.ctx), "--runtime-mib", str(a.runtime_mib), "--log-level", "warning"]
    picture = triangle_url(scratch)
    load_avg = round(os.getloadavg()[0], 2)  # these machines are shared: the timings are as noisy as this says

    proc, url = start(model, [*common, "--prompt-cache-mib", str(a.prompt_cache_mib)], scratch / "serve.log")
    try:
        loads = [load(url, c, a.tokens) for c in (1, 4, 8)]
        cached, agent = conversation(url, picture), completion_agent(url)
    finally:
        stop(proc)
    proc, url = start(model, [*common, "--prompt-cache-mib", "0"], scratch / "serve-nocache.log")
    try:
        fresh, fresh_agent = conversation(url, picture), completion_agent(url)
    finally:
        stop(proc)
    write_result(a.name, "serve", [{"model": str(a.model or "models/tiny"), "cap_gib": round(cap, 4), "ctx": a.ctx,
                                    "load_avg_1m": load_avg, "load": loads, "prompt_cache": saved_by_cache(cached, fresh),
                                    "prompt_cache_completions": saved_by_cache(agent, fresh_agent)}])


if __name__ == "__main__":
    main()
