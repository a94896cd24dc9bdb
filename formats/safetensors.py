"""The safetensors container: header parsing and streaming writes.

Read by the converter (byte ranges of the source checkpoint) and written by `streamoe synth`. We never
load a whole file: a header tells where every tensor lies, and callers read exactly those bytes.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .dtypes import DTYPES
from .errors import fail
from .files import check_input_file, os_fail, parse_json
from .limits import MAX_FILE_BYTES, MAX_TENSORS, check_shape, is_int, nbytes_of

MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: absolute `offset` into the file, `nbytes` long."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    file: Path

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Header:
    path: Path
    file_size: int
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]


def read_header(path: str | os.PathLike) -> Header:
    """Parse and check a safetensors header; every tensor must lie inside the file, sized as its shape says."""
    path = Path(path)
    size = check_input_file(path, "safetensors file").st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise fail(path, f"not a safetensors file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise fail(path, f"safetensors header length {n} does not fit in a {size}-byte file")
            raw = f.read(n)
    except OSError as e:
        raise os_fail(path, e, "cannot read the safetensors file") from None
    if len(raw) != n:
        raise fail(path, f"truncated: header of {n} bytes, file ends after {len(raw)}")
    return parse_header(path, raw, size)


def parse_header(path: Path, raw: bytes, size: int | None) -> Header:
    """The JSON header `raw` (the bytes after the length prefix) of a container of `size` bytes (None: unknown,
    as for a stream, whose reader then finds truncation itself). Types, bounds and overlaps are all checked:
    the safetensors format forbids overlapping tensors, and a float or bool where an integer belongs is not
    quietly converted."""
    data_start = 8 + len(raw)
    try:
        text = raw.decode("utf-8").rstrip(" \x00")
    except UnicodeDecodeError as e:
        raise fail(path, f"safetensors header does not parse (not UTF-8 at byte {e.start})") from None
    doc = parse_json(path, text)
    if not isinstance(doc, dict):
        raise fail(path, "safetensors header does not parse (not a JSON object)")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise fail(path, "safetensors __metadata__ must map names to strings")
    if len(doc) > MAX_TENSORS:
        raise fail(path, f"safetensors header lists {len(doc)} tensors (at most {MAX_TENSORS})")
    tensors = {name: _entry(path, name, t, data_start, size) for name, t in doc.items()}
    _check_overlaps(path, tensors.values())
    return Header(path, size if size is not None else -1, data_start, meta, tensors)


def _entry(path: Path, name: str, t: object, data_start: int, size: int | None) -> TensorInfo:
    """One header entry, checked: known dtype, integer shape and offsets, span = dtype x shape, inside the file."""
    if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= t.keys():
        raise fail(path, f"tensor {name!r} has a malformed header entry (needs dtype, shape, data_offsets)")
    dtype, offsets = t["dtype"], t["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(path, f"tensor {name!r} has unsupported dtype {str(dtype)[:20]!r}")
    shape = check_shape(t["shape"], path, name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise fail(path, f"tensor {name!r}: data_offsets must be two integers")
    a, b = offsets
    if not 0 <= a <= b <= MAX_FILE_BYTES:
        raise fail(path, f"tensor {name!r}: data_offsets [{a}, {b}] are not an increasing range inside a file")
    expect = nbytes_of(shape, DTYPES[dtype].itemsize)
    if b - a != expect:
        raise fail(path, f"tensor {name!r} spans {b - a} bytes but {dtype}{list(shape)} needs {expect}")
    if size is not None and data_start + b > size:
        raise fail(path, f"truncated: tensor {name!r} ends at byte {data_start + b}, file has {size}")
    return TensorInfo(name, dtype, shape, data_start + a, expect, path)


def _check_overlaps(path: Path, tensors) -> None:
    """No two non-empty tensors share a byte (the format forbids it; a copy would silently alias)."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise fail(path, f"tensors {first!r} and {second!r} overlap (bytes {start}..{end})")


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a `dtype` tensor of `shape`, exact (no int64 wrap-around)."""
    return nbytes_of(tuple(shape), DTYPES[dtype].itemsize)


def build_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """Header bytes for tensors written back to back in the given order; returns it and each tensor's relative offset.

    Keys are sorted in the JSON (as `mx.save_safetensors` writes them); the data follows in `entries` order.
    """
    offsets: dict[str, int] = {}
    doc: dict[str, object] = {}
    pos = 0
    for name, dtype, shape in entries:
        n = tensor_nbytes(dtype, shape)
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets[name] = pos
        pos += n
    if metadata is not None:
        doc["__metadata__"] = metadata
    raw = json.dumps(dict(sorted(doc.items())), separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw, offsets
