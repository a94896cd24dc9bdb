"""Page-cache-free file I/O shared by the converter and the runtime.

Reads use O_DIRECT on Linux (buffer, offset and length multiples of 4096 here, so ranges are rounded out
into an aligned scratch buffer) and F_NOCACHE on macOS; where the filesystem refuses O_DIRECT (tmpfs)
we fall back to buffered reads followed by POSIX_FADV_DONTNEED. Writes are buffered, then flushed and
dropped from the cache every few MiB, so converting 19 GiB leaves the page cache as it found it.
"""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import xxhash

from .errors import fail

ALIGN = 4096  # the O_DIRECT unit here (buffer address, file offset, length), and the expert-record stride unit
F_NOCACHE = 48  # macOS fcntl


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int = ALIGN) -> int:
    return n // a * a


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous page-aligned memory (valid as an O_DIRECT target)."""
    return mmap.mmap(-1, max(ALIGN, align_up(nbytes)))


def open_uncached(path: str | os.PathLike) -> tuple[int, bool]:
    """Open for reading without polluting the page cache; returns (fd, is_direct)."""
    if sys.platform == "darwin":
        fd = os.open(path, os.O_RDONLY)
        import fcntl

        fcntl.fcntl(fd, F_NOCACHE, 1)
        return fd, False
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT")
    except OSError:
        return os.open(path, os.O_RDONLY), False


def drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class RangeReader:
    """Reads arbitrary byte ranges of one file, bypassing the page cache, into a reusable aligned buffer."""

    def __init__(self, path: str | os.PathLike, max_bytes: int):
        self.path = Path(path)
        self.fd, self.direct = open_uncached(self.path)
        self.buf = aligned_buffer(max_bytes + 2 * ALIGN)
        self.view = memoryview(self.buf)

    def read(self, offset: int, nbytes: int) -> memoryview:
        """The bytes [offset, offset + nbytes): a view into the scratch buffer, valid until the next read."""
        if nbytes + 2 * ALIGN > len(self.buf):
            raise ValueError(f"range of {nbytes} bytes exceeds the reader's buffer")
        if self.direct:
            start = align_down(offset)
            end = align_up(offset + nbytes)
            got = os.preadv(self.fd, [self.view[: end - start]], start)
            if got < offset + nbytes - start:
                raise fail(self.path, f"truncated: short read at byte {offset} ({got - (offset - start)} of {nbytes} bytes)")
            return self.view[offset - start: offset - start + nbytes]
        got = os.preadv(self.fd, [self.view[:nbytes]], offset)
        drop_cache(self.fd, offset, nbytes)
        if got < nbytes:
            raise fail(self.path, f"truncated: short read at byte {offset} ({got} of {nbytes} bytes)")
        return self.view[:nbytes]

    def close(self) -> None:
        os.close(self.fd)
        try:
            self.view.release()
            self.buf.close()
        except BufferError:  # a caller still holds a view (e.g. in a traceback); the GC unmaps it later
            pass

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


CHECKSUM = "xxh3_128"  # integrity, not security: 10 GB/s on one core, so it never limits a conversion


def new_hash():
    return xxhash.xxh3_128()


class UncachedWriter:
    """Sequential writer that hashes what it writes and keeps written pages out of the page cache.

    With `direct=True` (expert files: page-aligned buffers, 4096-multiple lengths) it writes with O_DIRECT,
    skipping the kernel copy and writeback entirely; otherwise it writes buffered, then flushes and drops
    the pages every 32 MiB.
    """

    FLUSH = 32 << 20

    def __init__(self, path: str | os.PathLike, direct: bool = False):
        self.path = Path(path)
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            except OSError:
                self.fd = -1
        self.f = open(self.path, "wb") if self.fd < 0 else None
        self.hash = new_hash()
        self.size = 0
        self.flushed = 0

    def write(self, data: bytes | memoryview) -> None:
        if self.f is None:
            mv = memoryview(data)
            n = os.write(self.fd, mv)
            while n < len(mv):  # O_DIRECT writes are whole here, but be correct if the kernel splits
                n += os.write(self.fd, mv[n:])
        else:
            self.f.write(data)
        self.hash.update(data)
        self.size += len(data)
        if self.f is not None and self.size - self.flushed >= self.FLUSH:
            self._flush()

    def pad_to(self, offset: int) -> None:
        if offset > self.size:
            self.write(bytes(offset - self.size))

    def _flush(self) -> None:
        if self.f is not None:
            self.f.flush()
        fd = self.f.fileno() if self.f is not None else self.fd
        os.fdatasync(fd)
        drop_cache(fd, 0, 0)
        self.flushed = self.size

    def close(self) -> dict:
        """Flush, fsync, close; returns the file record (size and checksum) for the manifest."""
        self._flush()
        if self.f is not None:
            self.f.close()
        else:
            os.close(self.fd)
        return {"size": self.size, "checksum": f"{CHECKSUM}:{self.hash.hexdigest()}"}


def file_checksum(path: str | os.PathLike, chunk: int = 16 << 20) -> str:
    """Checksum of a whole file, read without growing the page cache."""
    h = new_hash()
    size = os.path.getsize(path)
    with RangeReader(path, chunk) as r:
        for off in range(0, size, chunk):
            h.update(r.read(off, min(chunk, size - off)))
    return f"{CHECKSUM}:{h.hexdigest()}"
