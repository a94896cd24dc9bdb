"""The memory cgroup the cap tests run in: v1 and v2 file handling. The v2 files are parsed here from a fake
group directory written in the kernel's formats (this machine has v1; a v2 kernel runs the last test for real)."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import (
    capped_cgroup,
    memory_events,
    own_cgroup,
    v2_enable_memory,
    v2_memory_enabled,
    v2_prepare,
    v2_read,
)

V1_SELF = "9:name=systemd:/\n4:memory:/process_api/0b73ae4a\n1:cpu:/\n0::/\n"
V2_SELF = "0::/user.slice/user-1000.slice/session-3.scope\n"
EVENTS = "low 0\nhigh 0\nmax 17\noom 1\noom_kill 1\noom_group_kill 0\n"


def test_own_group_from_proc_self_cgroup():
    assert own_cgroup(V1_SELF) == "/process_api/0b73ae4a"
    assert own_cgroup(V2_SELF) == "/user.slice/user-1000.slice/session-3.scope"
    assert own_cgroup("12:cpu,memory:/a\n0::/b\n") == "/a"  # co-mounted v1 controllers
    assert own_cgroup("1:name=systemd:/\n") is None


def test_v2_events_and_peak_from_the_kernel_formats(tmp_path):
    assert memory_events(EVENTS) == {"low": 0, "high": 0, "max": 17, "oom": 1, "oom_kill": 1, "oom_group_kill": 0}
    (tmp_path / "memory.events").write_text(EVENTS)
    (tmp_path / "memory.peak").write_text("268435456\n")
    assert v2_read(tmp_path) == (19, 268435456)
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    (tmp_path / "memory.peak").unlink()  # kernels before 5.19
    assert v2_read(tmp_path) == (0, None)


def test_v2_memory_is_enabled_for_children_once_and_from_a_leaf(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    (tmp_path / "cgroup.procs").write_text("1\n4242\n")
    assert not v2_memory_enabled(tmp_path)
    v2_enable_memory(tmp_path)
    leaf = tmp_path / f"streamoe_leaf_{os.getpid()}"
    assert (leaf / "cgroup.procs").read_text() == str(os.getpid())  # out of the group before enabling
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory"
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory\n")  # what the kernel then shows
    assert v2_memory_enabled(tmp_path) and v2_prepare(tmp_path)


def test_v2_prepare_refuses_a_group_without_the_memory_controller(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "cgroup.procs").write_text("1\n")
    assert not v2_prepare(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cgroup.controllers", "cgroup.procs", "cgroup.subtree_control"]


def test_the_capped_group_counts_a_breach_and_the_peak():
    """On the real kernel (v1 or v2, whichever this machine has): 32 MiB fits a 256 MiB cap with no limit hit;
    touching 512 MiB in it is refused (killed) and counted."""
    grab = "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096])"
    with capped_cgroup(0.25, "probe") as (cg, read):
        def run(mib):
            return subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" -c "$1" {mib}', sys.executable,
                                   grab], capture_output=True, timeout=60)
        assert run(32).returncode == 0
        hits, peak = read()
        assert hits == 0 and 32 << 20 < peak <= 256 << 20, (hits, peak)
        assert run(512).returncode != 0
        hits, peak = read()
        assert hits > 0 and peak <= 256 << 20, (hits, peak)
