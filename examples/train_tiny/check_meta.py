"""Check that the training-side formatting equals what the MLX peers do at inference.

    python examples/train_tiny/check_meta.py META_DIR

- chat template (jinja, through mlx-vlm's apply_chat_template) == common.render_image_prompt
- transformers' tokenizer (AutoTokenizer on META_DIR) == raw tokenizers on tokenizer.json
- mlx-vlm's Qwen3VLImageProcessor pixel rows/grid == common.patchify
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402


def main() -> None:
    meta = Path(sys.argv[1])
    import mlx_vlm.models.qwen3_5_moe  # noqa: F401  (installs the torch-free processor hook)
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_config, load_processor
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    config = load_config(meta)
    proc = load_processor(meta)
    print("processor:", type(proc).__name__, "tokenizer:", type(proc.tokenizer).__name__)
    raw = Tokenizer.from_file(str(meta / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(meta))
    print("AutoTokenizer:", type(hf).__name__, len(hf))
    n = 0
    for q in sum([v if isinstance(v, list) else sum(v.values(), []) for v in common.QUESTIONS.values()], []):
        for think in (False, True):
            kw = {"enable_thinking": think}
            got = apply_chat_template(proc, config, q, num_images=1, **kw)
            want = common.render_image_prompt(q, think)
            assert got == want, (got, want)
            a = hf.encode(got, add_special_tokens=False)
            b = raw.encode(got, add_special_tokens=False).ids
            assert a == b, (a, b)
            n += 1
    # plain-text chat, system message, history
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>\nx\n</think>\n\nhello"}, {"role": "user", "content": "again"}]
    s = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert s == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello"
                 "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"), s
    text = (Path(common.__file__)).read_text()
    assert hf.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert hf.decode(raw.encode(text).ids) == text
    print(f"template + tokenizer: {n} prompts equal")

    rng = random.Random(0)
    for _ in range(12):
        img, scene = common.make_scene(rng)
        mine, grid = common.patchify(img)
        theirs = proc.image_processor([img])
        pv = np.asarray(theirs["pixel_values"])
        thw = np.asarray(theirs["image_grid_thw"])[0].tolist()
        assert list(grid) == thw, (grid, thw)
        assert pv.shape == mine.shape and np.abs(pv - mine).max() < 1e-6, np.abs(pv - mine).max()
    img = common.make_scene(rng, 300, 200)[0]  # a size that needs resizing
    mine, grid = common.patchify(img)
    theirs = proc.image_processor([img])
    assert list(grid) == np.asarray(theirs["image_grid_thw"])[0].tolist()
    assert np.abs(np.asarray(theirs["pixel_values"]) - mine).max() < 1e-5
    print("image preprocessing equal:", grid)


if __name__ == "__main__":
    main()
