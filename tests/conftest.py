"""Shared fixtures: checkpoints written by `streamoe synth` and converted once per session."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from streamoe.convert.convert import convert
from streamoe.convert.synth import synth

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "models" / "tiny"  # the embedded default: the trained tiny Qwen3.5-MoE, as mlx-community exports

# Measured float32 agreement with mlx-lm on the synthetic checkpoints: max |Δlogit| 2e-7 (tiny) and
# 2e-6 (small) over 12-step runs. The bound leaves a 10x margin and stays far below any real top-2 gap.
LOGIT_ATOL = 2e-5
RUNTIME = 64 << 20  # a fixed interpreter allowance so plans are comparable inside one test process

# the tiny faithful vision config (the one `streamoe synth --size tiny` writes), verbatim
TINY_VISION_CONFIG = {
    "deepstack_visual_indexes": [], "depth": 2, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 64, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 128,
    "model_type": "qwen3_5_moe", "num_heads": 2, "num_position_embeddings": 64,
    "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
}


def cli(*args: str, check: bool = False, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess (exit codes, stderr, no traceback)."""
    p = subprocess.run([sys.executable, "-m", "streamoe.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"streamoe {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr}")
    return p


def one_error_line(p: subprocess.CompletedProcess, *needles: str) -> str:
    """The failure contract for bad input: non-zero exit, no traceback, one line on stderr naming the problem."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    assert "internal error" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith(("convert:", "synth:"))]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def cgroup_dir() -> Path | None:
    """This process's own cgroup-v1 memory group, if we may create children in it."""
    import os

    try:
        own = next(ln.split(":")[2].strip() for ln in open("/proc/self/cgroup") if ln.split(":")[1] == "memory")
    except (OSError, StopIteration):
        return None
    base = Path("/sys/fs/cgroup/memory") / own.lstrip("/")
    return base if (base / "memory.limit_in_bytes").exists() and os.access(base, os.W_OK) else None


@contextlib.contextmanager
def capped_cgroup(cap_gib: float, name: str = "test"):
    """A fresh child cgroup whose memory limit is the cap (page cache included), removed afterwards; yields
    (path, read) where read() gives (failcnt, max_usage_in_bytes). Skips where cgroups are unavailable."""
    import os

    base = cgroup_dir()
    if base is None:
        pytest.skip("no writable cgroup-v1 memory controller here (needs /sys/fs/cgroup/memory and root)")
    cg = base / f"streamoe_{name}_{os.getpid()}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(int(cap_gib * 2**30)))
        yield cg, lambda: (int((cg / "memory.failcnt").read_text()), int((cg / "memory.max_usage_in_bytes").read_text()))
    finally:
        try:
            (cg / "memory.force_empty").write_text("1")
        except OSError:
            pass
        cg.rmdir()


def run_capped(args: list[str], cap_gib: float) -> tuple[subprocess.CompletedProcess, int, int]:
    """`streamoe ARGS` inside a cgroup capped at `cap_gib`; returns (process, failcnt, max_usage_in_bytes)."""
    import shlex

    with capped_cgroup(cap_gib) as (cg, read):
        cmd = f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} -m streamoe.cli {shlex.join(map(str, args))}"
        p = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=300)
        return (p, *read())


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    synth(out, size="tiny", variant="qwen3.6", text_only=False, seed=0, shard_bytes=300_000, dry_run=False)
    return out


@pytest.fixture(scope="session")
def tiny_conv(tiny_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "tiny"
    convert(tiny_ckpt, out, formats=["q4", "q3"], progress=False)
    return out


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "small"
    synth(out, size="small", variant="qwen3.6", text_only=False, seed=1, shard_bytes=None, dry_run=False)
    return out


@pytest.fixture(scope="session")
def small_conv(small_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "small"
    convert(small_ckpt, out, formats=["q4", "q3"], progress=False)
    return out
