"""formats/: codecs bit-exact against MLX, the exact 4→3 shift, record layout, layout detection, manifest."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamoe.formats import quant
from streamoe.formats.dtypes import itemsize
from streamoe.formats.errors import StreamoeError
from streamoe.formats.layout import detect_format, record_layouts
from streamoe.formats.manifest import check_doc, load_manifest
from streamoe.formats.record import RecordLayout


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_codecs_match_mlx_quantize(bits):
    w = mx.random.normal((16, 256), key=mx.random.key(bits))
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    codes = quant.unpack(np.array(q), bits)
    assert codes.max() < 2**bits
    assert np.array_equal(quant.pack(codes, bits), np.array(q))  # bit-exact round trip
    ours = quant.dequantize(np.array(q), np.array(s), np.array(b), bits, 64)
    assert np.array_equal(ours, np.array(mx.dequantize(q, s, b, group_size=64, bits=bits)))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_shift_words_equals_unpack_shift_pack(seed, rows):
    w = np.random.default_rng(seed).integers(0, 2**32, size=(rows, 16), dtype=np.uint32)
    assert np.array_equal(quant.shift_words_4_to_3(w), quant.pack(quant.unpack(w, 4) >> 1, 3))


def test_bf16_roundtrip_and_rounding():
    x = np.array([1.0, -2.5, 3.14159, 1e-8, 65504.0, -0.0], np.float32)
    b = quant.f32_to_bf16(x)
    assert np.array_equal(b, np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16)))
    want = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    assert np.array_equal(quant.bf16_to_f32(b), want)
    out = np.full(len(x), np.nan, np.float32)  # written in place, every bit of it
    assert quant.bf16_to_f32(b, out=out) is out and np.array_equal(out.view(np.uint32), want.view(np.uint32))


def test_shift_moves_every_weight_by_half_a_scale_including_negative_scales():
    rng = np.random.default_rng(0)
    w4 = rng.integers(0, 2**32, size=(32, 8), dtype=np.uint32)  # 64 codes per row = one group
    s4 = quant.bf16_to_f32(quant.f32_to_bf16(rng.normal(0, 0.01, (32, 1)).astype(np.float32)))
    s4[::3] *= -1  # negative scales occur in real exports
    b4 = quant.bf16_to_f32(quant.f32_to_bf16(rng.normal(0, 0.1, (32, 1)).astype(np.float32)))
    w3, s3, b3 = quant.shift_4_to_3(w4, s4, b4)
    d4 = quant.dequantize(w4, s4, b4, 4, 64).astype(np.float64)
    d3 = quant.unpack(w3, 3) * s3.astype(np.float64) + b3.astype(np.float64)
    assert np.array_equal(s3, 2 * s4)
    np.testing.assert_allclose(np.abs(d3 - d4), np.broadcast_to(np.abs(s4) / 2, d4.shape), rtol=0, atol=1e-9)
    # stored bf16: s3 exact, b3 correctly rounded (within half a bf16 ulp of the exact value)
    s3b, b3b = quant.shift_scales_bf16(quant.f32_to_bf16(s4), quant.f32_to_bf16(b4))
    assert np.array_equal(quant.bf16_to_f32(s3b), s3)
    assert np.array_equal(b3b, np.array(mx.array(b3).astype(mx.bfloat16).view(mx.uint16)))  # MLX's own rounding
    assert np.all(np.abs(quant.bf16_to_f32(b3b) - b3) <= np.abs(b3) * 2.0**-8)  # half a bf16 ulp at most


def test_quantized_matmul_bits3_runs_on_packed_bytes():
    rng = np.random.default_rng(1)
    w4 = rng.integers(0, 2**32, size=(48, 128 // 8), dtype=np.uint32)
    s4 = rng.normal(0, 0.02, (48, 2)).astype(np.float32)
    b4 = rng.normal(0, 0.05, (48, 2)).astype(np.float32)
    w3 = quant.shift_words_4_to_3(w4)
    s3, b3 = 2 * s4, b4 + 0.5 * s4
    x = rng.normal(size=(3, 128)).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), mx.array(w3), mx.array(s3), mx.array(b3), transpose=True, group_size=64, bits=3)
    ref = x @ quant.dequantize(w3, s3, b3, 3, 64).T
    np.testing.assert_allclose(np.array(y), ref, rtol=1e-5, atol=1e-5)


def test_record_layout_of_the_real_model():
    q4 = RecordLayout.make(2048, 512, 4, 64)
    q3 = RecordLayout.make(2048, 512, 3, 64)
    assert q4.raw_size == q4.stride == 1_769_472
    assert q3.raw_size == q3.stride == 1_376_256
    assert [(s.proj, s.part) for s in q4.segments][:3] == [("gate_proj", "weight"), ("gate_proj", "scales"), ("gate_proj", "biases")]
    assert q4.segment("down_proj", "weight").shape == (2048, 64)
    assert q4.segment("up_proj", "weight").offset == 589_824


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.sampled_from([2, 3, 4, 8]), st.sampled_from([32, 64, 128]),
       st.sampled_from(["BF16", "F16", "F32"]))
def test_record_segments_are_aligned_to_their_item_size(h, i, bits, group, scale_dtype):
    """The runtime views every segment of a record in place (`SlotPools.fill`): each offset is a multiple of
    its dtype's size, whatever the dims (odd scale counts pair up with the biases that follow)."""
    lay = RecordLayout.make(h * group, i * group, bits, group, scale_dtype)
    assert all(s.offset % itemsize(s.dtype) == 0 for s in lay.segments)
    assert lay.segments[-1].offset + lay.segments[-1].nbytes == lay.raw_size <= lay.stride


def test_layout_detection_from_size(tmp_path):
    lays = record_layouts(RecordLayout.make(2048, 512, 4, 64))
    assert detect_format("f", 256 * 1_769_472, 256, lays) == "q4"
    assert detect_format("f", 256 * 1_376_256, 256, lays) == "q3"
    with pytest.raises(StreamoeError, match=r"f: size 12345 bytes matches no expert layout; expected 452984832 \(q4\), 352321536 \(q3\)"):
        detect_format("f", 12345, 256, lays)


def test_manifest_schema_and_paths(tiny_conv, tmp_path):
    m = load_manifest(tiny_conv)
    doc = json.loads((tiny_conv / "manifest.json").read_text())
    check_doc(doc, tmp_path)
    bad = json.loads(json.dumps(doc))
    bad["blobs"]["nonexpert"]["file"]["path"] = "../escape.bin"
    with pytest.raises(StreamoeError, match="schema"):
        check_doc(bad, tmp_path / "manifest.json")
    bad = json.loads(json.dumps(doc))
    bad["experts"]["q4"]["stride"] += 4096
    with pytest.raises(StreamoeError, match="disagree"):
        check_doc(bad, tmp_path / "manifest.json")
    assert set(m.expert_formats()) == {"q4", "q3"}
