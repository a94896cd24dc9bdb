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

import numpy as np

from .dtypes import DTYPES
from .errors import fail

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
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise fail(path, f"not a safetensors file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise fail(path, f"safetensors header length {n} does not fit in a {size}-byte file")
            raw = f.read(n)
    except FileNotFoundError:
        raise fail(path, "file not found") from None
    except IsADirectoryError:
        raise fail(path, "is a directory, expected a safetensors file") from None
    return parse_header(path, raw, size)


def parse_header(path: Path, raw: bytes, size: int | None) -> Header:
    """The JSON header `raw` (the bytes after the length prefix) of a container of `size` bytes (None: unknown,
    as for a stream, whose reader then finds truncation itself)."""
    data_start = 8 + len(raw)
    try:
        doc = json.loads(raw.decode("utf-8").rstrip(" \x00"))
        if not isinstance(doc, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise fail(path, f"safetensors header does not parse ({e})") from None
    meta = doc.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, t in doc.items():
        try:
            dtype, shape, (a, b) = t["dtype"], tuple(int(d) for d in t["shape"]), t["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise fail(path, f"tensor {name!r} has a malformed header entry") from None
        if dtype not in DTYPES:
            raise fail(path, f"tensor {name!r} has unsupported dtype {dtype!r}")
        expect = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if b - a != expect or a < 0:
            raise fail(path, f"tensor {name!r} spans {b - a} bytes but {dtype}{list(shape)} needs {expect}")
        if size is not None and data_start + b > size:
            raise fail(path, f"truncated: tensor {name!r} ends at byte {data_start + b}, file has {size}")
        tensors[name] = TensorInfo(name, dtype, shape, data_start + a, expect, path)
    return Header(path, size if size is not None else -1, data_start, meta, tensors)


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize


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
