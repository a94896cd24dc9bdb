"""Saved conversations (`--save-session`, docs/FORMAT.md): one zstandard frame holding one safetensors container.

Inside are the language model's per-layer state tensors, cut to the tokens the session holds (KV caches
in their own dtype), and under `__metadata__["streamoe_session"]` a JSON document: the format version,
what the state is only valid for (model, expert format, dtypes), the token count and whatever the
caller keeps with it (token history, chat messages, sampler state). A session is safetensors inside
zstd, so `zstd -d` and any safetensors reader open it. The frame carries zstd's checksum: a damaged
file fails as a whole when it is read to the end, not as a quietly different conversation.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import zstandard

from .errors import fail
from .safetensors import MAX_HEADER, TensorInfo, build_header, parse_header, tensor_nbytes

META_KEY = "streamoe_session"
VERSION = 1


def write_session(path: str | os.PathLike, meta: dict, entries: list[tuple[str, str, tuple[int, ...]]],
                  blocks: Iterable[bytes | memoryview], level: int = 3) -> int:
    """Write `entries` (name, safetensors dtype, shape), whose bytes `blocks` yields back to back in that
    order, with `meta`; atomically (a temporary file renamed over `path`). Returns the file size."""
    path = Path(path)
    header, _ = build_header(entries, {META_KEY: json.dumps({"version": VERSION, **meta}, separators=(",", ":"))})
    expected = sum(tensor_nbytes(d, s) for _, d, s in entries)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            with zstandard.ZstdCompressor(level=level, write_checksum=True).stream_writer(f, closefd=False) as w:
                w.write(header)
                written = 0
                for b in blocks:
                    w.write(b)
                    written += memoryview(b).nbytes
            if written != expected:
                raise AssertionError(f"session data is {written} bytes, its header says {expected}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise fail(path, f"cannot write the session ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


class SessionReader:
    """Streams a session file: `meta` and `tensors` (in data order) at open, then `read(n)` of the data.

    Every problem (not zstd, damaged, truncated, not a session, a newer version) is one `StreamoeError`
    naming the file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise fail(self.path, "session file not found") from None
        except IsADirectoryError:
            raise fail(self.path, "is a directory, expected a session file") from None
        self._stream = zstandard.ZstdDecompressor().stream_reader(self._file)
        try:
            (n,) = struct.unpack("<Q", self.read(8))
            if n > MAX_HEADER:
                raise fail(self.path, "not a streamoe session (header length out of range)")
            head = parse_header(self.path, self.read(n), None)
            doc = head.metadata.get(META_KEY)
            if doc is None:
                raise fail(self.path, "not a streamoe session (a safetensors file without session metadata)")
            self.meta = json.loads(doc)
            if self.meta.get("version") != VERSION:
                raise fail(self.path, f"session format version {self.meta.get('version')} is not supported "
                                      f"(this streamoe reads version {VERSION})")
        except BaseException:
            self.close()
            raise
        self.tensors: list[TensorInfo] = sorted(head.tensors.values(), key=lambda t: t.offset)
        pos = head.data_start
        for t in self.tensors:
            if t.offset != pos:
                self.close()
                raise fail(self.path, f"tensor {t.name!r} is not where the one before it ends")
            pos += t.nbytes

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
        except zstandard.ZstdError as e:
            raise fail(self.path, f"not a streamoe session, or damaged (zstd: {e})") from None
        return b"".join(chunks)

    def finish(self) -> None:
        """Read to the end of the frame, so its checksum is checked; nothing may follow the last tensor."""
        try:
            if self._stream.read(1):
                raise fail(self.path, "data after the last tensor")
        except zstandard.ZstdError as e:
            raise fail(self.path, f"damaged session file (zstd: {e})") from None

    def close(self) -> None:
        self._stream.close()
        self._file.close()

    def __enter__(self) -> SessionReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
