"""Image loading and preprocessing for the Qwen3.5/3.6 vision tower.

`load_image` turns a file into an RGB `PIL.Image` (or a one-line `StreamoeError` naming the file),
`preprocess` turns that image into the flat patch rows the vision encoder eats. The math follows
the reference Qwen3-VL image processor (mlx-vlm `Qwen3VLImageProcessor`, a port of transformers'
`smart_resize` + patchify) so the pixels fed to the encoder are bit-identical:

1. `smart_resize` picks a size whose sides are multiples of `patch_size * merge_size` (32) and
   whose area lies in [min_pixels, max_pixels];
2. Pillow bicubic resize of the uint8 RGB image (skipped when the size already fits);
3. x * (1/255), then (x - mean) / std, all in float32;
4. the still image is repeated `temporal_patch_size` times along a time axis and cut into
   `patch_size` squares; rows come out in 2x2-merge order (for each merged cell: its 4 patches
   row-major), each row laid out (channel, time, y, x).

streamoe's default budget is at most 640x640 pixels per image (`DEFAULT_MAX_PIXELS`), which bounds
the encoder's working memory (`runtime.vision.peak_bytes`).
"""

from __future__ import annotations

import io
import math
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..formats.errors import StreamoeError, fail
from ..formats.files import kind, read_json, read_named

DEFAULT_MAX_PIXELS = 640 * 640
# The Qwen3-VL processor's `size.shortest_edge`: small images are scaled up to about 256x256.
DEFAULT_MIN_PIXELS = 256 * 256
# Largest image we agree to decode (checked from the header, before any pixel is decoded):
# 32 Mpx covers 8K UHD (7680x4320); decoding costs ~3 bytes/px per copy.
MAX_DECODE_PIXELS = 1 << 25
MAX_ASPECT_RATIO = 200
# Largest image `run --image` reads from a pipe (`<(curl -s URL)`): held from the start, in the plan's account.
MAX_PIPED_IMAGE_BYTES = 64 << 20

SUPPORTED_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF")  # MPO: a JPEG with more pictures after the first (phones write them)
FORMATS = "PNG, JPEG, WebP or a still GIF"  # as OpenAI's and Anthropic's APIs take images
# Modes Pillow converts to RGB faithfully. Alpha is dropped (not composited), as the reference
# loader does with `convert("RGB")`. 16/32-bit integer and float modes would be clipped to 255 by
# that conversion, so they are refused rather than silently turned white.
CONVERTIBLE_MODES = ("RGB", "RGBA", "RGBX", "RGBa", "L", "LA", "La", "1", "P", "PA", "CMYK", "YCbCr")


@dataclass(frozen=True)
class ImageConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    rescale_factor: float = 1 / 255.0
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_config(
        cls,
        config: dict,
        preprocessor: dict | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        min_pixels: int | None = None,
    ) -> ImageConfig:
        """Geometry from `config.json` (`vision_config`), normalisation and the smallest size
        from `preprocessor_config.json` / `processor_config.json["image_processor"]` when given.

        `max_pixels` is streamoe's budget; a preprocessor `longest_edge` only lowers it.
        """
        vc = config.get("vision_config", config)
        pre = dict(preprocessor or {})
        pre.update(pre.pop("image_processor", None) or {})
        size = pre.get("size") or {}
        if min_pixels is None:
            min_pixels = pre.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS))
        ceiling = pre.get("max_pixels", size.get("longest_edge"))
        if ceiling is not None:
            max_pixels = min(max_pixels, int(ceiling))
        return cls(
            patch_size=int(vc.get("patch_size", 16)),
            temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            merge_size=int(vc.get("spatial_merge_size", 2)),
            min_pixels=min(int(min_pixels), int(max_pixels)),  # a budget under the floor lowers the floor
            max_pixels=int(max_pixels),
            rescale_factor=float(pre.get("rescale_factor", 1 / 255.0)),
            image_mean=tuple(float(v) for v in pre.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(v) for v in pre.get("image_std", (0.5, 0.5, 0.5))),
        )


@dataclass(frozen=True)
class PipedImage:
    """An image `run --image` read whole from a pipe (`--image <(curl -s URL)`, `--image /dev/stdin`): a pipe reads
    once, and an image is read twice (checked before the model opens, then encoded). Messages name `path`."""

    path: Path
    data: bytes


def read_image_source(path: Path) -> Path | PipedImage:
    """What `run --image PATH` hands on: a pipe's bytes, read now (`read_named`, at most `MAX_PIPED_IMAGE_BYTES`),
    or the path itself, opened where it is used."""
    try:
        piped = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        piped = False  # load_image says what is wrong with it
    return PipedImage(path, read_named(path, "image", MAX_PIPED_IMAGE_BYTES)) if piped else path


def open_image_file(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading, or a one-line error naming it: missing, unreadable, not a regular file, empty."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise fail(path, "no such file") from None
    except OSError as e:
        raise fail(path, f"cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):  # read when checked and again when encoded: a pipe reads once
        raise fail(path, f"is {kind(st.st_mode)}, not a regular file: give the image as a file"
                         + (" (save what the pipe gives first)" if stat.S_ISFIFO(st.st_mode) else ""))
    if st.st_size == 0:
        raise fail(path, "empty file (0 bytes), not an image")
    try:
        return open(path, "rb")
    except OSError as e:  # permission denied, or gone since the stat
        raise fail(path, f"cannot read ({e.strerror or e})") from None


def check_header(img: Image.Image, path: object, max_decode_pixels: int = MAX_DECODE_PIXELS) -> None:
    """What an opened image's header says, checked before any pixel is decoded: its format, size, aspect ratio
    and pixel mode (one line naming `path` for each problem)."""
    if img.format not in SUPPORTED_FORMATS:
        raise fail(path, f"unsupported image format {img.format} (give {FORMATS})")
    if img.format == "GIF" and getattr(img, "n_frames", 1) > 1:  # OpenAI's and Anthropic's APIs take still GIFs
        raise fail(path, f"an animated GIF ({img.n_frames} frames): give one picture ({FORMATS})")
    w, h = img.size
    if w <= 0 or h <= 0:
        raise fail(path, f"image has zero size ({w}x{h})")
    if w * h > max_decode_pixels:
        raise fail(path, f"image too large: {w}x{h} = {w * h:,} pixels declared, at most {max_decode_pixels:,} are decoded")
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise fail(path, f"aspect ratio of {w}x{h} exceeds {MAX_ASPECT_RATIO}:1")
    if img.mode not in CONVERTIBLE_MODES:
        raise fail(path, f"unsupported pixel mode {img.mode} (8-bit grayscale, palette, RGB(A), CMYK supported)")


def load_image(source: str | os.PathLike | PipedImage, max_decode_pixels: int = MAX_DECODE_PIXELS) -> Image.Image:
    """Decode a PNG/JPEG/WebP file (or a pipe's bytes) into an RGB image with its EXIF orientation applied."""
    if isinstance(source, PipedImage):
        path, f = source.path, io.BytesIO(source.data)
    else:
        path, f = source, open_image_file(source)
    try:
        with f, warnings.catch_warnings():
            # Our own pixel limit is below Pillow's; its bomb warning must not leak to stderr.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                img = Image.open(f)
            except UnidentifiedImageError:
                raise fail(path, f"not an image ({FORMATS} is)") from None
            check_header(img, path, max_decode_pixels)
            img.load()  # decodes now, while the file is open; a truncated file fails here
            img = ImageOps.exif_transpose(img)
            # A palette with a transparency entry makes Pillow warn on convert; alpha is dropped anyway.
            warnings.simplefilter("ignore", UserWarning)
            return img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise fail(path, f"image too large: {' '.join(str(e).split())}") from None
    except StreamoeError:
        raise
    except Exception as e:  # Pillow plugins raise OSError, SyntaxError, ValueError, struct.error, ...
        detail = " ".join(str(e).split()) or type(e).__name__
        raise fail(path, f"truncated or corrupt image ({detail})") from None


def decode_peak_bytes(max_decode_pixels: int = MAX_DECODE_PIXELS) -> int:
    """Conservative transient memory of `load_image` for the largest accepted image: Pillow keeps
    RGB/CMYK at 4 bytes a pixel, and at most two of decode / EXIF transpose / RGB copy are alive at
    once (3 counted). Measured: 8.1 bytes/px (RSS high-water mark, 30 Mpx JPEG, RGB and CMYK)."""
    return 12 * max_decode_pixels


def smart_resize(
    height: int,
    width: int,
    factor: int = 32,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible (the Qwen2-VL/Qwen3-VL rule)."""
    if height <= 0 or width <= 0:
        raise StreamoeError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise StreamoeError(f"aspect ratio of {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_bound(factor: int, min_pixels: int, max_pixels: int) -> int:
    """The most pixels `smart_resize` returns for any image (aspect ratio up to `MAX_ASPECT_RATIO`): what the
    vision account is planned for. The rule keeps to max_pixels but for its `max(factor, ...)` clamp (a side
    thinner than `factor` after scaling: the other side up to sqrt(ratio * max_pixels)) and the ceilings of its
    upscale branch (both sides rounded up past min_pixels); the reference processors give those sizes, and so
    does streamoe, so the plan holds them rather than the image being cut to the budget."""
    r = MAX_ASPECT_RATIO
    clamped = factor * math.floor(math.sqrt(r * max_pixels) / factor) * factor
    root = math.sqrt(min_pixels)
    upscaled = min_pixels + factor * root * (math.sqrt(r) + 1 / math.sqrt(r)) + factor * factor
    return max(max_pixels, clamped, math.ceil(upscaled))


def preprocessor_file(root: Path) -> Path | None:
    """The model's image preprocessor config file: `preprocessor_config.json`, else `processor_config.json`."""
    return next((Path(root) / n for n in ("preprocessor_config.json", "processor_config.json")
                 if os.path.lexists(Path(root) / n)), None)


def read_preprocessor(root: Path) -> dict | None:
    """The model's image preprocessor config (`preprocessor_file`), if it has one."""
    p = preprocessor_file(root)
    return None if p is None else read_json(p, "preprocessor config")


def preprocess(img: Image.Image, cfg: ImageConfig | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Patch rows [N, C*T*P*P] float32 and the grid (t, h, w) in patches, N = t*h*w."""
    cfg = cfg or ImageConfig()
    if img.mode != "RGB":
        img = img.convert("RGB")
    ps, tps, ms = cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size
    height, width = smart_resize(img.height, img.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (height, width) != (img.height, img.width):
        img = img.resize((width, height), resample=Image.BICUBIC)

    x = np.asarray(img).astype(np.float32)  # [H, W, C]
    x = x * np.float32(cfg.rescale_factor)
    x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)

    gh, gw = height // ps, width // ps
    c = x.shape[-1]
    # [H, W, C] -> [gh/m, m, P, gw/m, m, P, C] -> [gh/m, gw/m, m, m, C, P, P]
    x = x.reshape(gh // ms, ms, ps, gw // ms, ms, ps, c)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)
    # a still image fills all `tps` temporal slots with itself: -> [..., C, T, P, P]
    x = np.broadcast_to(x[..., None, :, :], x.shape[:5] + (tps, ps, ps))
    patches = np.ascontiguousarray(x.reshape(gh * gw, c * tps * ps * ps))
    return patches, (1, gh, gw)


def num_image_tokens(height: int, width: int, cfg: ImageConfig | None = None) -> int:
    """How many `<|image_pad|>` tokens an image of this size becomes, without touching pixels."""
    cfg = cfg or ImageConfig()
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size**2


def check_preprocessor(root: Path, config: dict) -> None:
    """The image preprocessor's config parses and holds sane numbers (the engine reads it on the first image)."""
    p = preprocessor_file(root)
    if p is not None:
        pre = read_json(p, "preprocessor config")
        try:
            cfg = ImageConfig.from_config(config, pre)
            ok = (len(cfg.image_mean) == 3 and len(cfg.image_std) == 3 and all(s != 0 for s in cfg.image_std)
                  and all(math.isfinite(v) for v in (*cfg.image_mean, *cfg.image_std, cfg.rescale_factor))
                  and 0 < cfg.min_pixels <= cfg.max_pixels and cfg.patch_size > 0 and cfg.merge_size > 0)
        except (TypeError, ValueError, AttributeError, OverflowError):
            ok = False
        if not ok:
            raise fail(p, "preprocessor values are not usable (sizes must be positive integers, "
                          "image_mean/image_std three finite numbers, std non-zero)")
