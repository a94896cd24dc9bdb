"""Saved conversations (`--save-session`, docs/FORMAT.md): one zstandard frame holding one safetensors container.

Inside are the language model's per-layer state tensors, cut to the tokens the session holds (KV caches
as stored: floats, or a quantized cache's uint32 codes with their scales and biases), and under `__metadata__["streamoe_session"]` a JSON document: the format version,
what the state is only valid for (model, expert format, dtypes), the token count and whatever the
caller keeps with it (token history, chat messages, sampler state). A session is safetensors inside
zstd, so `zstd -d` and any safetensors reader open it. The frame carries zstd's checksum: a damaged
file fails as a whole when it is read to the end, not as a quietly different conversation.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path

import zstandard

from .errors import fail
from .files import check_input_file, exclusive_lock, os_fail, parse_json, write_whole
from .limits import json_type
from .safetensors import TensorInfo, build_header, parse_header, tensor_nbytes

META_KEY = "streamoe_session"
VERSION = 1
# The container header (tensor table + metadata with the token history and messages) is read whole and
# parsed, outside the plan's other accounts: bounded here so a tiny file cannot make us allocate 100 MiB.
# A full 262,144-token context's history is about 3 MiB of JSON; the runtime allowance has room for this.
MAX_SESSION_HEADER = 8 << 20


def header_limit(ctx: int) -> int:
    """The largest session header an engine planned for `ctx` tokens accepts: 1 MiB plus 32 bytes a token
    (token ids and message text as JSON), so its parse stays inside the plan's runtime allowance."""
    return min(MAX_SESSION_HEADER, (1 << 20) + 32 * ctx)
META_TYPES = {"version": int, "tokens": int, "rope_delta": int, "model": str, "experts": str, "dtype": str, "kv": str,
              "extra": dict}
JSON_KINDS = {int: "an integer", str: "a string", dict: "an object"}  # as the file's JSON says them


def session_lock(path: str | os.PathLike) -> AbstractContextManager[None]:
    """The lock of one session file (`.NAME.lock` beside it): a command that will save `path` holds it from its
    start, so a second one saving the same file fails at once, before it computes an answer it could not save."""
    path = Path(path)
    return exclusive_lock(path.with_name(f".{path.name}.lock"), path, "this session file")


def write_session(path: str | os.PathLike, meta: dict, entries: list[tuple[str, str, tuple[int, ...]]],
                  blocks: Iterable[bytes | memoryview], level: int = 3, locked: bool = False) -> int:
    """Write `entries` (name, safetensors dtype, shape), whose bytes `blocks` yields back to back in that
    order, with `meta`; atomically (a temporary file renamed over `path`), under its `session_lock` (`locked`:
    the caller holds it). Returns the file size."""
    with contextlib.nullcontext() if locked else session_lock(path):
        return _write_locked(Path(path), meta, entries, blocks, level)


def _write_locked(path: Path, meta: dict, entries: list[tuple[str, str, tuple[int, ...]]],
                  blocks: Iterable[bytes | memoryview], level: int) -> int:
    header, _ = build_header(entries, {META_KEY: json.dumps({"version": VERSION, **meta}, separators=(",", ":"))})
    expected = sum(tensor_nbytes(d, s) for _, d, s in entries)

    def write(f) -> None:
        # the frame declares its content size, so a reader can check it against the header before trusting it
        # closed only when whole: an interrupted frame is abandoned (the temporary file goes), never finished
        w = zstandard.ZstdCompressor(level=level, write_checksum=True).stream_writer(
            f, size=len(header) + expected, closefd=False)
        w.write(header)
        written = 0
        for b in blocks:
            w.write(b)
            written += memoryview(b).nbytes
        if written != expected:
            raise AssertionError(f"session data is {written} bytes, its header says {expected}")
        w.close()

    write_whole(path, write, "session")
    return path.stat().st_size


def check_meta(path: Path, doc: str | None) -> dict:
    """The session metadata, parsed and typed: a session is only trusted as far as these checks go."""
    if doc is None:
        raise fail(path, "not a streamoe session (a safetensors file without session metadata)")
    meta = parse_json(path, doc)
    if not isinstance(meta, dict):
        raise fail(path, "session metadata is not a JSON object")
    if meta.get("version") != VERSION or isinstance(meta.get("version"), bool):
        given = meta.get("version")
        said = f"{given}" if type(given) is int else f"{json.dumps(given)[:20]} (not an integer)"
        raise fail(path, f"session format version {said} is not supported (this streamoe reads version {VERSION})")
    for key, typ in META_TYPES.items():
        v = meta.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            got = f"got {json_type(v)}" if key in meta else "it is missing"
            raise fail(path, f"session metadata {key!r} must be {JSON_KINDS[typ]}, {got}")
    if not 0 <= meta["tokens"] <= 1 << 31 or abs(meta["rope_delta"]) > 1 << 31:
        raise fail(path, "session metadata tokens/rope_delta out of range")
    return meta


class SessionReader:
    """Streams a session file: `meta` and `tensors` (in data order) at open, then `read(n)` of the data.

    Every problem (not zstd, damaged, truncated, not a session, a newer version) is one `StreamoeError`
    naming the file."""

    def __init__(self, path: str | os.PathLike, max_header: int = MAX_SESSION_HEADER):
        self.path = Path(path)
        size = check_input_file(self.path, "session file").st_size  # never open a FIFO: it would block
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise os_fail(self.path, e, "cannot read the session file") from None
        self._stream = zstandard.ZstdDecompressor().stream_reader(self._file)
        try:
            declared = self._declared_size(size)
            (n,) = struct.unpack("<Q", self.read(8))
            if declared is not None and 8 + n > declared:
                raise fail(self.path, f"not a streamoe session (header length {n} exceeds the frame's {declared} bytes)")
            if n > max_header:
                raise fail(self.path, f"session header length {n} is over the {max_header}-byte limit (a larger --ctx "
                                      "allows more; a real session's header is a few bytes per token)")
            head = parse_header(self.path, self.read(n), None)
            self.meta = check_meta(self.path, head.metadata.get(META_KEY))
            self.tensors: list[TensorInfo] = sorted(head.tensors.values(), key=lambda t: t.offset)
            pos = head.data_start
            for t in self.tensors:
                if t.offset != pos:
                    raise fail(self.path, f"tensor {t.name!r} is not where the one before it ends")
                pos += t.nbytes
            if declared is not None and pos != declared:
                raise fail(self.path, f"the frame holds {declared} bytes but its tensors need {pos}")
        except BaseException:
            self.close()
            raise

    def _declared_size(self, size: int) -> int | None:
        """The zstd frame's declared content size (None when the writer did not record it)."""
        if size == 0:
            raise fail(self.path, "is empty: not a streamoe session")
        try:
            with open(self.path, "rb") as f:
                params = zstandard.get_frame_parameters(f.read(min(size, 18)))
        except (zstandard.ZstdError, OSError):
            raise fail(self.path, "not a streamoe session (not a zstandard frame)") from None
        if not params.has_checksum:  # streamoe always writes one: without it damage would go unnoticed
            raise fail(self.path, "not a streamoe session (its zstandard frame carries no checksum)")
        cs = params.content_size
        return None if cs in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) else cs

    def read(self, n: int) -> bytes:
        """Exactly `n` more bytes of the container."""
        chunks, got = [], 0
        try:
            while got < n:
                b = self._stream.read(n - got)
                if not b:
                    raise fail(self.path, "truncated session file")
                chunks.append(b)
                got += len(b)
        except zstandard.ZstdError:
            raise fail(self.path, "not a streamoe session, or damaged (the zstd data does not decode)") from None
        except OSError as e:
            raise os_fail(self.path, e, "cannot read the session file") from None
        return b"".join(chunks)

    def finish(self) -> None:
        """Read to the end of the frame, so its checksum is checked; nothing may follow the last tensor."""
        try:
            if self._stream.read(1):
                raise fail(self.path, "data after the last tensor")
        except zstandard.ZstdError:
            raise fail(self.path, "damaged session file (the zstd data or its checksum does not match)") from None

    def close(self) -> None:
        self._stream.close()
        self._file.close()

    def __enter__(self) -> SessionReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
