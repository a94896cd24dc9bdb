"""Which expert format a layer file holds, derived from its size alone (docs/FORMAT.md).

The runtime never trusts a name: `size == n_experts × stride(format)` decides, and the manifest must agree.
A format is a name for a record layout: `q4` and `q3` affine codes (4-bit as an affine export stores them, 3-bit
by the exact shift), `mxfp4` MXFP4 codes as an MXFP4 export stores them (gpt-oss).
"""

from __future__ import annotations

from pathlib import Path

from .config import ModelArgs
from .errors import StreamoeError, fail
from .record import MXFP4_SCALE, RecordLayout

FORMAT_BITS = {"q4": 4, "q3": 3, "mxfp4": 4}
FORMAT_MODE = {"q4": "affine", "q3": "affine", "mxfp4": "mxfp4"}
FORMATS = tuple(FORMAT_BITS)


def layer_file(fmt: str, layer: int) -> str:
    """Where layer `layer`'s experts of format `fmt` live, relative to the converted directory."""
    return f"experts/{fmt}/layer-{layer:02d}.bin"


def derived_formats(source: RecordLayout) -> tuple[str, ...]:
    """The formats a conversion can write from experts stored as `source`: MXFP4 codes as they are; 4-bit affine
    codes as they are (q4) and shifted to 3 bits (q3)."""
    return ("mxfp4",) if source.mode == "mxfp4" else ("q4", "q3")


def format_layout(fmt: str, source: RecordLayout) -> RecordLayout:
    """The record layout of format `fmt` for experts stored as `source` (same dims, group, dtypes)."""
    if fmt not in derived_formats(source):
        raise StreamoeError(f"expert format {fmt!r} cannot be made from {source.mode} experts "
                            f"(choose from {', '.join(derived_formats(source))})")
    return RecordLayout.make(source.hidden, source.intermediate, FORMAT_BITS[fmt], source.group_size,
                             source.scale_dtype, source.mode, source.bias_dtype)


def record_layouts(lay: RecordLayout) -> dict[str, RecordLayout]:
    """Every format a layer file beside one of `lay`'s could hold (the candidates `detect_format` decides among);
    a format whose dims do not pack is no candidate."""
    out = {}
    for fmt in derived_formats(lay):
        try:
            out[fmt] = format_layout(fmt, lay)
        except StreamoeError:
            pass
    return out


def source_layout(args: ModelArgs, scale_dtype: str = "BF16", bias_dtype: str = "BF16") -> RecordLayout:
    """The record of the checkpoint's experts as its config states them (scales and biases bf16 as mlx-community
    exports store them): what `plan` sizes from a bare config.json."""
    bits, group = args.expert_quant(0)
    mode = args.expert_mode(0)
    return RecordLayout.make(args.hidden_size, args.moe_intermediate_size, bits, group,
                             MXFP4_SCALE if mode == "mxfp4" else scale_dtype, mode,
                             bias_dtype if args.expert_bias else None)


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

