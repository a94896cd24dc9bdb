"""Files as a hostile user hands them to us: every OS problem becomes one `StreamoeError` naming the path.

Inputs are `stat`ed before they are opened, so a FIFO, a device or a directory is named as what it is and
never opened (opening a FIFO for reading blocks until a writer appears). Outputs are checked before the
work starts, so a long run never fails at its very end on a missing directory. JSON side files are read
with a size limit and a nesting limit. `exclusive_lock` keeps two commands from writing one output.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .errors import StreamoeError, fail

# Side files are parsed whole, so their size bounds the memory parsing takes (a JSON byte can become tens of
# bytes of Python objects). The real Qwen3.6 export's largest JSON is its index (~0.2 MiB), its manifest ~0.5 MiB.
MAX_JSON_BYTES = 16 << 20  # config, index, manifest, generation/preprocessor/tokenizer configs
MAX_TEXT_BYTES = 4 << 20  # chat templates (the real one is 8 KiB)
MAX_TOKENIZER_BYTES = 64 << 20  # tokenizer.json (the real one is 12 MiB)

_WORDS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EISDIR: "is a directory",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "directory not empty",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "file name too long",
    errno.EIO: "input/output error",
    errno.EFBIG: "file too large",
    errno.EMFILE: "too many open files",
    errno.ENXIO: "no such device or address",
    errno.EXDEV: "cannot rename across file systems",
}


def os_words(e: OSError) -> str:
    """A short, stable description of an OS error (no Python exception text)."""
    return _WORDS.get(e.errno) or (e.strerror or type(e).__name__).lower()


def os_fail(path: object, e: OSError, doing: str = "") -> StreamoeError:
    """The one-line error for an OSError met while `doing` something with `path` (the OS's own path wins).
    An OSError raised by code with a message and no errno keeps its message, which names its file."""
    if e.errno is None and e.args and isinstance(e.args[0], str):
        return StreamoeError(" ".join(e.args[0].split()))
    where = e.filename if isinstance(e.filename, str | bytes | os.PathLike) and e.filename else path
    if isinstance(where, bytes):
        where = os.fsdecode(where)
    return fail(where, f"{doing + ': ' if doing else ''}{os_words(e)}")


def kind(mode: int) -> str:
    """What a file is, in words, from its `st_mode`."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return "a special file"


def check_input_file(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """`path` must be an existing regular file (checked without opening it, so a FIFO never blocks us)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise fail(path, f"missing ({what} not found)") from None
    except OSError as e:
        raise os_fail(path, e, f"cannot read the {what}") from None
    if not stat.S_ISREG(st.st_mode):
        raise fail(path, f"is {kind(st.st_mode)}, expected {article(what)}")
    return st


def check_input_dir(path: str | os.PathLike, what: str) -> None:
    """`path` must be an existing directory."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise fail(path, f"missing (expected {what})") from None
    except OSError as e:
        raise os_fail(path, e, f"cannot open {what}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise fail(path, f"is {kind(st.st_mode)}, not a directory (expected {what})")


def existing_ancestor(path: Path) -> Path:
    """The nearest existing directory at or above `path` (whose free space and permissions decide a write)."""
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def article(what: str) -> str:
    """`what` after "a" or "an" ("an image", "a session file")."""
    return f"{'an' if what[:1].lower() in 'aeiou' else 'a'} {what}"


def check_writable_dir(d: Path, path: object) -> None:
    """Writing under `d` can succeed: it exists as a directory (or can be made), and is writable."""
    anchor = existing_ancestor(d)
    try:
        st = os.stat(anchor)
    except OSError as e:
        raise os_fail(path, e, f"cannot write here ({anchor})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise fail(path, f"cannot write here: {anchor} is {kind(st.st_mode)}, not a directory")
    try:
        readonly = bool(os.statvfs(anchor).f_flag & os.ST_RDONLY)
    except OSError:
        readonly = False
    if readonly:
        raise fail(path, f"cannot write here: {anchor} is on a read-only file system")
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise fail(path, f"cannot write here: permission denied on {anchor}")


def is_stream(st: os.stat_result) -> bool:
    """A pipe or a character device (a terminal, /dev/null): written as a shell redirect writes it, never replaced."""
    return stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)


def is_stdout(st: os.stat_result) -> bool:
    """Whether `st` is the file this process's standard output is."""
    try:
        out = os.fstat(1)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino)


def names_a_descriptor(path: str | os.PathLike) -> bool:
    """Whether `path` reaches its file through /proc (/dev/stdout, /dev/stderr, /dev/fd/N): an open descriptor of
    this process, whatever it points at. Written where it points, never replaced by a rename (that would replace
    the link itself: as root, /dev/stderr)."""
    p = os.path.abspath(path)
    for _ in range(40):
        p = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
        if p.startswith("/proc/"):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return False


def check_output_file(path: str | os.PathLike, what: str = "output file", stream: bool = False) -> Path:
    """Before any work: `path` can be written (its directory exists and is writable; it is not a directory,
    FIFO or device). Its parent must already exist: we do not create directories for single files. `stream`: a
    pipe or terminal the user names may take it too (`--stats >(jq -c .)`, `--stats /dev/stderr`; `write_whole`)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise os_fail(path, e, f"cannot write the {what}") from None
    if st is not None and (is_stream(st) or names_a_descriptor(path)):
        if stream:
            return path
        raise fail(path, f"is {'an open descriptor of this process' if stat.S_ISREG(st.st_mode) else kind(st.st_mode)}, "
                         f"cannot write the {what} there")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise fail(path, f"is {kind(st.st_mode)}, cannot write the {what} there")
    parent = Path(os.path.realpath(path)).parent  # where write_whole puts its temporary: beside the file a link names
    if not parent.is_dir():
        raise fail(path, f"cannot write the {what}: its directory {parent} "
                         + ("does not exist" if not os.path.lexists(parent) else "is not a directory"))
    check_writable_dir(parent, path)
    if st is not None and not os.access(path, os.W_OK):
        raise fail(path, f"cannot write the {what}: permission denied")
    tmp = temp_beside(path)  # made and removed now: a place that takes no file (/proc), a name too long for the
    try:  # temporary, fail here, not after the work
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        os.unlink(tmp)
    except OSError as e:
        raise fail(path, f"cannot write the {what} (nor its temporary {tmp.name} beside it): {os_words(e)}") from None
    return path


def temp_beside(path: str | os.PathLike) -> Path:
    """The temporary `write_whole` writes `path` through: beside the file a link names, this process's own."""
    path = Path(os.path.realpath(path))
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_whole(path: str | os.PathLike, write: Callable[[BinaryIO], None], what: str) -> None:
    """Write `path` through a temporary file beside it, renamed over it once whole and on disk: a full disk or an
    interrupted write leaves the earlier file as it was and nothing half-written. A pipe or a terminal
    (`check_output_file(stream=True)`) is written straight, opened without waiting for a reader: a FIFO nobody reads
    is one error, not a hang."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and (is_stream(st) or names_a_descriptor(path)):
        try:  # appended where it points: a redirect's file keeps what was written to it before
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | (os.O_APPEND if stat.S_ISREG(st.st_mode) else 0))
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise fail(path, f"is a pipe no one reads: cannot write the {what} there") from None
            raise os_fail(path, e, f"cannot write the {what}") from None
        try:
            os.set_blocking(fd, True)
            f = os.fdopen(fd, "wb")
        except OSError as e:
            os.close(fd)
            raise os_fail(path, e, f"cannot write the {what}") from None
        try:
            with f:
                write(f)
        except BrokenPipeError:
            if is_stdout(st):  # stdout's reader left (`| head`): the quiet end of a shell tool, as for the answer
                raise
            raise fail(path, f"cannot write the {what}: its reader closed the pipe") from None
        except OSError as e:
            raise os_fail(path, e, f"cannot write the {what}") from None
        return
    path = Path(os.path.realpath(path))  # through a symlink: the file it names is replaced, the link kept
    tmp = temp_beside(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is not None and os.fsdecode(e.filename) == str(tmp):  # the temporary is ours: the target is named
            e.filename = None
        raise os_fail(path, e, f"cannot write the {what}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(path: object, raw: bytes | str) -> object:
    """JSON from bytes read out of `path`; NaN/Infinity refused, too deep nesting is one error."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, parse_constant=_no_constants)
    except UnicodeDecodeError as e:
        raise fail(path, f"is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise fail(path, "does not parse as JSON (nested too deeply)") from None
    except ValueError as e:
        raise fail(path, f"does not parse as JSON ({str(e).splitlines()[0][:200]})") from None


def read_bytes(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """A whole small side file, refused past `limit` bytes (checked before reading)."""
    st = check_input_file(path, what)
    if st.st_size > limit:
        raise fail(path, f"{st.st_size} bytes is too large for {article(what)} (at most {limit})")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise os_fail(path, e, f"cannot read the {what}") from None
    if len(data) > limit:
        raise fail(path, f"too large for {article(what)} (at most {limit} bytes)")
    return data


def read_named(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """A file the user names on the command line, read whole: a regular file (`read_bytes`), or a pipe they point us
    at, as `cat` reads one (`-f <(git diff)`, `-f /dev/stdin` under a pipe), up to `limit` bytes. The pipe is opened
    without waiting for a writer, so a FIFO nobody writes reads as nothing and is refused at once instead of blocking;
    devices and sockets are refused as in `check_input_file`."""
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISFIFO(st.st_mode):
        return read_bytes(path, what, limit)
    chunks, n = [], 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            os.set_blocking(fd, True)
            while n <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - n))):
                chunks.append(chunk)
                n += len(chunk)
        finally:
            os.close(fd)
    except OSError as e:
        raise os_fail(path, e, f"cannot read the {what}") from None
    data = b"".join(chunks)
    if len(data) > limit:
        raise fail(path, f"gave more than {limit} bytes: too large for {article(what)}")
    if not data:
        raise fail(path, f"is a pipe that gave nothing (no one writes to it?), expected {article(what)}")
    return data


def read_json(path: str | os.PathLike, what: str = "JSON file", limit: int = MAX_JSON_BYTES,
              named: bool = False) -> dict:
    """A JSON object from a file (`named`: or a pipe, `read_named`): missing, special, too large, not JSON, not an
    object are one error each."""
    doc = parse_json(path, (read_named if named else read_bytes)(path, what, limit))
    if not isinstance(doc, dict):
        raise fail(path, f"is not a JSON object ({type(doc).__name__} at the top level)")
    return doc


def read_text(path: str | os.PathLike, what: str = "text file", limit: int = MAX_TEXT_BYTES, named: bool = False) -> str:
    data = (read_named if named else read_bytes)(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(path, f"is not UTF-8 text (byte {e.start})") from None


@contextmanager
def exclusive_lock(lock_path: Path, target: object, what: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock_path` (created if needed) for the block, or fail at once with one
    line: another streamoe command is writing `target`. The lock file is removed on the way out; a waiter that
    opened it before that notices its inode is gone and fails instead of proceeding on a stale lock."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise os_fail(lock_path, e, f"cannot create the lock for {what}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise fail(target, f"another streamoe command is writing {what} here now (lock {lock_path}); "
                               "wait for it to finish") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise fail(target, f"another streamoe command just finished writing {what} here; run again")
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass
        try:
            yield
        finally:
            try:
                os.unlink(lock_path)
            except OSError:
                pass
    finally:
        os.close(fd)
