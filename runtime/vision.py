"""The Qwen3.5/3.6 vision tower (a Qwen3-VL ViT), run with its weights streamed block by block.

Nothing of the tower stays resident: `VisionEncoder.encode` asks `load(name)` for the tensors of
one stage just before it runs (patch embedding + position table, then each ViT block, then the
merger's two halves), casts them to the compute dtype, evaluates, and drops them. The working set
is therefore one stage's weights plus the activations of one image; `peak_bytes` bounds it for the
memory plan.

The math follows mlx-vlm's `qwen3_vl/vision.py` (which `qwen3_5_moe` reuses):

- patch embedding: a Conv3d with kernel = stride = (T, P, P) over one patch is a matmul with the
  flattened kernel. Patch rows are laid out (C, T, P, P) by the preprocessor and the stored weight
  is MLX's [O, T, P, P, C], so the weight is permuted to [O, C, T, P, P] before flattening;
- learned absolute positions: the stored n x n table (n^2 = num_position_embeddings) is sampled
  bilinearly at `linspace(0, n-1, h) x linspace(0, n-1, w)` (corner-aligned, clamped ceilings);
- 2-D rotary positions: half of each head's rotary frequencies follow the patch row, half the
  column (theta 10000, rotate-half convention);
- pre-norm blocks: LayerNorm(eps 1e-6) -> qkv -> rotary q/k -> attention within each frame ->
  proj; LayerNorm -> fc1 -> gelu(tanh) -> fc2; residual around both;
- merger: LayerNorm per patch, concatenate each 2x2 cell's 4 patches (they are consecutive in
  the preprocessor's order) -> fc1 -> gelu(erf) -> fc2 to the language model's width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..formats.errors import StreamoeError, fail

# f32 bytes allowed for one chunk of attention scores; heads are processed in chunks under it.
ATTENTION_SCORE_BYTES = 32 << 20
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_approx")


@dataclass(frozen=True)
class VisionArgs:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    prefix: str = "vision_tower"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return int(round(self.num_position_embeddings**0.5))

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_size(self) -> int:
        return self.hidden_size * self.spatial_merge_size**2

    @classmethod
    def from_config(cls, config: dict) -> VisionArgs:
        """From a checkpoint's `config.json` dict (or its `vision_config` alone)."""
        vc = config.get("vision_config", config)
        where = "config.json: vision_config"
        need = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                "num_position_embeddings")
        missing = [k for k in need if k not in vc]
        if missing:
            raise fail(where, f"missing {', '.join(missing)}")
        if vc.get("deepstack_visual_indexes"):
            raise fail(where, "deepstack_visual_indexes is not supported (Qwen3.5 has none)")
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _TANH_GELU:
            raise fail(where, f"unsupported hidden_act {act!r} (expected gelu_pytorch_tanh)")
        args = cls(
            depth=int(vc["depth"]),
            hidden_size=int(vc["hidden_size"]),
            num_heads=int(vc["num_heads"]),
            intermediate_size=int(vc["intermediate_size"]),
            out_hidden_size=int(vc["out_hidden_size"]),
            num_position_embeddings=int(vc["num_position_embeddings"]),
            patch_size=int(vc.get("patch_size", 16)),
            temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            in_channels=int(vc.get("in_channels", 3)),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
        )
        if args.hidden_size % args.num_heads or args.head_dim % 4:
            raise fail(where, f"hidden_size {args.hidden_size} / num_heads {args.num_heads} must give a "
                              "head_dim divisible by 4")
        if args.grid_side**2 != args.num_position_embeddings:
            raise fail(where, f"num_position_embeddings {args.num_position_embeddings} is not a square")
        return args

    def shapes(self, block: int | None = None) -> dict[str, tuple[int, ...]]:
        """Stored shape of every tensor (names without the prefix) of the stem+merger or one block."""
        D, F, Dout = self.hidden_size, self.intermediate_size, self.out_hidden_size
        T, P, C, M = self.temporal_patch_size, self.patch_size, self.in_channels, self.merged_size
        if block is None:
            return {
                "patch_embed.proj.weight": (D, T, P, P, C),
                "patch_embed.proj.bias": (D,),
                "pos_embed.weight": (self.num_position_embeddings, D),
                "merger.norm.weight": (D,),
                "merger.norm.bias": (D,),
                "merger.linear_fc1.weight": (M, M),
                "merger.linear_fc1.bias": (M,),
                "merger.linear_fc2.weight": (Dout, M),
                "merger.linear_fc2.bias": (Dout,),
            }
        b = f"blocks.{block}."
        return {
            b + "norm1.weight": (D,), b + "norm1.bias": (D,),
            b + "norm2.weight": (D,), b + "norm2.bias": (D,),
            b + "attn.qkv.weight": (3 * D, D), b + "attn.qkv.bias": (3 * D,),
            b + "attn.proj.weight": (D, D), b + "attn.proj.bias": (D,),
            b + "mlp.linear_fc1.weight": (F, D), b + "mlp.linear_fc1.bias": (F,),
            b + "mlp.linear_fc2.weight": (D, F), b + "mlp.linear_fc2.bias": (D,),
        }


def _heads_per_chunk(args: VisionArgs, frame: int) -> int:
    return max(1, min(args.num_heads, ATTENTION_SCORE_BYTES // (4 * frame * frame)))


def _linear(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    """x @ weight.T + bias. On the CPU backend the dense float32 product goes through numpy's BLAS: MLX's
    CPU matmul measured 1.6 GMAC/s here against OpenBLAS's 100 (781 ms vs 12 ms for one fc1 of a 256-patch
    image), which made a 640x640 image take 8 minutes to encode."""
    if mx.default_device() == mx.cpu and x.dtype == mx.float32 and weight.dtype == mx.float32:
        y = np.asarray(x) @ np.asarray(weight).T
        y += np.asarray(bias)
        return mx.array(y)
    return mx.addmm(bias, x, weight.T)


def _sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Full (non-causal) attention of one head chunk; through numpy's BLAS on the CPU backend (see `_linear`)."""
    if mx.default_device() != mx.cpu or q.dtype != mx.float32:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    qn, kn, vn = np.asarray(q), np.asarray(k), np.asarray(v)
    s = np.matmul(qn * np.float32(scale), kn.swapaxes(-1, -2))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return mx.array(np.matmul(s, vn))


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def merge_order_coords(t: int, h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Patch (row, col) of every patch row in the preprocessor's 2x2-merge order, all frames."""
    rows = np.arange(h).reshape(h // merge, 1, merge, 1)
    cols = np.arange(w).reshape(1, w // merge, 1, merge)
    rows, cols = np.broadcast_arrays(rows, cols)
    rows = np.tile(rows.reshape(-1), t).astype(np.int32)
    cols = np.tile(cols.reshape(-1), t).astype(np.int32)
    return rows, cols


class VisionEncoder:
    """Encodes one image's patches; weights come from `load(full_name)` stage by stage."""

    def __init__(
        self,
        args: VisionArgs,
        load: Callable[[str], mx.array],
        dtype: mx.Dtype = mx.float32,
        stream: mx.Device | mx.Stream = mx.cpu,
    ):
        self.args = args
        self.load = load
        self.dtype = dtype
        self.stream = stream

    # -- weights ---------------------------------------------------------------------------------

    def _weights(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, mx.array]:
        out = {}
        for name, shape in shapes.items():
            full = f"{self.args.prefix}.{name}"
            w = self.load(full)
            if tuple(w.shape) != shape:
                raise fail(full, f"shape {tuple(w.shape)} disagrees with vision_config (expected {shape})")
            out[name] = w.astype(self.dtype)
            mx.eval(out[name])  # cast now, so the stored copy is freed tensor by tensor
            del w
        return out

    # -- stages ----------------------------------------------------------------------------------

    def _embed(self, patches: mx.array, rows: mx.array, cols: mx.array, h: int, w: int) -> mx.array:
        a = self.args
        shapes = a.shapes()
        W = self._weights({k: shapes[k] for k in ("patch_embed.proj.weight", "patch_embed.proj.bias",
                                                   "pos_embed.weight")})
        # Conv3d over one patch == matmul; permute the [O, T, P, P, C] kernel to the rows' (C, T, P, P)
        kernel = W["patch_embed.proj.weight"].transpose(0, 4, 1, 2, 3).reshape(a.hidden_size, -1)
        x = _linear(patches, kernel, W["patch_embed.proj.bias"])

        # bilinear sample of the n x n position table at corner-aligned fractional coordinates
        n = a.grid_side
        table = W["pos_embed.weight"]
        fh = mx.linspace(0, n - 1, h)
        fw = mx.linspace(0, n - 1, w)
        h0, w0 = fh.astype(mx.int32), fw.astype(mx.int32)
        h1, w1 = mx.minimum(h0 + 1, n - 1), mx.minimum(w0 + 1, n - 1)
        dh, dw = (fh - h0.astype(mx.float32))[rows], (fw - w0.astype(mx.float32))[cols]
        top, bottom = h0[rows] * n, h1[rows] * n
        left, right = w0[cols], w1[cols]
        corners = [
            (top + left, (1 - dh) * (1 - dw)),
            (top + right, (1 - dh) * dw),
            (bottom + left, dh * (1 - dw)),
            (bottom + right, dh * dw),
        ]
        pos = None
        for idx, weight in corners:
            term = table[idx] * weight.astype(table.dtype)[:, None]
            pos = term if pos is None else pos + term
        return x + pos

    def _rotary(self, rows: mx.array, cols: mx.array) -> tuple[mx.array, mx.array]:
        a = self.args
        dim = a.head_dim // 2  # rotary pairs per head: half for rows, half for columns
        inv_freq = 1.0 / (a.rope_theta ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
        span = int(max(rows.max().item(), cols.max().item())) + 1
        table = mx.outer(mx.arange(span, dtype=mx.float32), inv_freq)
        freqs = mx.concatenate([table[rows], table[cols]], axis=-1)  # [N, head_dim / 2]
        cos = mx.tile(mx.cos(freqs), (1, 2))[:, None, :]
        sin = mx.tile(mx.sin(freqs), (1, 2))[:, None, :]
        return cos, sin  # float32; q/k are rotated in float32 and cast back

    def _attention(self, q: mx.array, k: mx.array, v: mx.array, frame: int) -> mx.array:
        """q, k, v [N, H, hd] -> [N, H*hd]; patches attend within their own frame."""
        a = self.args
        n = q.shape[0]
        scale = a.head_dim**-0.5
        heads = _heads_per_chunk(a, frame)
        q, k, v = (t.transpose(1, 0, 2)[None] for t in (q, k, v))  # [1, H, N, hd]
        frames = []
        for s in range(0, n, frame):
            chunks = []
            for h0 in range(0, a.num_heads, heads):
                sl = (slice(None), slice(h0, h0 + heads), slice(s, s + frame))
                o = _sdpa(q[sl], k[sl], v[sl], scale)
                mx.eval(o)  # keep only one chunk of scores alive
                chunks.append(o)
            frames.append(mx.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0])
        out = mx.concatenate(frames, axis=2) if len(frames) > 1 else frames[0]
        return out[0].transpose(1, 0, 2).reshape(n, -1)

    def _block(self, i: int, x: mx.array, cos: mx.array, sin: mx.array, frame: int) -> mx.array:
        a = self.args
        W = {k.split(".", 2)[2]: v for k, v in self._weights(a.shapes(i)).items()}
        eps = a.layer_norm_eps
        n = x.shape[0]

        y = mx.fast.layer_norm(x, W["norm1.weight"], W["norm1.bias"], eps)
        qkv = _linear(y, W["attn.qkv.weight"], W["attn.qkv.bias"]).reshape(n, 3, a.num_heads, a.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q = (q * cos + _rotate_half(q) * sin).astype(self.dtype)
        k = (k * cos + _rotate_half(k) * sin).astype(self.dtype)
        mx.eval(q, k, v)
        del qkv, y
        attn = self._attention(q, k, v, frame)
        del q, k, v
        x = x + _linear(attn, W["attn.proj.weight"], W["attn.proj.bias"])
        mx.eval(x)
        del attn

        y = mx.fast.layer_norm(x, W["norm2.weight"], W["norm2.bias"], eps)
        y = nn.gelu_approx(_linear(y, W["mlp.linear_fc1.weight"], W["mlp.linear_fc1.bias"]))
        x = x + _linear(y, W["mlp.linear_fc2.weight"], W["mlp.linear_fc2.bias"])
        mx.eval(x)
        return x

    def _merge(self, x: mx.array) -> mx.array:
        a = self.args
        shapes = a.shapes()

        def pick(*names):
            return self._weights({f"merger.{k}": shapes[f"merger.{k}"] for k in names})

        W = pick("norm.weight", "norm.bias")
        x = mx.fast.layer_norm(x, W["merger.norm.weight"], W["merger.norm.bias"], a.layer_norm_eps)
        x = x.reshape(-1, a.merged_size)  # the 4 patches of a 2x2 cell are consecutive rows
        W = pick("linear_fc1.weight", "linear_fc1.bias")
        x = nn.gelu(_linear(x, W["merger.linear_fc1.weight"], W["merger.linear_fc1.bias"]))
        mx.eval(x)
        W = pick("linear_fc2.weight", "linear_fc2.bias")
        x = _linear(x, W["merger.linear_fc2.weight"], W["merger.linear_fc2.bias"])
        mx.eval(x)
        return x

    # -- entry point -----------------------------------------------------------------------------

    def encode(self, patches, grid_thw) -> mx.array:
        """Patch rows [t*h*w, C*T*P*P] (from `runtime.image.preprocess`) and (t, h, w) ->
        image features [t*h*w / merge^2, out_hidden_size] in the compute dtype."""
        a = self.args
        t, h, w = (int(v) for v in grid_thw)
        m = a.spatial_merge_size
        if t < 1 or h < m or w < m or h % m or w % m:
            raise StreamoeError(f"grid {t}x{h}x{w} is not a whole number of {m}x{m} cells")
        n = t * h * w
        if tuple(patches.shape) != (n, a.patch_dim):
            raise StreamoeError(f"patches have shape {tuple(patches.shape)}, grid {t}x{h}x{w} needs {(n, a.patch_dim)}")
        with mx.stream(self.stream):
            rows_np, cols_np = merge_order_coords(t, h, w, m)
            rows, cols = mx.array(rows_np), mx.array(cols_np)
            x = self._embed(mx.array(patches).astype(self.dtype), rows, cols, h, w)
            cos, sin = self._rotary(rows, cols)
            mx.eval(x, cos, sin)
            for i in range(a.depth):
                x = self._block(i, x, cos, sin, frame=h * w)
            del cos, sin
            x = self._merge(x)
        mx.clear_cache()  # the freed stage buffers must not linger in MLX's cache
        return x


def max_patches(args: VisionArgs, max_pixels: int) -> int:
    """Most patches one still image can have under the pixel budget (`smart_resize` keeps
    h*w <= max_pixels with both sides multiples of patch*merge)."""
    cell = (args.patch_size * args.spatial_merge_size) ** 2
    cells = max(1, max_pixels // cell)
    return cells * args.spatial_merge_size**2


def peak_bytes(args: VisionArgs, max_pixels: int, dtype_bytes: int = 4, stored_bytes: int = 2) -> int:
    """Conservative working memory of `VisionEncoder.encode` for the largest allowed image.

    The encoder evaluates stage by stage, so the peak is the worst phase, each counted as that
    stage's weights (the stored copy `load` returns + the cast copy) plus the activations alive in
    it, with a 25 % margin. Measured on the CPU backend at the real Qwen3.6 sizes (640x640 image,
    1600 patches): the worst phase (a block's attention) peaked at 0.63x this estimate.
    """
    D, F, Dout, M = args.hidden_size, args.intermediate_size, args.out_hidden_size, args.merged_size
    n = max_patches(args, max_pixels)
    cells = n // args.spatial_merge_size**2
    w = stored_bytes + dtype_bytes
    block_weights = (4 * D + 3 * D * D + 3 * D + D * D + D + 2 * F * D + F + D) * w
    heads = _heads_per_chunk(args, n)
    rotary = 2 * n * args.head_dim
    phases = [
        # patch embedding + position table: patch rows, 4 gathered corner rows, products, sums
        (D * args.patch_dim + D + args.num_position_embeddings * D) * w
        + (n * (args.patch_dim + 8 * D) + rotary) * dtype_bytes,
        # attention: x, q, k, v, gathered head outputs, proj; scores + softmax of one head chunk
        block_weights + (n * 8 * D + rotary + 2 * heads * n * n) * dtype_bytes,
        # MLP: x, norm, fc1 out, gelu (and its temporaries), fc2 out, the sum
        block_weights + (n * (4 * D + 3 * F) + rotary) * dtype_bytes,
        # merger halves: normed rows, fc1 out, gelu, fc2 out
        (M * M + M) * w + (n * 2 * D + cells * 3 * M) * dtype_bytes,
        (Dout * M + Dout) * w + (n * D + cells * (2 * M + Dout)) * dtype_bytes,
    ]
    return int(1.25 * max(phases))


def vision_account(config: dict, max_pixels: int, max_decode_pixels: int, preprocessor: dict | None = None) -> int:
    """The plan's vision account: the larger of decoding the biggest accepted file and encoding the biggest
    resized image (weights of one stage + activations), plus the image's patches and its embeddings. The biggest
    resized image is the most the preprocessor's resize gives at this budget (`resized_pixels`)."""
    from .image import decode_peak_bytes

    va = VisionArgs.from_config(config)
    pixels = resized_pixels(config, max_pixels, preprocessor)
    n = max_patches(va, pixels)
    staged = n * va.patch_dim * 4 + n // va.spatial_merge_size**2 * va.out_hidden_size * 4 * 2
    return max(decode_peak_bytes(max_decode_pixels), peak_bytes(va, pixels)) + staged


def resized_pixels(config: dict, max_pixels: int, preprocessor: dict | None = None) -> int:
    """The most pixels an image is resized to under `--max-pixels` and the model's preprocessor (its
    `longest_edge` lowers the budget, its `shortest_edge` is the floor): `image.resized_bound`."""
    from .image import ImageConfig, resized_bound

    cfg = ImageConfig.from_config(config, preprocessor, max_pixels=max_pixels)
    return resized_bound(cfg.factor, cfg.min_pixels, cfg.max_pixels)
