"""Experts split over ranks (runtime/ranks.py): `streamoe run` under `mlx.launch --backend ring -n 2` on this
machine gives logits bit-identical to one process at the same per-host cap, each rank reading its own share;
a rank that cannot open stops every rank with one line naming it; `plan --ranks` shows each rank's share."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamoe.runtime.plan import Options, plan_for

from .conftest import cli

PROMPT = "The quick brown fox"
RUNTIME_MIB = 200  # a fixed allowance: one process and each rank plan the same accounts
ARGS = ["--ctx", "256", "--runtime-mib", str(RUNTIME_MIB), "-p", PROMPT, "-n", "8"]
LAUNCH = Path(sys.executable).parent / "mlx.launch"  # MLX's launcher, installed beside this interpreter


def free_port_pair() -> int:
    """A port p with p and p + 1 free now (the ring backend's two ranks listen on them)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 1))
                    return p
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


def launch(*command: str, timeout: float = 120, stdin: str = "") -> subprocess.CompletedProcess:
    """`mlx.launch --backend ring -n 2 -- COMMAND` (the launcher's own exit status is 0 whatever the ranks did:
    callers read the ranks' output)."""
    return subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", "-p", str(free_port_pair()), "--", *command],
                          capture_output=True, text=True, timeout=timeout, input=stdin)


def run_ranked(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return launch(sys.executable, "-m", "streamoe.cli", "run", *map(str, args), stdin=stdin)


@pytest.fixture(scope="module")
def ring():
    """Skip where the ring backend cannot start two ranks here."""
    probe = "import mlx.core as mx; g = mx.distributed.init(); print('size', g.size())"
    if not LAUNCH.exists():
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    try:
        p = launch(sys.executable, "-c", probe, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"mlx.launch --backend ring could not start two ranks: {e}")
    if p.stdout.count("size 2") != 2:
        pytest.skip(f"mlx.launch --backend ring did not start two ranks: {(p.stdout + p.stderr)[-300:]}")


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
    and the chat goes on. `/quit` ends it (the launcher does not pass on the end of stdin)."""
    args = ["--cap", "0.6", "--ctx", "512", "--runtime-mib", str(RUNTIME_MIB), "--chat", "-n", "6", "-q"]
    cli("run", small_conv, *args, "--logits-out", tmp_path / "one.npz", input="hello there\nwhat next\n", check=True)
    two = run_ranked(small_conv, *args, "--logits-out", tmp_path / "two.npz",
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


def test_a_peer_that_leaves_mid_answer_stops_the_other_with_one_line(ring, small_conv, tmp_path):
    """Two ranks started by hand (no launcher to kill the survivor): rank 1 answers 2 tokens and exits while
    rank 0 still decodes; rank 0 stops with one line naming itself (the lost link, or the watchdog)."""
    port = free_port_pair()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {**os.environ, "MLX_HOSTFILE": str(hosts), "STREAMOE_RANK_TIMEOUT": "6"}
    cmd = [sys.executable, "-m", "streamoe.cli", "run", str(small_conv), "--cap", "0.3", "--ctx", "256",
           "--runtime-mib", str(RUNTIME_MIB), "--raw", "-p", PROMPT, "-q"]
    leaver = subprocess.Popen([*cmd, "-n", "2"], env={**env, "MLX_RANK": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        p = subprocess.run([*cmd, "-n", "200"], env={**env, "MLX_RANK": "0"}, capture_output=True, text=True, timeout=90)
    finally:
        leaver.kill()
        leaver.wait()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("streamoe:")]
    assert len(lines) == 1 and lines[0].startswith("streamoe: error: rank 0 of 2 on "), p.stderr
    assert "lost its peer ranks" in lines[0] or "no exchange with its peer ranks" in lines[0], lines[0]
