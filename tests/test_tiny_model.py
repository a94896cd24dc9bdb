"""The embedded default (models/tiny, trained): greedy output identical to the peers, at caps that hold a
fraction of its experts, for text (mlx-lm) and image questions (mlx-vlm)."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image, ImageDraw

from streamoe.convert.convert import convert
from streamoe.runtime.engine import Engine, Options, plan_for
from streamoe.runtime.image import load_image, preprocess
from streamoe.runtime.image_prompt import image_config
from streamoe.runtime.mrope import expand_image_tokens
from streamoe.runtime.sampling import Sampler

from .conftest import RUNTIME, TINY_MODEL

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "conv"
    convert(TINY_MODEL, out, formats=["q4", "q3"], progress=False)
    return out


def cap_for(conv: Path, fraction: float | None, **kw) -> float:
    base = plan_for(conv, Options(cap_gib=64, ctx=1024, prefill_chunk=16, runtime_bytes=RUNTIME, **kw))
    if fraction is None:
        return 64.0
    return (base.fixed + int(fraction * base.n_layers * base.n_experts) * base.slot_bytes + 1) / 2**30


def ours(conv: Path, ids: list[int], n: int, fraction: float | None, **kw) -> tuple[list[int], bytes]:
    eng = Engine(conv, Options(cap_gib=cap_for(conv, fraction, **kw), ctx=1024, prefill_chunk=16, runtime_bytes=RUNTIME, **kw))
    toks, logits = [], []
    for t, lg in eng.generate(ids, n, Sampler()):
        toks.append(t)
        logits.append(lg)
    eng.close()
    return toks, np.stack(logits).tobytes()


def mlx_lm_greedy(ids: list[int], n: int, stop: set[int]) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(TINY_MODEL)
    model.set_dtype(mx.float32)
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        if t in stop:
            break
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_greedy_identical_to_mlx_lm_at_a_quarter_of_the_experts(tiny, prompt):
    eng = Engine(tiny, Options(cap_gib=8, ctx=1024, runtime_bytes=RUNTIME))
    ids, stop = eng.text.encode(prompt), eng.text.stop_ids
    eng.close()
    ref = mlx_lm_greedy(ids, 40, stop)
    got, _ = ours(tiny, ids, 40, 0.25)
    assert len(ref) >= 32 and got == ref


def test_logits_identical_across_caps_on_the_trained_model(tiny):
    eng = Engine(tiny, Options(cap_gib=8, ctx=1024, runtime_bytes=RUNTIME))
    ids = eng.text.encode(PROMPTS[2])
    eng.close()
    runs = [ours(tiny, ids, 24, f, tier=t, prefetch_width=w) for f, t, w in
            [(0.0, "freq", 6), (0.1, "lru", 0), (0.3, "freq", 6), (None, "freq", 6)]]
    assert all(r == runs[0] for r in runs)


def star_scene(path: Path) -> Path:
    """A green five-pointed star in the top-left quadrant, drawn the way the training images are."""
    im = Image.new("RGB", (160, 128), (255, 255, 255))
    radius = [18 if i % 2 == 0 else 18 * 0.45 for i in range(10)]
    angle = [-math.pi / 2 + i * math.pi / 5 for i in range(10)]
    ImageDraw.Draw(im).polygon([(48 + r * math.cos(a), 40 + r * math.sin(a)) for r, a in zip(radius, angle, strict=True)],
                               fill=(30, 150, 40))
    im.save(path)
    return path


@pytest.mark.parametrize(("fraction", "question", "answer"), [(0.1, "What shape is in the image?", "star"),
                                                              (0.5, "What colour is the shape?", "green")])
def test_image_question_identical_to_mlx_vlm_and_right(tiny, tmp_path, fraction, question, answer):
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model

    ref = load_model(TINY_MODEL)
    ref.set_dtype(mx.float32)
    pic = star_scene(tmp_path / "star.png")
    eng = Engine(tiny, Options(cap_gib=cap_for(tiny, fraction, images=True), ctx=1024, prefill_chunk=16,
                               runtime_bytes=RUNTIME, images=True))
    cfg = eng.manifest.config
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    ids = eng.text.encode(eng.text.chat_prompt(msgs, think=False))
    patches, grid = preprocess(load_image(pic), image_config(eng))
    full = mx.array([expand_image_tokens(ids, [grid], cfg["image_token_id"], cfg["vision_config"]["spatial_merge_size"])])
    feat = ref.get_input_embeddings(full, mx.array(patches), image_grid_thw=mx.array([grid]))
    cache = make_prompt_cache(ref.language_model)
    lr = ref.language_model(full, inputs_embeds=feat.inputs_embeds, cache=cache, position_ids=feat.position_ids,
                            rope_deltas=feat.rope_deltas).logits[0, -1]
    theirs = []
    for _ in range(16):
        t = int(mx.argmax(lr).item())
        if t in eng.text.stop_ids:
            break
        theirs.append(t)
        lr = ref.language_model(mx.array([[t]]), cache=cache).logits[0, -1]
    got = [t for t, _ in eng.generate(ids, 16, Sampler(), images=[pic])]
    said = eng.text.decode(got)
    eng.close()
    assert got == theirs
    assert said.strip() == answer
