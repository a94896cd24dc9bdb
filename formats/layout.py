"""Which expert format a layer file holds, derived from its size alone (docs/FORMAT.md).

The runtime never trusts a name: `size == n_experts × stride(bits)` decides, and the manifest must agree.
"""

from __future__ import annotations

from pathlib import Path

from .errors import fail
from .record import RecordLayout

FORMAT_BITS = {"q4": 4, "q3": 3}


def layer_file(fmt: str, layer: int) -> str:
    """Where layer `layer`'s experts of format `fmt` live, relative to the converted directory."""
    return f"experts/{fmt}/layer-{layer:02d}.bin"


def record_layouts(hidden: int, intermediate: int, group_size: int, scale_dtype: str = "BF16") -> dict[str, RecordLayout]:
    return {fmt: RecordLayout.make(hidden, intermediate, bits, group_size, scale_dtype) for fmt, bits in FORMAT_BITS.items()}


def detect_format(path: str | Path, size: int, n_experts: int, layouts: dict[str, RecordLayout], claimed: str | None = None) -> str:
    """The format whose `n_experts × stride` equals `size`, or an error naming the file and the sizes expected.

    Tiny models can have equal q4 and q3 strides (both round up to the same 4096 multiple); then the size
    cannot decide and `claimed` (the manifest's word) breaks the tie, provided the size allows it.
    """
    matches = [fmt for fmt, lay in layouts.items() if size == n_experts * lay.stride]
    if claimed in matches:
        return claimed
    if matches:
        return matches[0]
    expected = ", ".join(f"{n_experts * lay.stride} ({fmt})" for fmt, lay in layouts.items())
    raise fail(path, f"size {size} bytes matches no expert layout; expected {expected}")
