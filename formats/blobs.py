"""Blob files (`nonexpert.bin`, `vision.bin`): tensors copied verbatim at 4096-aligned offsets.

The table (one entry per tensor) lives in the manifest. Alignment lets the runtime map or O_DIRECT-read
any tensor on its own; bytes are never re-encoded, so a blob tensor equals its source tensor bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .direct import align_up


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
