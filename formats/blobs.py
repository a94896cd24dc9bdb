"""Blob files (`nonexpert.bin`, `vision.bin`): tensors copied verbatim at 4096-aligned offsets.

The table (one entry per tensor) lives in the manifest. Alignment lets the runtime map or O_DIRECT-read
any tensor on its own; bytes are never re-encoded, so a blob tensor equals its source tensor bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .direct import align_up
from .limits import MAX_FILE_BYTES, MAX_TENSORS, nbytes_of


@dataclass(frozen=True)
class BlobTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    bits: int | None = None  # quantized tensors (weight, scales, biases of one module) carry bits and group
    group_size: int | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> BlobTensor:
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"], d.get("bits"), d.get("group_size"))


def plan_blob(entries: list[tuple[str, str, tuple[int, ...], int, int | None, int | None]]) -> tuple[list[BlobTensor], int]:
    """Place (name, dtype, shape, nbytes, bits, group) entries at 4096-aligned offsets; returns table and file size."""
    table: list[BlobTensor] = []
    pos = 0
    for name, dtype, shape, nbytes, bits, group in entries:
        table.append(BlobTensor(name, dtype, tuple(shape), pos, nbytes, bits, group))
        pos = align_up(pos + nbytes)
    return table, pos


def table_problem(table: list[BlobTensor], file_size: int) -> str | None:
    """What is wrong with a blob table for a file of `file_size` bytes, or None: every tensor's byte count is
    its dtype x shape, lies inside the file, and no two tensors share a byte or a name. `run` reads exactly
    these ranges, so `validate` and the open check both rely on this."""
    from .safetensors import DTYPES

    if len(table) > MAX_TENSORS:
        return f"blob table lists {len(table)} tensors (at most {MAX_TENSORS})"
    names: set[str] = set()
    for t in table:
        if t.name in names:
            return f"tensor {t.name!r} is listed twice"
        names.add(t.name)
        want = nbytes_of(t.shape, DTYPES[t.dtype].itemsize)
        if t.nbytes != want:
            return f"tensor {t.name!r} has {t.nbytes} bytes but {t.dtype}{list(t.shape)} needs {want}"
        if t.offset + t.nbytes > min(file_size, MAX_FILE_BYTES):
            return f"tensor {t.name!r} ends at byte {t.offset + t.nbytes}, past the end of the {file_size}-byte file"
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in table if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            return f"tensors {a!r} and {b!r} overlap (bytes {start}..{end})"
    return None
