"""M-RoPE position ids for prompts with images (Qwen3.5/3.6, as mlx-vlm's `get_rope_index`).

Text tokens advance all three axes (time, height, width) together. An image whose grid is
(t, h, w) patches becomes t * (h/m) * (w/m) `<|image_pad|>` tokens (m = spatial merge size); they
all start at the position the next text token would have had, `s`, and take
(s + frame, s + row, s + col) of their merged cell. The text after the image resumes at one past
the largest position used by the image, so an image costs max(t, h/m, w/m) positions, not its
token count. After the prompt, decoding continues at `next_offset` on all three axes:
the token at sequence index L + k has position next_offset + k (`next_offset - L` is the
reference's "rope delta").

An image is recognised, as in the reference, by `<|vision_start|>` immediately followed by
`<|image_pad|>`; its run is found by searching for the next `<|image_pad|>`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..formats.errors import fail


def image_token_count(grid: Sequence[int], merge: int) -> int:
    t, h, w = (int(v) for v in grid)
    return t * (h // merge) * (w // merge)


def expand_image_tokens(
    ids: Sequence[int], grids: Sequence[Sequence[int]], image_token_id: int, merge: int
) -> list[int]:
    """Replace the k-th single `<|image_pad|>` by image k's run of t*h*w/merge^2 pads."""
    count = sum(1 for tok in ids if tok == image_token_id)
    if count != len(grids):
        raise fail("prompt", f"{count} image placeholders for {len(grids)} images")
    out: list[int] = []
    k = 0
    for tok in ids:
        if tok == image_token_id:
            out.extend([image_token_id] * image_token_count(grids[k], merge))
            k += 1
        else:
            out.append(int(tok))
    return out


def image_positions(
    input_ids: Sequence[int],
    image_grids: Sequence[Sequence[int]],
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """Positions int32 [3, L] for an expanded prompt, and the position decoding continues at."""
    ids = [int(tok) for tok in input_ids]
    n = len(ids)
    m = spatial_merge_size
    images = sum(
        1 for a, b in zip(ids[:-1], ids[1:], strict=False) if a == vision_start_token_id and b == image_token_id
    )
    if images != len(image_grids):
        raise fail("prompt", f"{images} image blocks (<|vision_start|><|image_pad|>) for {len(image_grids)} images")

    pos = np.empty((3, n), dtype=np.int32)
    st = 0  # next unassigned token
    nxt = 0  # position the next text token gets
    for grid in image_grids:
        t, h, w = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
        ed = ids.index(image_token_id, st)
        pos[:, st:ed] = nxt + np.arange(ed - st)
        nxt += ed - st
        run = t * h * w
        if ed + run > n or any(tok != image_token_id for tok in ids[ed:ed + run]):
            raise fail("prompt", f"image grid {tuple(int(v) for v in grid)} needs {run} consecutive "
                                 "<|image_pad|> tokens; expand the prompt with expand_image_tokens")
        frame, row, col = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[0, ed:ed + run] = nxt + frame.reshape(-1)
        pos[1, ed:ed + run] = nxt + row.reshape(-1)
        pos[2, ed:ed + run] = nxt + col.reshape(-1)
        nxt += max(t, h, w)
        st = ed + run
    pos[:, st:] = nxt + np.arange(n - st)
    nxt += n - st
    return pos, nxt
