"""Issue 12: no command deletes what it did not create, concurrent writers fail clearly, the cap holds whatever
a session file declares, and every parser, fuzzed, raises nothing but StreamoeError."""

from __future__ import annotations

import io
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from bench.fuzz import PARSERS, REQUESTS, World, fuzz, target_requests
from streamoe.convert.synth import synth
from streamoe.convert.validate import validate
from streamoe.formats.errors import StreamoeError
from streamoe.formats.files import exclusive_lock, write_whole
from streamoe.formats.session import write_session
from streamoe.runtime.engine import Options, plan_for

from .conftest import cli, one_error_line, run_capped

# ---- --force replaces only a streamoe conversion, and says so


def test_force_replaces_a_conversion_and_says_so(tiny_ckpt, tiny_conv, tmp_path):
    """... only a conversion: a file in it that its manifest does not list is someone's, so it is named and
    nothing is replaced until it is moved out."""
    out = tmp_path / "out"
    shutil.copytree(tiny_conv, out)
    (out / "extra-file").write_text("not the conversion's")
    users_old = tmp_path / ".out.old"  # a name the converter once used for its own scratch: now never touched
    users_old.mkdir()
    (users_old / "mine.txt").write_text("keep")
    one_error_line(cli("convert", tiny_ckpt, out, "--force"), str(out), "(extra-file)", "never other files")
    assert (out / "extra-file").read_text() == "not the conversion's"
    (out / "extra-file").unlink()
    p = cli("convert", tiny_ckpt, out, "--force", check=True)
    assert f"replaced the earlier streamoe conversion in {out}" in p.stderr
    assert validate(out)["ok"]
    assert (users_old / "mine.txt").read_text() == "keep"
    assert sorted(x.name for x in tmp_path.iterdir()) == [".out.old", "out"]  # no lock, partial or old dir left


def test_force_never_touches_the_source_or_its_parents(tiny_ckpt, tmp_path):
    ck = tmp_path / "a" / "ck"
    shutil.copytree(tiny_ckpt, ck)
    before = sorted(p.name for p in ck.iterdir())
    for target in (ck, ck.parent, tmp_path, Path(str(ck) + "/"), ck / ".." / "ck"):
        one_error_line(cli("convert", ck, target, "--force"), "source checkpoint")
    link = tmp_path / "link"
    link.symlink_to(ck)
    one_error_line(cli("convert", ck, link, "--force"), "source checkpoint")
    assert sorted(p.name for p in ck.iterdir()) == before


def test_an_out_that_is_a_link_converts_into_its_target(tiny_ckpt, tiny_conv, tmp_path):
    """OUT a link (`~/models/q -> /mnt/nvme/q`, an empty directory, a conversion with --force, or a name not yet
    made): the conversion lands where the link points, and the link stays."""
    (tmp_path / "empty").mkdir()
    shutil.copytree(tiny_conv, tmp_path / "old")
    for target, force in (("empty", ()), ("old", ("--force",)), ("new", ())):
        link = tmp_path / f"to-{target}"
        link.symlink_to(tmp_path / target)
        p = cli("convert", tiny_ckpt, link, *force, check=True)
        assert f"(OUT is a link: converting into {tmp_path / target})" in p.stderr
        assert link.is_symlink() and (tmp_path / target / "manifest.json").is_file()
        assert validate(link)["ok"] and validate(tmp_path / target)["ok"]
    assert not [x.name for x in tmp_path.iterdir() if x.name.startswith(".")]  # no partial, old or lock left


# ---- locks: concurrent writers of one OUT or one session file


def test_convert_into_a_locked_out_fails_with_one_line(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    with exclusive_lock(tmp_path / ".out.lock", out, "this OUT"):
        one_error_line(cli("convert", tiny_ckpt, out), str(out), "another streamoe command is writing")
    assert not out.exists() and not (tmp_path / ".out.partial").exists()


def test_session_write_under_a_lock_fails_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "s.zst"
    target.write_bytes(b"old")
    with exclusive_lock(tmp_path / ".s.zst.lock", target, "this session file"):
        with pytest.raises(StreamoeError, match="another streamoe command is writing"):
            write_session(target, {}, [("a", "F32", (4,))], [bytes(16)])
    assert target.read_bytes() == b"old"


def test_a_whole_write_that_fails_names_its_target_not_its_temporary(tmp_path):
    """The temporary beside the target is the writer's own: a failure (a directory gone since the output was
    checked) names the file asked for."""
    target = tmp_path / "gone" / "talk.zst"
    with pytest.raises(StreamoeError) as e:
        write_whole(target, lambda f: f.write(b"x"), "session")
    assert str(e.value) == f"{target}: cannot write the session: no such file or directory"


def test_two_converts_race_into_one_out(tiny_ckpt, tmp_path):
    """Different sources, one OUT, started together: one wins, the other fails with one line, OUT validates and
    equals the winner's source."""
    other = tmp_path / "other"
    synth(other, size="tiny", variant="qwen3.6", text_only=False, seed=7, shard_bytes=None, dry_run=False)
    for trial in range(3):
        out = tmp_path / f"out{trial}"
        procs = [subprocess.Popen([sys.executable, "-m", "streamoe.cli", "convert", str(src), str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for src in (tiny_ckpt, other)]
        results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
        codes = sorted(r[0] for r in results)
        assert codes == [0, 2], results
        loser = next(r for r in results if r[0] == 2)
        one_error_line(subprocess.CompletedProcess([], 2, loser[1], loser[2]), str(out))
        assert "another streamoe command" in loser[2] or "already exists" in loser[2]
        winner = (tiny_ckpt, other)[[r[0] for r in results].index(0)]
        assert validate(out, source=winner, samples=2)["ok"]
        assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(f".out{trial}")) == []


# ---- the cap holds whatever a session file declares


def test_session_declaring_a_huge_header_stays_inside_the_cap(tiny_conv, tmp_path):
    bomb = tmp_path / "bomb.zst"
    buf = io.BytesIO()
    with zstandard.ZstdCompressor(level=19, write_checksum=True).stream_writer(buf, closefd=False) as w:
        w.write(struct.pack("<Q", 100 << 20))
        for _ in range(100):
            w.write(bytes(1 << 20))
    bomb.write_bytes(buf.getvalue())
    plan = plan_for(tiny_conv, Options(cap_gib=1, ctx=256, runtime_bytes=200 << 20))
    cap_gib = math.ceil((plan.fixed + (16 << 20)) / 2**30 * 1000) / 1000  # fits, with a little hot tier
    p, failcnt, peak = run_capped(["run", tiny_conv, "--cap", cap_gib, "--ctx", 256, "--runtime-mib", 200, "-p", "hi",
                                   "--load-session", bomb], cap_gib)
    one_error_line(p, str(bomb), "header length")
    assert failcnt == 0 and peak <= cap_gib * 2**30


def test_machine_sized_plans_fail_cleanly(tiny_conv):
    p = cli("plan", tiny_conv, "--cap", "1e6", "--ctx", "100000000")
    line = one_error_line(p, "this machine has", "lower --ctx or --cap")
    assert "GiB of physical memory" in line or "address space" in line


# ---- fuzzers: a few hundred examples in make test, the 20,000-example run is bench/fuzz.py

EXAMPLES = {"safetensors": 150, "index": 60, "config": 60, "manifest": 40, "blob_table": 40, "session": 150,
            "requests": 400}


@pytest.fixture(scope="module")
def world(tiny_ckpt, tiny_conv, tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("fuzz"), tiny_ckpt, tiny_conv)


@pytest.mark.parametrize("parser", PARSERS)
def test_fuzz_parser_raises_only_streamoe_errors(world, parser):
    scale = float(os.environ.get("STREAMOE_FUZZ_SCALE", "1"))
    r = fuzz(parser, world, max(1, int(EXAMPLES[parser] * scale)), seed=0)
    assert r["signatures"] == {}, r["samples"]
    assert r["examples"] >= EXAMPLES[parser] * scale * 0.9
    assert r["refused"] > 0  # the inputs really are hostile; a fuzzer that only feeds valid files tests nothing


def test_fuzzed_request_bodies_start_from_accepted_ones(world):
    """Each body the request fuzzer mutates is one the server takes as it is (rendered and made into a job), so its
    mutations are near misses that reach deep code, not bodies refused at their first field."""
    for api, body in REQUESTS:
        target_requests(world, (api, body))


# ---- a full or read-only disk: one line with the path and the numbers


@pytest.fixture
def small_fs(tmp_path):
    """A 600 KiB tmpfs (needs root and mount permission; skipped elsewhere)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_convert_onto_a_small_disk_says_the_numbers(tiny_ckpt, small_fs):
    line = one_error_line(cli("convert", tiny_ckpt, small_fs / "out"), str(small_fs), "not enough free disk space")
    assert "MiB" in line and "0.00 GiB" not in line
    assert os.listdir(small_fs) == []


def test_stats_onto_a_full_disk_names_the_file(tiny_conv, small_fs):
    """... and the telemetry and logits files there before are left as they were, with nothing half-written."""
    earlier = {"s.jsonl": b'{"step": 0}\n', "l.npz": b"earlier logits"}
    for name, data in earlier.items():
        (small_fs / name).write_bytes(data)
    fd = os.open(small_fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    p = cli("run", tiny_conv, "--cap", "1", "-p", "hi", "-n", "4", "-q", "--stats", small_fs / "s.jsonl")
    one_error_line(p, str(small_fs / "s.jsonl"), "no space left on device")
    p = cli("run", tiny_conv, "--cap", "1", "-p", "hi", "-n", "40", "-q", "--logits-out", small_fs / "l.npz")
    one_error_line(p, str(small_fs / "l.npz"), "no space left on device")
    assert {name: (small_fs / name).read_bytes() for name in earlier} == earlier
    assert sorted(os.listdir(small_fs)) == ["filler", "l.npz", "s.jsonl"]


def test_read_only_output_is_refused_before_work(tiny_ckpt, tiny_conv, small_fs):
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    one_error_line(cli("convert", tiny_ckpt, small_fs / "out"), str(small_fs / "out"), "read-only file system")
    one_error_line(cli("run", tiny_conv, "--cap", "1", "-p", "hi", "--stats", small_fs / "s.jsonl"),
                   str(small_fs / "s.jsonl"), "read-only file system")
    # synth: the read-only place named as such, not as one short of free space (a 600 KiB disk has too little)
    one_error_line(cli("synth", small_fs / "ck"), str(small_fs / "ck"), "read-only file system")


def test_a_reader_that_leaves_stdout_ends_the_run_quietly(tiny_conv):
    """`streamoe run ... | head -1`: the answer's reader goes away mid-answer; no error line, exit 141 (as a shell
    tool killed by SIGPIPE), not a 'broken pipe' bad input."""
    p = subprocess.Popen([sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--raw", "-p",
                          "import os", "-n", "200", "--temp", "0", "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err
    # the same where the output that meets the gone reader is a file named as stdout (--logits-out /dev/stdout)
    p = subprocess.Popen([sys.executable, "-m", "streamoe.cli", "run", str(tiny_conv), "--cap", "1", "--raw", "-p",
                          "import os", "-n", "40", "--temp", "0", "-q", "--logits-out", "/dev/stdout"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    while not seen.endswith(b"PK\x03\x04"):  # the answer, then the start of the logits' .npz (a zip)
        seen += p.stdout.read(1) or pytest.fail(f"no .npz on stdout: {seen!r}")
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err
