"""Shared fixtures: checkpoints written by `streamoe synth` and converted once per session."""

from __future__ import annotations

import contextlib
import functools
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


def write_hf_checkpoint(out: Path, weights: dict, config: dict, tokenizer_from: Path) -> Path:
    """A checkpoint in a model's own Hugging Face form (what mlx-lm's converter reads): `weights` in one
    safetensors file, `config`, and the tokenizer files of the synthetic checkpoint `tokenizer_from`."""
    import json
    import shutil

    import mlx.core as mx

    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tokenizer_from / f, out / f)
    return out


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


CGROUP_ROOT = Path("/sys/fs/cgroup")


def own_cgroup(proc_self_cgroup: str, controller: str = "memory") -> str | None:
    """This process's group path from /proc/self/cgroup text: the v1 line naming `controller`
    (`4:memory:/a/b`), else the unified v2 line (`0::/a/b`)."""
    v2 = None
    for ln in proc_self_cgroup.splitlines():
        parts = ln.split(":", 2)
        if len(parts) != 3:
            continue
        if controller in parts[1].split(","):
            return parts[2].strip()
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2].strip()
    return v2


def memory_events(text: str) -> dict[str, int]:
    """A v2 `memory.events` file (`low 0`, `high 0`, `max 12`, `oom 0`, `oom_kill 0`, ...) as counts."""
    out = {}
    for ln in text.splitlines():
        key, _, value = ln.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def v2_read(cg: Path) -> tuple[int, int | None]:
    """(limit hits, peak bytes or None) of a v2 group: the hits are memory.events' `max` (usage reached
    memory.max and was reclaimed or refused: v1's failcnt) plus `oom` and `oom_kill`; the peak is memory.peak
    (kernel >= 5.19; None where it is absent)."""
    events = memory_events((cg / "memory.events").read_text())
    hits = sum(events.get(k, 0) for k in ("max", "oom", "oom_kill"))
    peak = cg / "memory.peak"
    return hits, int(peak.read_text().split()[0]) if peak.exists() else None


def v2_memory_enabled(base: Path) -> bool:
    """Whether children of `base` get the memory controller (`memory` listed in its cgroup.subtree_control)."""
    try:
        return "memory" in (base / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def v2_prepare(base: Path) -> bool:
    """Make `base` able to hold a capped child: enable `memory` for its children. The no-internal-process rule
    forbids that while `base` holds processes, so this process first moves into a leaf child of its own
    (`base/streamoe_leaf_PID`, kept for the process's lifetime). False where this cgroup does not allow it."""
    if v2_memory_enabled(base):
        return True
    try:
        if "memory" not in (base / "cgroup.controllers").read_text().split():
            return False  # not delegated to this group: nothing to enable
        v2_enable_memory(base)
    except OSError:
        return False  # other processes share the group, or no permission
    return v2_memory_enabled(base)


def v2_enable_memory(base: Path) -> None:
    """The writes of `v2_prepare`: this process into a leaf when `base` holds processes, then `+memory`."""
    import os

    if (base / "cgroup.procs").read_text().split():
        leaf = base / f"streamoe_leaf_{os.getpid()}"
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
    (base / "cgroup.subtree_control").write_text("+memory")


@functools.cache  # once per process: preparing v2 moves this process into a leaf, which must happen once
def cgroup_dir() -> tuple[str, Path] | None:
    """("v1" or "v2", this process's memory cgroup) where we may create capped children in it, else None.

    v1: /sys/fs/cgroup/memory/GROUP with memory.limit_in_bytes. v2 (the unified hierarchy: /sys/fs/cgroup/
    cgroup.controllers exists): the group where `memory` is (or can be) enabled for children; as root, or as a
    user inside a delegated scope (`systemd-run --user --scope -p Delegate=yes make test`). STREAMOE_CGROUP names
    a v2 group to use instead, where this process's own group cannot hold capped children (a container's group
    shared with other processes; bench/h200.sh `cgroups` makes one at the hierarchy's root)."""
    import os

    named = os.environ.get("STREAMOE_CGROUP")
    if named:
        base = Path(named)
        return ("v2", base) if os.access(base, os.W_OK) and v2_prepare(base) else None
    try:
        text = open("/proc/self/cgroup").read()
    except OSError:
        return None
    own = own_cgroup(text)
    if own is None:
        return None
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        base = CGROUP_ROOT / own.lstrip("/")
        if os.access(base, os.W_OK) and v2_prepare(base):
            return "v2", base
        return None
    base = CGROUP_ROOT / "memory" / own.lstrip("/")
    return ("v1", base) if (base / "memory.limit_in_bytes").exists() and os.access(base, os.W_OK) else None


class CurrentSampler:
    """The peak of memory.current sampled every 5 ms on a thread: the stand-in for memory.peak on kernels
    before 5.19, which misses spikes shorter than the interval (the warning says so)."""

    def __init__(self, cg: Path):
        import threading

        self.cg, self.peak, self.stop = cg, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.005):
            try:
                self.peak = max(self.peak, int((self.cg / "memory.current").read_text()))
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


@contextlib.contextmanager
def capped_cgroup(cap_gib: float, name: str = "test"):
    """A fresh child cgroup whose memory limit is the cap (page cache included; no swap on v2), removed
    afterwards; yields (path, read) where read() gives (limit hits, peak bytes): v1's memory.failcnt and
    memory.max_usage_in_bytes, v2's memory.events `max`+`oom`+`oom_kill` and memory.peak. Skips where no
    writable memory cgroup is available (needs root or a delegated group)."""
    import os
    import warnings

    found = cgroup_dir()
    if found is None:
        pytest.skip("no writable memory cgroup here (v1 /sys/fs/cgroup/memory, or v2 with memory delegated)")
    version, base = found
    cg = base / f"streamoe_{name}_{os.getpid()}"
    cg.mkdir()
    sampler = None
    try:
        if version == "v1":
            (cg / "memory.limit_in_bytes").write_text(str(int(cap_gib * 2**30)))
            read = lambda: (int((cg / "memory.failcnt").read_text()), int((cg / "memory.max_usage_in_bytes").read_text()))  # noqa: E731
        else:
            (cg / "memory.max").write_text(str(int(cap_gib * 2**30)))
            if (cg / "memory.swap.max").exists():
                (cg / "memory.swap.max").write_text("0")  # a cap that swap could absorb is no cap
            if not (cg / "memory.peak").exists():
                warnings.warn(f"{cg}/memory.peak is absent (kernel < 5.19): the peak is memory.current sampled "
                              "every 5 ms, which can miss a shorter spike", stacklevel=3)
                sampler = CurrentSampler(cg)

            def read() -> tuple[int, int]:
                hits, peak = v2_read(cg)
                return hits, peak if peak is not None else sampler.peak
        yield cg, read
    finally:
        if sampler is not None:
            sampler.close()
        if version == "v1":
            try:
                (cg / "memory.force_empty").write_text("1")
            except OSError:
                pass
        cg.rmdir()


def run_capped(args: list[str], cap_gib: float) -> tuple[subprocess.CompletedProcess, int, int]:
    """`streamoe ARGS` inside a cgroup capped at `cap_gib`; returns (process, limit hits, peak bytes)."""
    import shlex

    with capped_cgroup(cap_gib) as (cg, read):
        cmd = f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} -m streamoe.cli {shlex.join(map(str, args))}"
        p = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=300)
        return (p, *read())


@pytest.fixture(scope="session")
def trained_conv(tmp_path_factory) -> Path:
    """The trained default model (models/tiny) converted once (q4), for every module that serves it."""
    out = tmp_path_factory.mktemp("trained") / "tiny"
    convert(TINY_MODEL, out, formats=["q4"], progress=False)
    return out


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
