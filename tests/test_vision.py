"""The image path: preprocessing, the streamed vision encoder and M-RoPE positions, each checked
against mlx-vlm (the oracle) on a tiny Qwen3.5-MoE vision tower built here from mlx-vlm's own
model class; plus bad image files.

Measured on the MLX CPU backend: preprocessing and positions are bit-identical to mlx-vlm; the
encoder output differs from mlx-vlm's float32 vision tower by at most ~1.3e-6 of the output's
largest magnitude (the Conv3d patch embedding vs our matmul sums in a different order; the
position table, rotary tables, blocks and merger agree to the bit), asserted below at 1e-5.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from streamoe.formats.errors import StreamoeError
from streamoe.runtime import mrope
from streamoe.runtime.image import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    MAX_DECODE_PIXELS,
    ImageConfig,
    decode_peak_bytes,
    load_image,
    num_image_tokens,
    preprocess,
    resized_bound,
    smart_resize,
)
from streamoe.runtime.vision import VisionArgs, VisionEncoder, max_patches, peak_bytes

from .conftest import TINY_VISION_CONFIG

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 521, 522, 524, 525
ENCODER_REL_TOL = 1e-5
# small floor so the 64x64 and 96x128 cases keep their own size
SMALL = ImageConfig(min_pixels=32 * 32)


def noise_image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], -1)
    noisy = smooth + rng.integers(-40, 40, (h, w, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tower():
    """A tiny vision tower: bf16 weights under their export names, and mlx-vlm's model holding
    the same values in float32."""
    pytest.importorskip("mlx_vlm")
    from mlx.utils import tree_flatten
    from mlx_vlm.models.qwen3_5_moe.config import VisionConfig
    from mlx_vlm.models.qwen3_5_moe.vision import VisionModel

    ref = VisionModel(VisionConfig.from_dict(TINY_VISION_CONFIG))
    rng = np.random.default_rng(1234)
    stored = {}
    for name, p in tree_flatten(ref.parameters()):
        values = 0.02 * rng.standard_normal(p.shape)
        if "norm" in name and name.endswith(".weight"):
            values += 1.0
        stored[f"vision_tower.{name}"] = mx.array(values.astype(np.float32)).astype(mx.bfloat16)
    assert stored["vision_tower.patch_embed.proj.weight"].shape == (64, 2, 16, 16, 3)  # MLX layout
    ref.load_weights([(k.removeprefix("vision_tower."), v.astype(mx.float32)) for k, v in stored.items()])
    mx.eval(ref.parameters())
    return SimpleNamespace(ref=ref, stored=stored, args=VisionArgs.from_config({"vision_config": TINY_VISION_CONFIG}))


@pytest.fixture(scope="module")
def processor():
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    def make(cfg: ImageConfig):
        return Qwen3VLImageProcessor(
            patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
            merge_size=cfg.merge_size, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
        )

    return make


# -- preprocessing -------------------------------------------------------------------------------


def test_smart_resize_matches_reference():
    """The reference's sizes for every image, extreme aspect ratios and small budgets included (where its
    `max(factor, ...)` clamp and upscale ceilings pass max_pixels), each within the bound the plan holds."""
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import _smart_resize_image

    rng = np.random.default_rng(7)
    sizes = [(1, 1), (1, 200), (200, 1), (31, 33), (48, 48), (640, 640), (641, 639), (1080, 1920),
             (4000, 3000), (10, 1999), (40, 8000), (8000, 40), (97, 4477), (2885, 154)]
    sizes += [tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(300)]
    sizes += [(int(h), int(h * r)) for h, r in zip(rng.integers(1, 60, 100), rng.uniform(20, 200, 100), strict=True)]
    budgets = [(DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS), (56 * 56, 14 * 14 * 4 * 1280), (32 * 32, 320 * 320),
               (4096, 65536), (4096, 20000), (16, 96 * 96), (1024, 4096)]
    for budget in budgets:
        bound = resized_bound(32, *budget)
        for h, w in sizes:
            if max(h, w) / min(h, w) > 200:
                continue
            ours = smart_resize(h, w, 32, *budget)
            assert ours == _smart_resize_image(h, w, 32, *budget), (h, w, budget)
            assert ours[0] % 32 == 0 and ours[1] % 32 == 0 and ours[0] * ours[1] <= bound, (h, w, budget)
    h, w = smart_resize(100, 10000, 32, 16, 96 * 96)
    assert (h, w) == _smart_resize_image(100, 10000, 32, 16, 96 * 96) and h * w > 96 * 96  # the reference's clamp
    assert resized_bound(32, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS) == DEFAULT_MAX_PIXELS  # the defaults never pass it
    with pytest.raises(StreamoeError, match="aspect"):
        smart_resize(1, 201)


@pytest.mark.parametrize(
    "size,cfg",
    [((64, 64), SMALL), ((96, 128), SMALL), ((160, 64), SMALL), ((77, 100), SMALL), ((37, 300), SMALL),
     ((1000, 700), ImageConfig()), ((64, 64), ImageConfig()), ((480, 640), ImageConfig(max_pixels=320 * 320))],
)
def test_preprocess_matches_processor(processor, size, cfg):
    img = noise_image(*size, seed=size[0] * 7 + size[1])
    patches, grid = preprocess(img, cfg)
    ref = processor(cfg)(img)
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    assert patches.dtype == np.float32 and patches.shape == ref["pixel_values"].shape
    assert np.array_equal(patches, ref["pixel_values"])  # bit for bit
    assert num_image_tokens(*size, cfg) == grid[0] * grid[1] * grid[2] // 4


def test_load_and_preprocess_match_reference_loader(processor, tmp_path):
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.utils import load_image as ref_load_image

    path = tmp_path / "photo.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    noise_image(300, 500).save(path, quality=90, exif=exif)
    ours, ref = load_image(path), ref_load_image(str(path))
    assert ours.mode == "RGB" and ours.size == ref.size == (300, 500)  # orientation applied
    assert np.array_equal(np.asarray(ours), np.asarray(ref))
    patches, grid = preprocess(ours)
    expected = processor(ImageConfig())(ref)
    assert np.array_equal(patches, expected["pixel_values"])
    assert grid == tuple(expected["image_grid_thw"][0].tolist())


def test_a_still_gif_is_read_as_the_reference_loader_reads_it(tmp_path):
    """A still GIF (OpenAI's and Anthropic's APIs take them) is read as mlx-vlm's loader reads it: its one picture in
    RGB, the same pixels as the same picture in a PNG."""
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.utils import load_image as ref_load_image

    picture = noise_image(30, 50).convert("P")
    picture.save(tmp_path / "a.gif")
    picture.save(tmp_path / "a.png")
    ours, ref, png = load_image(tmp_path / "a.gif"), ref_load_image(str(tmp_path / "a.gif")), load_image(tmp_path / "a.png")
    assert np.array_equal(np.asarray(ours), np.asarray(ref.convert("RGB"))) and np.array_equal(np.asarray(ours), np.asarray(png))


def test_decode_budget_is_stated():
    assert decode_peak_bytes() == 12 * MAX_DECODE_PIXELS < 400 << 20


def test_image_config_from_checkpoint_files():
    cfg = ImageConfig.from_config(
        {"vision_config": TINY_VISION_CONFIG},
        {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "image_mean": [0.5] * 3},
    )
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (16, 2, 2)
    assert (cfg.min_pixels, cfg.max_pixels) == (65536, 640 * 640)  # streamoe's budget wins
    small = ImageConfig.from_config({"vision_config": TINY_VISION_CONFIG}, None, max_pixels=128 * 128)
    assert small.max_pixels == 128 * 128 and small.min_pixels <= small.max_pixels


# -- encoder -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(64, 64), (96, 128), (160, 64), (320, 224), (37, 300)])
def test_encoder_matches_mlx_vlm(tower, size):
    patches, grid = preprocess(noise_image(*size, seed=size[1]), SMALL)
    out = VisionEncoder(tower.args, tower.stored.__getitem__).encode(patches, grid)
    expected, _ = tower.ref(mx.array(patches), mx.array([list(grid)]))
    assert out.dtype == mx.float32
    assert out.shape == expected.shape == (grid[1] * grid[2] // 4, TINY_VISION_CONFIG["out_hidden_size"])
    out, expected = np.array(out), np.array(expected)
    scale = np.abs(expected).max()
    assert scale > 1e-2  # the features are not degenerate
    assert np.abs(out - expected).max() <= ENCODER_REL_TOL * scale


def test_encoder_streams_one_stage_at_a_time(tower):
    calls = []

    def load(name):
        calls.append(name)
        return tower.stored[name]

    patches, grid = preprocess(noise_image(64, 96), SMALL)
    VisionEncoder(tower.args, load).encode(patches, grid)
    assert sorted(calls) == sorted(tower.stored)  # every tensor exactly once
    stage = [n.split(".")[2] if ".blocks." in n else n.split(".")[1] for n in calls]
    order = ["patch_embed", "pos_embed", "0", "1", "merger"]
    firsts = [stage.index(s) for s in order]
    lasts = [len(stage) - 1 - stage[::-1].index(s) for s in order]
    assert firsts == sorted(firsts)
    assert all(lasts[i] < firsts[i + 2] for i in range(len(order) - 2))  # blocks never overlap


def test_encoder_rejects_bad_shapes(tower):
    bad = dict(tower.stored)
    bad["vision_tower.blocks.1.attn.qkv.weight"] = mx.zeros((10, 64), dtype=mx.bfloat16)
    patches, grid = preprocess(noise_image(64, 64), SMALL)
    with pytest.raises(StreamoeError, match=r"vision_tower\.blocks\.1\.attn\.qkv\.weight"):
        VisionEncoder(tower.args, bad.__getitem__).encode(patches, grid)
    with pytest.raises(StreamoeError, match="patches"):
        VisionEncoder(tower.args, tower.stored.__getitem__).encode(patches[:-1], grid)


def test_peak_bytes_bounds_measured_peak(tower):
    max_pixels = 320 * 224
    patches, grid = preprocess(noise_image(320, 224), ImageConfig(min_pixels=32 * 32, max_pixels=max_pixels))
    assert grid[1] * grid[2] <= max_patches(tower.args, max_pixels)
    enc = VisionEncoder(tower.args, tower.stored.__getitem__)
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(enc.encode(patches, grid))
    measured = mx.get_peak_memory() - before
    assert measured <= peak_bytes(tower.args, max_pixels)
    # Real Qwen3.6 tower at the 640x640 default: measured 154 MiB on the CPU backend.
    full = VisionArgs.from_config({
        "depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304,
        "out_hidden_size": 2048, "num_position_embeddings": 2304,
    })
    assert 154 << 20 < peak_bytes(full, 640 * 640) < 320 << 20


def test_vision_args_from_config():
    args = VisionArgs.from_config({"vision_config": TINY_VISION_CONFIG})
    assert (args.head_dim, args.grid_side, args.patch_dim, args.merged_size) == (32, 8, 1536, 256)
    with pytest.raises(StreamoeError, match="depth"):
        VisionArgs.from_config({k: v for k, v in TINY_VISION_CONFIG.items() if k != "depth"})
    with pytest.raises(StreamoeError, match="square"):
        VisionArgs.from_config({**TINY_VISION_CONFIG, "num_position_embeddings": 60})


# -- M-RoPE positions ----------------------------------------------------------------------------


def reference_rope_index(ids: list[int], grids: list[tuple[int, int, int]]):
    pytest.importorskip("mlx_vlm")
    from mlx_vlm.models.qwen3_5.language import LanguageModel

    fake = SimpleNamespace(config=SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
    ))
    pos, delta = LanguageModel.get_rope_index(fake, mx.array([ids]), mx.array(grids) if grids else None)
    return np.array(pos), int(np.array(delta).reshape(-1)[0])


def prompt(n_images: int) -> list[int]:
    ids = [513, 30, 31, 32]
    for i in range(n_images):
        ids += [VISION_START, IMAGE_PAD, VISION_END, 40 + i]
    return ids + [33, 514, 513, 34, 10]


@pytest.mark.parametrize("grids", [[], [(1, 4, 6)], [(1, 4, 6), (1, 8, 4)], [(1, 20, 14), (1, 2, 2), (2, 4, 4)]])
def test_positions_match_get_rope_index(grids):
    ids = mrope.expand_image_tokens(prompt(len(grids)), grids, IMAGE_PAD, 2)
    assert ids.count(IMAGE_PAD) == sum(t * h * w // 4 for t, h, w in grids)
    pos, next_offset = mrope.image_positions(ids, grids, IMAGE_PAD, VISION_START, 2)
    assert pos.dtype == np.int32 and pos.shape == (3, len(ids))
    if grids:
        ref_pos, ref_delta = reference_rope_index(ids, grids)
        assert np.array_equal(pos, ref_pos.reshape(3, -1))
        assert next_offset - len(ids) == ref_delta
    else:
        assert np.array_equal(pos, np.broadcast_to(np.arange(len(ids)), (3, len(ids))))
        assert next_offset == len(ids)
    assert next_offset == pos.max() + 1


def test_positions_reject_unexpanded_or_mismatched_prompts():
    with pytest.raises(StreamoeError, match="expand"):
        mrope.image_positions(prompt(1), [(1, 4, 4)], IMAGE_PAD, VISION_START, 2)
    with pytest.raises(StreamoeError, match="2 image"):
        mrope.image_positions(prompt(2), [(1, 2, 2)], IMAGE_PAD, VISION_START, 2)
    with pytest.raises(StreamoeError, match="placeholders"):
        mrope.expand_image_tokens(prompt(1), [(1, 2, 2), (1, 2, 2)], IMAGE_PAD, 2)


# -- bad image files -----------------------------------------------------------------------------


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def with_declared_size(png: bytes, width: int, height: int) -> bytes:
    """The same PNG with its IHDR claiming another size (CRC fixed, pixel data untouched)."""
    ihdr = bytearray(png[12:29])  # chunk type + 13 data bytes
    ihdr[4:12] = struct.pack(">II", width, height)
    return png[:12] + bytes(ihdr) + struct.pack(">I", zlib.crc32(bytes(ihdr))) + png[33:]


def check_fails(path, *words):
    with pytest.raises(StreamoeError) as info:
        load_image(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    for word in words:
        assert word in message
    return message


def test_bad_images_fail_with_the_path(tmp_path):
    (tmp_path / "text.png").write_text("hello, I am not a picture\n")
    check_fails(tmp_path / "text.png", "not an image")

    (tmp_path / "empty.jpg").write_bytes(b"")
    check_fails(tmp_path / "empty.jpg", "empty")

    check_fails(tmp_path / "missing.png", "no such file")
    check_fails(tmp_path, "is a directory, not a regular file")
    os.mkfifo(tmp_path / "pipe.png")  # never opened: a FIFO nobody writes would block the read
    check_fails(tmp_path / "pipe.png", "is a FIFO (named pipe), not a regular file", "give the image as a file")

    whole = png_bytes(noise_image(128, 128))
    (tmp_path / "truncated.png").write_bytes(whole[: len(whole) // 2])
    check_fails(tmp_path / "truncated.png", "truncated")

    (tmp_path / "bomb.png").write_bytes(with_declared_size(whole, 10_000, 10_000))
    check_fails(tmp_path / "bomb.png", "too large", "10000x10000")

    Image.new("L", (300, 1)).save(tmp_path / "strip.png")
    check_fails(tmp_path / "strip.png", "aspect ratio")

    frames = [Image.new("RGB", (16, 16), c) for c in ((200, 0, 0), (0, 200, 0))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    check_fails(tmp_path / "anim.gif", "an animated GIF (2 frames)")
    Image.new("RGB", (16, 16)).save(tmp_path / "a.bmp")
    check_fails(tmp_path / "a.bmp", "unsupported image format BMP")

    Image.fromarray(np.full((20, 30), 40000, np.uint16)).save(tmp_path / "deep.png")
    check_fails(tmp_path / "deep.png", "unsupported pixel mode")


def test_declared_size_is_checked_before_decoding(tmp_path, monkeypatch):
    # refused from the header alone: no pixel buffer is ever allocated
    def no_decode(self):
        raise AssertionError("pixels decoded")

    from PIL import ImageFile

    whole = png_bytes(noise_image(8, 8))
    monkeypatch.setattr(Image.Image, "load", no_decode)
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    for side in (6_000, 100_000):  # under and over Pillow's own bomb limit
        path = tmp_path / f"bomb{side}.png"
        path.write_bytes(with_declared_size(whole, side, side))
        check_fails(path, "too large")


@pytest.mark.parametrize("mode,fmt", [("CMYK", "JPEG"), ("P", "PNG"), ("RGBA", "PNG"), ("L", "JPEG"),
                                      ("LA", "PNG"), ("1", "PNG"), ("RGB", "WEBP"), ("P", "GIF")])
def test_other_modes_are_converted_to_rgb(tmp_path, mode, fmt):
    source = noise_image(24, 40).convert(mode)
    if mode == "P":
        source.info["transparency"] = 0
    path = tmp_path / f"img.{fmt.lower()}"
    source.save(path, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    img = load_image(path)
    assert img.mode == "RGB" and img.size == (40, 24)
    assert np.array_equal(np.asarray(img), np.asarray(Image.open(path).convert("RGB")))
