"""A prompt with images, made ready for the engine's prefill: each image encoded by the vision tower, its
`<|image_pad|>` placeholder expanded to the image's tokens, the features put at their positions, and the
3-axis M-RoPE positions (t, h, w) the language model takes for them. The engine prefills the result like any
prompt (`Engine.prefill_embedded`); it knows nothing of images.

The vision weights are read from vision.bin stage by stage as an image is encoded and dropped after, so
nothing of the encoder stays resident; the plan's vision account holds one image's encoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..formats.direct import RangeReader
from ..formats.errors import StreamoeError
from ..formats.manifest import safe_path
from .image import ImageConfig, load_image, preprocess, read_preprocessor
from .mrope import expand_image_tokens, image_positions
from .vision import VisionArgs, VisionEncoder
from .weights import read_tensor

if TYPE_CHECKING:
    from .engine import Engine


def image_config(eng: Engine) -> ImageConfig:
    """How this model's images are resized and cut into patches: its config and preprocessor file, within the
    engine's pixel budget (`--max-pixels`)."""
    return ImageConfig.from_config(eng.manifest.config, read_preprocessor(eng.root), max_pixels=eng.opts.max_pixels)


def encode_image(eng: Engine, path) -> tuple[mx.array, tuple[int, int, int]]:
    """One image file -> (features [n_tokens, H], grid (t, h, w))."""
    if not eng.opts.images:
        raise StreamoeError("images were not planned for: open the engine with images enabled (--image/--chat)")
    img = load_image(path, max_decode_pixels=eng.opts.max_decode_pixels)
    patches, grid = preprocess(img, image_config(eng))
    del img
    m = eng.manifest
    file, table = m.blob("vision")
    by_name = {t.name: t for t in table}
    with RangeReader(safe_path(eng.root, file["path"]), 16 << 20) as reader:
        enc = VisionEncoder(VisionArgs.from_config(m.config), lambda name: read_tensor(reader, by_name[name]), eng.dtype)
        feats = enc.encode(patches, grid)
        mx.eval(feats)
    eng.note_rss()
    return feats, grid


def prefill_images(eng: Engine, tokens: list[int], images: list,
                   progress: Callable[[int, int], None] | None = None) -> mx.array:
    """Prefill a prompt whose placeholders take the given images (files or bytes); the next logits. `progress(n,
    total)` as `Engine.prefill`'s, over the prompt the images expand."""
    cfg = eng.manifest.config
    pad, start = cfg["image_token_id"], cfg["vision_start_token_id"]
    merge = cfg["vision_config"]["spatial_merge_size"]
    feats = [encode_image(eng, p) for p in images]
    grids = [g for _, g in feats]
    ids = expand_image_tokens(tokens, grids, pad, merge)
    if eng.offset + len(ids) > eng.opts.ctx:
        raise eng.too_long(len(ids), images=True)
    pos, nxt = image_positions(ids, grids, pad, start, merge)
    base = eng.offset + eng.conversation.rope_delta
    emb = eng.model.embed(mx.array([ids]))
    where = mx.array(np.nonzero(np.array(ids) == pad)[0])
    emb[0, where] = mx.concatenate([f for f, _ in feats], axis=0).astype(emb.dtype)
    mx.eval(emb)
    return eng.prefill_embedded(ids, mx.array(pos + base)[:, None, :], emb, rope_next=base + nxt, progress=progress)
