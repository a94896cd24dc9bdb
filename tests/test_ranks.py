"""Experts split over ranks (runtime/ranks.py): `streamoe run` under `mlx.launch --backend ring -n 2` on this
machine gives logits bit-identical to one process at the same per-host cap, each rank reading its own share;
a rank that cannot open stops every rank with one line naming it; `plan --ranks` shows each rank's share."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from streamoe.runtime.plan import MiB, Options, plan_for
from streamoe.runtime.serve.openai_api import Limits
from streamoe.runtime.serve.worker import ServeOptions, serve_accounts

from .conftest import cli, one_error_line
from .serve_util import (
    answers_health,
    data_url,
    fetch,
    free_port,
    raw_request,
    start_server,
    stop_server,
    triangle_png,
)

PROMPT = "The quick brown fox"
RUNTIME_MIB = 200  # a fixed allowance: one process and each rank plan the same accounts
ARGS = ["--ctx", "256", "--runtime-mib", str(RUNTIME_MIB), "-p", PROMPT, "-n", "8", "--seed", "3"]  # sampled
LAUNCH = Path(sys.executable).parent / "mlx.launch"  # MLX's launcher, installed beside this interpreter


def free_port_pair() -> int:
    """A port p with p and p + 1 free now (the ring backend's two ranks listen on them), below the kernel's
    ephemeral range: a port from that range may become the source port of any outgoing connection (the ranks'
    own among them) between this check and the ranks' bind, which then fails with "address in use"."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        p = random.randrange(max(1024, low - 12000), low - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def launch(*command: str, timeout: float = 120, stdin: str = "") -> subprocess.CompletedProcess:
    """`mlx.launch --backend ring -n 2 -- COMMAND` (the launcher's own exit status is 0 whatever the ranks did:
    callers read the ranks' output). In a session of its own: ranks that hang are killed with it at the timeout
    (killed alone, the launcher leaves them running)."""
    p = subprocess.Popen([str(LAUNCH), "--backend", "ring", "-n", "2", "-p", str(free_port_pair()), "--", *command],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_ranked(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return launch(sys.executable, "-m", "streamoe.cli", "run", *map(str, args), stdin=stdin)


@pytest.fixture(scope="module")
def ring(small_conv):
    """Skip where the ring backend cannot start two ranks here. Then one process answers once first: MLX builds the
    CPU's compiled kernels with g++ into a directory every process of the machine shares, and two ranks starting
    at once on a machine that has none would each write the same files."""
    probe = "import mlx.core as mx; g = mx.distributed.init(); print('size', g.size())"
    if not LAUNCH.exists():
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    try:
        p = launch(sys.executable, "-c", probe, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"mlx.launch --backend ring could not start two ranks: {e}")
    if p.stdout.count("size 2") != 2:
        pytest.skip(f"mlx.launch --backend ring did not start two ranks: {(p.stdout + p.stderr)[-300:]}")
    subprocess.run([sys.executable, "-m", "streamoe.cli", "run", str(small_conv), "-p", "warm", "-n", "2"],
                   capture_output=True, check=True, timeout=300)


def decode_mib_per_token(records: list[dict]) -> float:
    decode = [r for r in records if r["phase"] == "decode"]
    return sum(r["bytes_read"] for r in decode) / len(decode) / 2**20


def cap_streaming_on_both(conv: Path) -> float:
    """A per-host cap at which one host and each of two ranks all stream (neither holds its whole share)."""
    one = plan_for(conv, Options(cap_gib=8, ctx=256, runtime_bytes=RUNTIME_MIB << 20))
    cap = (max(one.fixed, *(plan_for(conv, Options(cap_gib=8, ctx=256, runtime_bytes=RUNTIME_MIB << 20, rank=r,
                                                   ranks=2)).fixed for r in range(2))) + 100 * one.slot_bytes) / 2**30
    for r in range(2):
        share = plan_for(conv, Options(cap_gib=cap, ctx=256, runtime_bytes=RUNTIME_MIB << 20, rank=r, ranks=2))
        assert share.hot_slots < share.n_layers * share.n_experts
    return cap


def test_two_ranks_give_one_hosts_logits_each_reading_its_share(ring, small_conv, tmp_path):
    cap = f"{cap_streaming_on_both(small_conv):.4f}"
    one = cli("run", small_conv, "--cap", cap, *ARGS, "--logits-out", tmp_path / "one.npz", "--stats", tmp_path / "one.jsonl",
              check=True)
    two = run_ranked(small_conv, "--cap", cap, *ARGS, "--logits-out", tmp_path / "two.npz", "--stats", tmp_path / "two.jsonl")
    assert (tmp_path / "two.npz").exists(), two.stderr
    a, b = np.load(tmp_path / "one.npz")["logits"], np.load(tmp_path / "two.npz")["logits"]
    assert a.shape == b.shape == (8, 576) and a.tobytes() == b.tobytes()
    assert two.stdout == one.stdout  # rank 0 alone prints the answer
    summary = [ln for ln in two.stderr.splitlines() if ln.startswith("[")]
    assert len(summary) == 1 and "ranks: 0: " in summary[0] and ", 1: " in summary[0], two.stderr

    single = [json.loads(ln) for ln in (tmp_path / "one.jsonl").read_text().splitlines()]
    ranked = [json.loads(ln) for ln in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in single} == {0}
    by_rank = {r: [s for s in ranked if s["rank"] == r] for r in (0, 1)}  # rank 0's file holds both ranks' records
    assert [len(v) for v in by_rank.values()] == [len(single)] * 2
    full = decode_mib_per_token(single)
    for r, records in by_rank.items():
        mib = decode_mib_per_token(records)
        assert 0 < mib < 0.6 * full, (r, mib, full)  # about half the picks, and a tier over half the experts
        picked = {e for s in records for ly in s["layers"] for e in ly["experts"]}
        assert max(picked) < 32  # local ids: rank r's expert j is expert r + 2 j
        assert all(s["token_id"] == t["token_id"] for s, t in zip(records, single, strict=True))


def test_two_resident_ranks_pipeline_to_the_same_logits(ring, small_conv, tmp_path):
    one = cli("run", small_conv, "--cap", "2", *ARGS, "--logits-out", tmp_path / "one.npz", check=True)
    two = run_ranked(small_conv, "--cap", "2", *ARGS, "--logits-out", tmp_path / "two.npz")
    assert (tmp_path / "two.npz").exists(), two.stderr
    assert np.load(tmp_path / "one.npz")["logits"].tobytes() == np.load(tmp_path / "two.npz")["logits"].tobytes()
    assert two.stdout == one.stdout and "0.00 MiB read/token" in two.stderr


def test_a_chat_across_ranks_answers_rank_0s_turns_as_one_host(ring, small_conv, tmp_path):
    """Rank 0 reads the turns and shares each; an /image line is refused there (the others could not see it),
    and the chat goes on. `/quit` ends it (the launcher does not pass on the end of stdin). Taking no image, the
    chat plans no vision account: it opens at a cap one host's chat (which takes images) does not fit."""
    args = ["--ctx", "512", "--runtime-mib", str(RUNTIME_MIB), "--chat", "-n", "6", "-q", "--seed", "3"]
    one_error_line(cli("run", small_conv, "--cap", "0.3", *args, input="hi\n"), "too small")
    cli("run", small_conv, "--cap", "0.6", *args, "--logits-out", tmp_path / "one.npz", input="hello there\nwhat next\n",
        check=True)
    two = run_ranked(small_conv, "--cap", "0.3", *args, "--logits-out", tmp_path / "two.npz",
                     stdin="hello there\n/image /no/such.png\nwhat next\n/quit\n")
    assert (tmp_path / "two.npz").exists(), two.stderr
    a, b = np.load(tmp_path / "one.npz")["logits"], np.load(tmp_path / "two.npz")["logits"]
    assert a.shape == (12, 576) and a.tobytes() == b.tobytes()
    refused = [ln for ln in two.stderr.splitlines() if ln.startswith("streamoe:")]
    assert len(refused) == 1 and "across ranks a chat takes no /image" in refused[0], two.stderr


def test_a_rank_that_cannot_open_stops_every_rank_with_one_line(ring, small_conv, tmp_path):
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(small_conv), str(bad)], check=True)
    (bad / "experts" / "q4" / "layer-03.bin").unlink()
    script = tmp_path / "per_rank.sh"  # rank 1 opens the broken copy, rank 0 the good one
    script.write_text(f'#!/bin/sh\nif [ "$MLX_RANK" = 1 ]; then m={shlex.quote(str(bad))}; else m={shlex.quote(str(small_conv))}; fi\n'
                      f'exec {shlex.quote(sys.executable)} -m streamoe.cli run "$m" "$@"\n')
    script.chmod(0o755)
    p = launch(str(script), "--cap", "2", *ARGS, timeout=60)
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("streamoe:")]
    assert len(lines) == 1, p.stderr
    assert "rank 1 of 2" in lines[0] and "could not open" in lines[0] and "layer-03.bin" in lines[0], lines[0]
    assert p.stdout == ""


def test_plan_shows_each_ranks_share_and_hot_tier(small_conv):
    p = cli("plan", small_conv, "--ranks", "3", "--cap", "0.4", "--ctx", "256", "--runtime-mib", str(RUNTIME_MIB), "--json",
            check=True)
    plans = json.loads(p.stdout)
    assert [(q["rank"], q["ranks"], q["n_experts"]) for q in plans] == [(0, 3, 22), (1, 3, 21), (2, 3, 21)]
    for q in plans:
        assert q["all_experts"] == 64 and 0 < q["hot_slots"] <= q["n_layers"] * q["n_experts"]
        assert q["accounts"]["rank exchange"] == (3 + 2) * 256 * 8 * 256 * 4  # [ranks + 2] x step x k x H floats
        assert q["accounts"]["prefill staging"] == q["n_experts"] * q["slot"]
    text = cli("plan", small_conv, "--ranks", "2", "--cap", "0.4", "--ctx", "256", check=True).stdout
    assert "rank 0 of 2: experts e % 2 == 0 of every layer (32 of 64)" in text
    assert "rank 1 of 2: experts e % 2 == 1 of every layer (32 of 64)" in text


def by_hand(tmp_path: Path, rank0: list[str], rank1: list[str], command: str = "run") -> tuple[subprocess.Popen, subprocess.Popen]:
    """Two ranks of `streamoe COMMAND ...` started by hand (no launcher to kill a survivor): rank 0 with
    arguments `rank0`, rank 1 with `rank1`; the watchdog's limit is 3 s."""
    port = free_port_pair()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {**os.environ, "MLX_HOSTFILE": str(hosts), "STREAMOE_RANK_TIMEOUT": "3"}
    cmd = [sys.executable, "-m", "streamoe.cli", command]
    one = subprocess.Popen([*cmd, *rank1], env={**env, "MLX_RANK": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    zero = subprocess.Popen([*cmd, *rank0], env={**env, "MLX_RANK": "0"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return zero, one


def test_a_peer_that_leaves_mid_answer_stops_the_other_with_one_line(ring, small_conv, tmp_path):
    """Rank 1 is killed once rank 0 has shown the answer's first bytes; rank 0 stops with one line naming itself
    (the lost link, or the watchdog)."""
    cmd = [str(small_conv), "--cap", "0.3", "--ctx", "256", "--runtime-mib", str(RUNTIME_MIB), "--raw", "-p", PROMPT,
           "-q", "-n", "200"]
    zero, one = by_hand(tmp_path, cmd, cmd)
    guard = threading.Timer(90, zero.kill)
    guard.start()
    try:
        first = zero.stdout.read(1)  # the answer streams: rank 0 is mid-answer
        one.kill()
        out, err = zero.communicate(timeout=90)
    finally:
        guard.cancel()
        for p in (zero, one):
            p.kill()
            p.communicate()
    err = err.decode()
    assert first and zero.returncode == 2 and "Traceback" not in err, err
    assert len(first + out) < 200  # it did not finish: ended by the lost peer, mid-answer
    lines = [ln for ln in err.splitlines() if ln.startswith("streamoe:")]
    assert len(lines) == 1 and lines[0].startswith("streamoe: error: rank 0 of 2 on "), err
    assert "lost its peer ranks" in lines[0] or "no exchange with its peer ranks" in lines[0], lines[0]


DIFFERS = {  # rank 1's difference from rank 0, and what rank 0's line says of it
    "n": (["-n", "2"], "(-n 2, not 200)"),
    "prompt": (["-p", "The slow brown fox"], "(the prompt "),
    "ctx": (["--ctx", "128"], "(--ctx 128, not 256)"),
    "kv": (["--kv", "q8"], "(--kv q8, not float32)"),
    "dtype": (["--dtype", "float16"], "(--dtype float16, not float32; --kv float16, not float32)"),
    "quiet": (["-q"], "(-q True, not False)"),
    "image": (["--image", "blue.png"], "(--image "),
    "max-pixels": (["--max-pixels", "4096"], "(--max-pixels 4096, not 409600)"),
    "prefill-chunk": (["--prefill-chunk", "16"], "(--prefill-chunk 16, not auto)"),
}


@pytest.mark.parametrize("differs", sorted(DIFFERS))
def test_ranks_started_otherwise_stop_before_the_first_step(ring, small_conv, tmp_path, differs):
    """Rank 1 started with another -n, prompt, context, KV or compute dtype, -q, image, --max-pixels or
    --prefill-chunk (the kernels' shapes) than rank 0. Every rank
    computes the trunk (another --kv or --dtype gives other rows without a word) and ends an answer by itself
    (another -n stops its exchanges while rank 0 waits, or pairs exchanges of other shapes; -q skips one). Every
    rank stops before the first step; rank 0 says which rank, and what differs."""
    for color in ("red", "blue"):  # the same size: the same tokens, other pixels
        Image.new("RGB", (64, 64), color).save(tmp_path / f"{color}.png")
    change, said = DIFFERS[differs]
    base = ["-n", "200", "-p", PROMPT, "--ctx", "256", "--runtime-mib", str(RUNTIME_MIB), "--dtype", "float32"]
    base += (["--cap", "0.6", "--no-think", "--image", str(tmp_path / "red.png")] if differs in ("image", "max-pixels")
             else ["--cap", "0.3", "--raw"])
    one_args = [*base, *change] if differs != "image" else [*base, "--image", str(tmp_path / "blue.png")]
    zero, one = by_hand(tmp_path, [str(small_conv), *base, *([] if differs == "quiet" else ["-q"])],
                        [str(small_conv), *one_args, *([] if differs == "quiet" else ["-q"])])
    try:
        out, err = zero.communicate(timeout=90)
        one_out, one_err = one.communicate(timeout=30)
    finally:
        for p in (zero, one):
            p.kill()
    err = err.decode()
    assert zero.returncode == 2 and one.returncode == 2 and out == b"" and one_out == "", err
    assert "streamoe:" not in one_err, one_err  # rank 0 alone speaks
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("streamoe: error: rank 1 of 2 on "), err
    assert " differs from rank 0 (" in err and said in err, err


def test_servers_ranks_started_otherwise_stop_before_serving(ring, small_conv, tmp_path):
    """`serve` across ranks: a rank with another context (checked at the engine's open) or another prompt cache
    (each rank keeps the snapshots rank 0's cache holds) stops every rank before any request, in one line."""
    base = [str(small_conv), "--cap", "2", "--runtime-mib", str(RUNTIME_MIB), "--no-images", "--port", str(free_port_pair())]
    for change, said in ((["--ctx", "128"], "(--ctx 128, not 256)"), (["--prompt-cache-mib", "4"], "(--prompt-cache-mib 4.0, not 8.0)")):
        rank1 = [*base, "--ctx", "256", "--prompt-cache-mib", "8", *change]
        zero, one = by_hand(tmp_path, [*base, "--ctx", "256", "--prompt-cache-mib", "8"], rank1, "serve")
        try:
            out, err = zero.communicate(timeout=120)
            one.communicate(timeout=30)
        finally:
            for p in (zero, one):
                p.kill()
        err = err.decode()
        assert zero.returncode == 2 and one.returncode == 2 and out == b"", err
        lines = [ln for ln in err.splitlines() if ln.startswith("streamoe:")]
        assert len(lines) == 1 and "rank 1 of 2 on " in lines[0] and " differs from rank 0 " + said in lines[0], err


def test_a_peer_gone_while_the_server_idles_stops_rank_0_at_its_next_request(ring, small_conv, tmp_path):
    """Rank 1 killed while the ranked server idles (the ring backend may not report it): rank 0's next command to
    its peers is a wait the watchdog bounds, so it stops with one line (here within its 3 s limit), not a server
    that never answers again."""
    port = free_port()
    args = [str(small_conv), "--cap", "2", "--runtime-mib", str(RUNTIME_MIB), "--no-images", "--ctx", "256",
            "--port", str(port), "--log-level", "warning"]
    zero, one = by_hand(tmp_path, args, args, "serve")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        assert answers_health(f"http://127.0.0.1:{port}", zero, 120, lambda: zero.communicate()[1].decode())
        client.completions.create(model="small", prompt=PROMPT, max_tokens=2, temperature=0)
        one.kill()
        one.communicate()
        def ask() -> None:
            with contextlib.suppress(openai.APIError):  # no answer: the server stops
                client.completions.create(model="small", prompt=PROMPT, max_tokens=2, temperature=0)

        threading.Thread(target=ask, daemon=True).start()
        err = zero.communicate(timeout=60)[1].decode()
    finally:
        for p in (zero, one):
            p.kill()
    lines = [ln for ln in err.splitlines() if ln.startswith("streamoe: error:")]
    assert zero.returncode == 2 and len(lines) == 1 and lines[0].startswith("streamoe: error: rank 0 of 2 on "), err
    assert "lost its peer ranks" in lines[0] or "no exchange with its peer ranks" in lines[0], lines[0]


@pytest.mark.parametrize("reads, said", [(["--raw", "-p", "-"], "-p -"), (["-p", "hi", "--image", "-"], "--image -"),
                                         (["-p", "hi", "--json-schema", "/dev/stdin"], "--json-schema")])
def test_stdin_read_whole_is_refused_across_ranks(ring, small_conv, reads, said):
    """mlx.launch never ends its ranks' stdin: a prompt, an image or a schema read from it would wait for ever, so
    each is refused in one line."""
    p = launch(sys.executable, "-m", "streamoe.cli", "run", str(small_conv), "--cap", "0.3", "--ctx", "256", *reads,
               stdin="hello\n", timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("streamoe:")]
    assert lines == [f"streamoe: error: across ranks (mlx.launch) {said} would wait for ever: stdin never ends there; "
                     "give a file (-p TEXT for a prompt)"], p.stderr


# ---- `streamoe serve` across ranks: rank 0 serves, rank 1 repeats its engine calls (runtime/serve/lockstep.py)
SERVE_CTX = 256
SERVE = ["--ctx", SERVE_CTX, "--runtime-mib", RUNTIME_MIB, "--prompt-cache-mib", 8, "--max-body-mib", 0.5, "--max-queue", 2,
         "--max-connections", 8, "--log-level", "warning"]
SERVE_OPTIONS = ServeOptions("t", limits=Limits(max_body=MiB // 2), max_queue=2, max_connections=8, prompt_cache_bytes=8 * MiB)
IDLE_TIMEOUT = 4  # STREAMOE_RANK_TIMEOUT for the ranked server: the test idles longer than this between requests
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}
HELLO = [{"role": "user", "content": PROMPT}]


def serve_plan(conv: Path, cap: float, rank: int = 0, ranks: int = 1):
    """The plan `streamoe serve CONV --cap CAP *SERVE` makes on rank `rank` of `ranks` (no images)."""
    return plan_for(conv, Options(cap_gib=cap, ctx=SERVE_CTX, runtime_bytes=RUNTIME_MIB * MiB, rank=rank, ranks=ranks,
                                  extra_accounts=serve_accounts(conv, SERVE_CTX, SERVE_OPTIONS, rank, ranks)))


def serve_caps(conv: Path) -> tuple[float, float]:
    """(rank 0's cap, rank 1's): rank 0's is a single host's that streams (100 hot slots of 512); rank 1's is
    that less the accounts only rank 0 plans (its requests), so both ranks hold the same hot tier over their
    shares. At one cap rank 1 would hold its whole share of this small model (the server's sockets alone are
    100+ MiB) and read nothing."""
    one, zero, first = serve_plan(conv, 8), serve_plan(conv, 8, 0, 2), serve_plan(conv, 8, 1, 2)
    cap = one.fixed + 100 * one.slot_bytes
    caps = (cap / 2**30, (cap - zero.fixed + first.fixed) / 2**30)
    for r, c in enumerate(caps):
        p = serve_plan(conv, c, r, 2)
        assert 0 < p.hot_slots < p.n_layers * p.n_experts, (r, p.hot_slots)
    return caps


@dataclass
class RankedServer:
    launcher: subprocess.Popen
    port: int
    logs: list[Path]
    pids: list[Path]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pid(self, rank: int) -> int:
        return int(self.pids[rank].read_text())

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()


def start_ranked_server(conv: Path, where: Path, caps: tuple[float, float], timeout: float = 120) -> RankedServer:
    """`mlx.launch --backend ring -n 2 -- streamoe serve CONV` on a free port, each rank at its own cap, its pid
    and stderr in files of its own; returns once /health answers."""
    port = free_port()
    script = where / "serve_rank.sh"
    args = shlex.join(map(str, ["--port", port, *SERVE]))
    script.write_text(f'#!/bin/sh\nif [ "$MLX_RANK" = 1 ]; then cap={caps[1]:.6f}; else cap={caps[0]:.6f}; fi\n'
                      f'echo $$ > {where}/pid.$MLX_RANK\n'
                      f'exec {shlex.quote(sys.executable)} -m streamoe.cli serve {shlex.quote(str(conv))} --cap $cap {args} '
                      f'2> {where}/log.$MLX_RANK\n')
    script.chmod(0o755)
    env = {**os.environ, "STREAMOE_RANK_TIMEOUT": str(IDLE_TIMEOUT), "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen([str(LAUNCH), "--backend", "ring", "-n", "2", "-p", str(free_port_pair()), "--", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    s = RankedServer(launcher, port, [where / "log.0", where / "log.1"], [where / "pid.0", where / "pid.1"])
    if answers_health(s.url, launcher, timeout, lambda: f"the ranked server exited:\n{launcher.communicate()}\n" +
                      "\n".join(p.read_text() for p in s.logs if p.exists())):
        return s
    stop_ranked_server(s)
    raise AssertionError(f"the ranked server did not answer /health in {timeout} s")


def stop_ranked_server(s: RankedServer) -> None:
    """SIGINT to rank 0 (which stops rank 1); the launcher's session killed if they are not gone within 30 s."""
    if s.launcher.poll() is None and s.pids[0].exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.pid(0), signal.SIGINT)
    try:
        s.launcher.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(s.launcher.pid, signal.SIGKILL)
        s.launcher.wait()


@pytest.fixture(scope="module")
def served(ring, small_conv, tmp_path_factory):
    """A single-host server and a two-rank one at the caps of `serve_caps`, with their clients."""
    caps = serve_caps(small_conv)
    where = tmp_path_factory.mktemp("ranked")
    one = start_server(small_conv, where / "one.log", "--cap", f"{caps[0]:.6f}", "--no-images", *SERVE)
    try:
        two = start_ranked_server(small_conv, where, caps)
    except BaseException:
        stop_server(one)
        raise
    clients = [openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120) for s in (one, two)]
    yield one, two, clients
    stop_ranked_server(two)
    stop_server(one)


def answer(client: openai.OpenAI, stream: bool = False, **kw) -> tuple[list[int] | str, dict]:
    """(the answer's token ids, or its text when streamed; its `streamoe` telemetry)."""
    r = client.chat.completions.create(model="small", messages=HELLO, max_tokens=12, stream=stream, extra_body=THINK_OFF, **kw)
    if not stream:
        return r.choices[0].model_extra["token_ids"], r.model_extra["streamoe"]
    chunks = list(r)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].model_extra["streamoe"]


def test_two_ranks_serve_one_hosts_answers_each_reading_about_half(served):
    """Greedy, streamed and seeded answers equal a single host's; each rank's reads (the answers' telemetry,
    and /metrics) are about half of that host's at rank 0's cap, over the same hot tier on each rank; the
    ranks idle longer than their watchdog's limit after the first answer, and answer the rest as the single
    host does (which answers meanwhile: each server gets its requests in the same order, and they share nothing)."""
    one, two, (c1, c2) = served
    json_object = {"response_format": {"type": "json_object"}}  # constrained: each token drawn once the last is read
    asks = [{"temperature": 0}, {"stream": True, "temperature": 0}, {"temperature": 0.9, "seed": 7, "top_p": 0.95},
            {"temperature": 0.9, "seed": 3, **json_object}]
    ranked = [answer(c2, **asks[0])]
    idle_since = time.monotonic()
    single = [answer(c1, **kw) for kw in asks]
    time.sleep(max(0.0, idle_since + IDLE_TIMEOUT + 1 - time.monotonic()))  # past the watchdog's limit: neither rank may stop
    ranked += [answer(c2, **kw) for kw in asks[1:]]
    answers = list(zip(single, ranked, strict=True))
    for (want, _), (got, _) in answers:
        assert got == want and len(want) > 0
    full = answers[0][0][1]["mib_read_token"]
    tele = [t for _, (_, t) in answers]
    for rank in (0, 1):
        mibs = [t["ranks"][rank]["mib_read_token"] for t in tele]
        assert all(0 < m < 0.6 * full for m in mibs), (rank, mibs, full)  # its share's picks, the same tier
    metrics = fetch(two.url + "/metrics").text
    for rank in (0, 1):  # every finished answer's reads, this rank's counter (the last answer's included)
        line = next(ln for ln in metrics.splitlines() if ln.startswith(f'streamoe_rank_expert_bytes_read_total{{rank="{rank}"}}'))
        counted = float(line.split()[-1])
        assert counted >= sum(t["ranks"][rank]["bytes_read"] for t in tele) > 0, metrics
    assert "Traceback" not in two.log(0) + two.log(1)


def test_images_prompt_logprobs_and_choices_are_refused_across_ranks(served, tmp_path):
    _, two, (_, c2) = served
    with pytest.raises(openai.BadRequestError) as e:  # the prompt's logprobs: one host's
        c2.completions.create(model="small", prompt="def f(x):", max_tokens=1, echo=True, logprobs=1)
    assert "needs one host" in e.value.message
    png = triangle_png(tmp_path / "t.png")
    with pytest.raises(openai.BadRequestError) as e:
        c2.chat.completions.create(model="small", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": data_url(png)}}]}])
    assert "across ranks" in e.value.message and "images" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's `n`: one choice a request there
        c2.completions.create(model="small", prompt="def f(x):", max_tokens=2, n=2)
    assert "across ranks" in e.value.message and e.value.body["param"] == "n", e.value.message
    assert answer(c2, temperature=0)[0]  # and the server goes on


def test_sigterm_to_rank_0_mid_answer_ends_both_ranks_cleanly(served):
    """The running stream ends with the `shutting_down` error; rank 0 tells rank 1 to stop; both exit 0 with no
    traceback within a bound."""
    _, two, _ = served
    body = json.dumps({"model": "small", "messages": HELLO, "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    sock = raw_request(two.port, "/v1/chat/completions", body)
    got = b""
    sock.settimeout(60)
    while got.count(b"data: {") < 3:
        got += sock.recv(65536)
    t0 = time.monotonic()
    os.kill(two.pid(0), signal.SIGTERM)
    while b"data: [DONE]" not in got:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    sock.close()
    two.launcher.wait(30)
    assert time.monotonic() - t0 < 30
    events = [ln for ln in got.split(b"\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    out, err = two.launcher.communicate()
    assert "exited with code" not in err and "was killed" not in err, err  # the launcher's word on each rank
    for rank in (0, 1):
        log = two.log(rank)
        assert "Traceback" not in log and "streamoe: error" not in log and "[ring]" not in log, (rank, log[-3000:])
    assert "streamoe: stopped" in two.log(0)


def test_a_model_too_large_for_one_hosts_cap_opens_across_two(ring, small_conv, tmp_path):
    """At ctx 64 one host's fixed accounts hold a staging slot for each of a layer's 64 experts; a rank's for its
    32, and its exchange buffers (a prefill step of 64 tokens) take less than the 32 it saves. At a cap between
    the two, one host refuses to open and two ranks answer, streaming, with a single resident host's logits."""
    args = ["--ctx", "64", "--runtime-mib", str(RUNTIME_MIB), "--raw", "-p", PROMPT, "-n", "8", "--seed", "3"]
    base = Options(cap_gib=8, ctx=64, runtime_bytes=RUNTIME_MIB * MiB)
    one = plan_for(small_conv, base)
    shares = [plan_for(small_conv, replace(base, rank=r, ranks=2)) for r in (0, 1)]
    rank_fixed = max(p.fixed for p in shares)
    assert rank_fixed + 4 * one.slot_bytes < one.fixed  # the rank's half of the staging outweighs its exchange
    cap = f"{(rank_fixed + one.fixed) / 2 / 2**30:.6f}"
    alone = cli("run", small_conv, "--cap", cap, *args)
    line = one_error_line(alone, "too small for this model at ctx 64: the fixed accounts need", "smallest cap that fits")
    said, need = map(float, re.search(r"cap ([\d.]+) GiB .* need ([\d.]+) GiB", line).groups())
    assert alone.returncode == 2 and said < need and abs(need - one.fixed / 2**30) < 1e-3, line
    ref = cli("run", small_conv, "--cap", "2", *args, "--logits-out", tmp_path / "one.npz", check=True)
    two = run_ranked(small_conv, "--cap", cap, *args, "--logits-out", tmp_path / "two.npz")
    assert (tmp_path / "two.npz").exists(), two.stderr
    assert np.load(tmp_path / "one.npz")["logits"].tobytes() == np.load(tmp_path / "two.npz")["logits"].tobytes()
    assert two.stdout == ref.stdout
    summary = next(ln for ln in two.stderr.splitlines() if ln.startswith("["))
    reads = [float(m) for m in re.findall(r"\d: ([\d.]+) MiB read/token", summary)]
    assert len(reads) == 2 and all(m > 0 for m in reads), summary  # each rank streams its share


def test_ranks_that_plan_different_prefill_chunks_cut_a_prompt_alike(ring, small_conv, tmp_path):
    """Rank 0 streams at its cap (a chunk of 512 tokens), rank 1 holds its whole share (a chunk of one 256-token
    step): each chunk's layers exchange block by block, so every rank must cut the prompt alike (the smallest
    chunk any rank planned), or the blocks' exchanges pair up wrong."""
    chunks = [plan_for(small_conv, Options(cap_gib=c, ctx=512, runtime_bytes=RUNTIME_MIB * MiB, rank=r, ranks=2)).prefill_chunk
              for r, c in ((0, 0.3), (1, 2))]
    assert chunks == [512, 256]
    script = tmp_path / "per_rank.sh"
    script.write_text(f'#!/bin/sh\nif [ "$MLX_RANK" = 1 ]; then c=2; else c=0.3; fi\n'
                      f'exec {shlex.quote(sys.executable)} -m streamoe.cli run {shlex.quote(str(small_conv))} --cap $c "$@"\n')
    script.chmod(0o755)
    args = ["--ctx", "512", "--runtime-mib", str(RUNTIME_MIB), "--raw", "-p", " ".join([PROMPT] * 21), "-n", "2", "-q",
            "--seed", "3"]
    cli("run", small_conv, "--cap", "2", *args, "--logits-out", tmp_path / "one.npz", check=True)
    two = launch(str(script), *args, "--logits-out", str(tmp_path / "two.npz"))
    assert (tmp_path / "two.npz").exists(), two.stderr
    assert np.load(tmp_path / "one.npz")["logits"].tobytes() == np.load(tmp_path / "two.npz")["logits"].tobytes()
