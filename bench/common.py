"""Shared by the bench scripts: machine facts, page-cache accounting, raw O_DIRECT speed, scratch directories,
JSON results, random routed experts of a family's shapes."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np

from streamoe.formats.direct import align_down, aligned_buffer, drop_cache, open_uncached
from streamoe.formats.manifest import schema
from streamoe.formats.record import ExpertWeights

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def scratch_dir(path: Path | None) -> Iterator[Path]:
    """The work directory of a bench: `path` if given (created, kept, reused by later runs), else a fresh
    temporary directory removed at the end."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="streamoe-bench-") as tmp:
        yield Path(tmp)


def meminfo(key: str) -> int:
    for ln in open("/proc/meminfo"):
        if ln.startswith(key + ":"):
            return int(ln.split()[1]) * 1024
    return 0


def status_kib(pid: int, key: str) -> int:
    """A field of /proc/PID/status in KiB (VmRSS, VmHWM, ...); 0 where it is missing."""
    for ln in open(f"/proc/{pid}/status"):
        if ln.startswith(key + ":"):
            return int(ln.split()[1])
    return 0


def drop_files(paths) -> None:
    """Evict files from the page cache (clean pages), so the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd) if os.access(p, os.W_OK) else None
        drop_cache(fd)
        os.close(fd)


def _uncached_chunks(paths, limit_bytes: int, chunk: int):
    """Sequential O_DIRECT reads over the files (up to limit_bytes) into one aligned buffer; yields each
    chunk's view, valid until the next."""
    buf = aligned_buffer(chunk)
    view = memoryview(buf)
    total = 0
    try:
        for p in paths:
            fd, _ = open_uncached(p)
            size = align_down(os.path.getsize(p))
            off = 0
            while off < size and total < limit_bytes:
                n = os.preadv(fd, [view[: min(chunk, size - off)]], off)
                yield view[:n]
                off += n
                total += n
            os.close(fd)
            if total >= limit_bytes:
                break
    finally:
        view.release()
        buf.close()


def raw_read_gbs(paths, limit_bytes: int = 8 << 30, chunk: int = 16 << 20) -> float:
    """Sequential O_DIRECT read speed over the files (up to limit_bytes), GB/s."""
    total, t0 = 0, time.perf_counter()
    for piece in _uncached_chunks(paths, limit_bytes, chunk):
        total += len(piece)
        piece.release()
    return total / (time.perf_counter() - t0) / 1e9


def raw_copy_gbs(paths, dst: Path, limit_bytes: int = 4 << 30, chunk: int = 16 << 20) -> float:
    """O_DIRECT read + O_DIRECT write of the same bytes (a plain copy), GB/s of bytes copied: the ceiling for
    a converter, which must write about as much as it reads through the same disk."""
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    total, t0 = 0, time.perf_counter()
    try:
        for piece in _uncached_chunks(paths, limit_bytes, chunk):
            os.write(out, piece)
            total += len(piece)
            piece.release()
        os.fsync(out)
    finally:
        os.close(out)
        os.unlink(dst)
    return total / (time.perf_counter() - t0) / 1e9


def machine() -> dict:
    """What ran a bench: cores, memory, MLX's device, the card (NVIDIA's name for it; "none" without one) and the
    code (STREAMOE_CODE where the tree has no git, as on the GPU machines; else git's short commit, "-dirty" with changes)."""
    try:
        import mlx.core as mx

        device = str(mx.default_device())
    except Exception:  # noqa: BLE001 - the bench still records what it can
        device = "unknown"
    return {"cpus": os.cpu_count() or 0, "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "device": device, "card": _ask(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or "none",
            "code": os.environ.get("STREAMOE_CODE") or _ask(["git", "-C", str(RESULTS.parent), "describe", "--always", "--dirty", "--abbrev=7"])
            or "unknown"}


def _ask(cmd: list[str]) -> str:
    """The first line a command prints, or "" where it is missing or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def write_result(name: str, bench: str, results: list[dict], out: Path | None = None) -> Path:
    """bench/results/NAME.json (or `out`), checked against schemas/bench.schema.json."""
    doc = {"bench": bench, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]), "results": results}
    jsonschema.validate(doc, schema("bench.schema.json"))
    if out is None:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return out


def expert_shape_arguments(ap) -> None:
    """--experts, --hidden, --inter, --top-k: a family's routed-expert shapes (default Qwen3.6's)."""
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)


def random_experts(n: int, hidden: int, inter: int, bits: int = 4, dtype=mx.float32, mode: str = "affine",
                   bias: bool | None = None, key: int = 1) -> ExpertWeights:
    """n stacked random experts (weights of unit-scale outputs), evaluated: affine (group 64, scales and biases at
    `dtype`) or MXFP4 (group 32, uint8 scales); `bias`: per-expert projection biases at `dtype`, as gpt-oss's (None:
    with MXFP4). For the benches and the tests alike."""
    group = 32 if mode == "mxfp4" else 64
    bias = mode == "mxfp4" if bias is None else bias

    def proj(out_dim, in_dim, k):
        w = mx.random.normal((n, out_dim, in_dim), key=mx.random.key(k)) / in_dim**0.5
        q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
        b = (mx.random.normal((n, out_dim), key=mx.random.key(k + 50)) * 0.1).astype(dtype) if bias else None
        return (q[0], q[1].astype(dtype), q[2].astype(dtype), b) if mode == "affine" else (q[0], q[1], None, b)

    (gw, gs, gb, gbias), (uw, us, ub, ubias), (dw, ds, db, dbias) = (
        proj(inter, hidden, key), proj(inter, hidden, key + 1), proj(hidden, inter, key + 2))
    w = ExpertWeights(gw, gs, gb, uw, us, ub, dw, ds, db, gbias, ubias, dbias)
    mx.eval([a for a in w if a is not None])
    return w


def random_picks(tokens: int, n_experts: int, k: int, rng: np.random.Generator) -> mx.array:
    """k distinct experts for each of `tokens` tokens, [tokens, k] uint32."""
    return mx.array(np.stack([rng.permutation(n_experts)[:k] for _ in range(tokens)]), dtype=mx.uint32)
