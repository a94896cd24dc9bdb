"""Shared pieces of the tiny Qwen3.5-MoE recipe.

Imported both here (CPU, MLX side: data building, export, evaluation) and on the
GPU machine (PyTorch training).  Only the standard library, numpy and Pillow are
used, so it runs unchanged in both places.

Contents:
- the model config (HF ``Qwen3_5MoeForConditionalGeneration`` layout, tiny scale);
- the special tokens (same order as the real Qwen3.5/3.6 ids, remapped);
- the stdlib text corpus file list and its held-out split;
- the coloured-shapes image generator and its question/answer pairs;
- the chat prompt, exactly as ``chat_template.jinja`` renders it;
- the Qwen-VL image patchifier and the M-RoPE position ids.
"""

from __future__ import annotations

import hashlib
import math
import random
import sysconfig
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------
# Tokens
# ---------------------------------------------------------------------------

#: Size of the byte-level BPE vocabulary (256 byte tokens + merges).
BASE_VOCAB = 4032
#: Embedding rows (tokenizer length 4065, padded to a multiple of 64 like the
#: real model pads 248,077 tokens to 248,320 rows).
VOCAB_SIZE = 4096
#: Real id of ``<|endoftext|>`` in Qwen3.5/3.6; tiny id = BASE_VOCAB + (real - REAL_FIRST).
REAL_FIRST = 248044

#: The 33 added tokens of the real tokenizer, in id order, with their "special" flag.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
TOKEN_ID = {tok: BASE_VOCAB + i for i, (tok, _) in enumerate(ADDED_TOKENS)}
ENDOFTEXT = TOKEN_ID["<|endoftext|>"]  # 4032
IM_START = TOKEN_ID["<|im_start|>"]  # 4033
IM_END = TOKEN_ID["<|im_end|>"]  # 4034
VISION_START = TOKEN_ID["<|vision_start|>"]  # 4041
VISION_END = TOKEN_ID["<|vision_end|>"]  # 4042
IMAGE_PAD = TOKEN_ID["<|image_pad|>"]  # 4044
VIDEO_PAD = TOKEN_ID["<|video_pad|>"]  # 4045
THINK = TOKEN_ID["<think>"]  # 4056
END_THINK = TOKEN_ID["</think>"]  # 4057

# The same pre-tokenizer as the real Qwen3.5 tokenizer.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ---------------------------------------------------------------------------
# Model config
# ---------------------------------------------------------------------------

N_LAYERS = 8
FULL_ATTENTION_INTERVAL = 4


def hf_config() -> dict:
    """config.json of the bf16 HF checkpoint (the shape of Qwen/Qwen3.6-35B-A3B's)."""
    layer_types = [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(N_LAYERS)
    ]
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": ENDOFTEXT,
        "dtype": "bfloat16",
        "eos_token_id": ENDOFTEXT,
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_value_head_dim": 64,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 64,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 4,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": N_LAYERS,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 256,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }
    vision = {
        "deepstack_visual_indexes": [],
        "depth": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 128,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "model_type": "qwen3_5_moe",
        "num_heads": 2,
        "num_position_embeddings": 256,
        "out_hidden_size": 256,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": IMAGE_PAD,
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "5.17.0",
        "video_token_id": VIDEO_PAD,
        "vision_config": vision,
        "vision_end_token_id": VISION_END,
        "vision_start_token_id": VISION_START,
    }


def generation_config() -> dict:
    return {
        "bos_token_id": ENDOFTEXT,
        "do_sample": True,
        "eos_token_id": [IM_END, ENDOFTEXT],
        "pad_token_id": ENDOFTEXT,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "5.17.0",
    }


# Image processor settings (written to preprocessor_config.json).
PATCH = 16
TEMPORAL_PATCH = 2
MERGE = 2
MIN_PIXELS = 64 * 64
MAX_PIXELS = 256 * 256


def preprocessor_config() -> dict:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": MERGE,
        "patch_size": PATCH,
        "processor_class": "Qwen3VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": TEMPORAL_PATCH,
    }


# ---------------------------------------------------------------------------
# Text corpus: the Python standard library's own source
# ---------------------------------------------------------------------------

EXCLUDED_DIRS = {"encodings", "pydoc_data", "site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 200_000


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """Deterministic list of (relative posix path, absolute path) of stdlib .py files."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if path.stat().st_size > MAX_FILE_BYTES or path.stat().st_size == 0:
            continue
        out.append((rel.as_posix(), path))
    out.sort(key=lambda x: x[0])
    return out


def is_heldout(rel_path: str) -> bool:
    """About 5 % of files, chosen by a hash of the relative path."""
    return int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % 20 == 0


# ---------------------------------------------------------------------------
# Images: coloured shapes, and questions about them
# ---------------------------------------------------------------------------

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 150, 40),
    "blue": (30, 70, 225),
    "yellow": (235, 205, 10),
    "orange": (245, 130, 15),
    "purple": (135, 45, 180),
    "black": (20, 20, 20),
    "pink": (250, 120, 190),
}
SHAPES = ["circle", "square", "triangle", "star"]
POSITIONS = ["top left", "top right", "bottom left", "bottom right"]
BACKGROUNDS = [(255, 255, 255), (245, 245, 240), (235, 240, 250), (250, 245, 230)]
SIZES = [128, 160, 192]

QUESTIONS = {
    "colour": {
        1: ["What color is the shape?", "What colour is the shape?", "Which color is the shape in the image?"],
        2: ["What color are the shapes?", "What colour are the shapes?", "Which color are the shapes in the image?"],
    },
    "shape": {
        1: ["What shape is this?", "What shape is in the image?", "Which shape do you see?"],
        2: ["What shape are these?", "What shapes are in the image?", "Which shape do you see?"],
    },
    "count": ["How many shapes are there?", "How many shapes are in the image?", "Count the shapes."],
    "position": ["Where is the shape?", "In which corner is the shape?", "Where is the shape in the image?"],
}
QUESTION_KINDS = ["colour", "shape", "count", "position"]


def _shape_points(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if kind == "square":
        s = r * 0.85
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if kind == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.75), (cx - r * 0.95, cy + r * 0.75)]
    if kind == "star":
        pts = []
        for i in range(10):
            ang = -math.pi / 2 + i * math.pi / 5
            rad = r if i % 2 == 0 else r * 0.45
            pts.append((cx + rad * math.cos(ang), cy + rad * math.sin(ang)))
        return pts
    raise ValueError(kind)


def make_scene(rng: random.Random, width: int | None = None, height: int | None = None, count: int | None = None):
    """Draw 1-4 identical shapes (one colour, one kind); return (PIL image, scene dict)."""
    from PIL import Image, ImageDraw

    width = width or rng.choice(SIZES)
    height = height or rng.choice(SIZES)
    colour = rng.choice(list(COLOURS))
    kind = rng.choice(SHAPES)
    count = count or rng.randint(1, 4)
    bg = rng.choice(BACKGROUNDS)
    img = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(img)
    placed: list[tuple[float, float, float]] = []
    position = None
    if count == 1:
        position = rng.choice(POSITIONS)
        r = rng.uniform(12, 20)
        margin = 6
        xs = (r + 2, width / 2 - margin - r) if "left" in position else (width / 2 + margin + r, width - r - 2)
        ys = (r + 2, height / 2 - margin - r) if "top" in position else (height / 2 + margin + r, height - r - 2)
        placed.append((rng.uniform(*xs), rng.uniform(*ys), r))
    else:
        tries = 0
        while len(placed) < count:
            tries += 1
            if tries > 5000:  # start again with smaller shapes (never seen in practice)
                placed.clear()
                tries = 0
            r = rng.uniform(10, 17)
            cx = rng.uniform(r + 2, width - r - 2)
            cy = rng.uniform(r + 2, height - r - 2)
            if all(math.hypot(cx - x, cy - y) > r + rr + 6 for x, y, rr in placed):
                placed.append((cx, cy, r))
    fill = COLOURS[colour]
    for cx, cy, r in placed:
        if kind == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon(_shape_points(kind, cx, cy, r), fill=fill)
    scene = {"colour": colour, "shape": kind, "count": count, "position": position, "size": (width, height)}
    return img, scene


#: Classes of each scene attribute, in label order (the auxiliary vision loss in train.py).
SCENE_CLASSES = {"colour": list(COLOURS), "shape": SHAPES, "count": ["1", "2", "3", "4"], "position": POSITIONS}


def scene_labels(scene: dict) -> list[int]:
    """Class index of colour, shape, count and position (-100 = no position: several shapes)."""
    pos = POSITIONS.index(scene["position"]) if scene["position"] else -100
    return [list(COLOURS).index(scene["colour"]), SHAPES.index(scene["shape"]), scene["count"] - 1, pos]


DEFAULT_KIND_WEIGHTS = {"colour": 0.3, "shape": 0.3, "count": 0.25, "position": 0.3}


def make_qa(rng: random.Random, scene: dict, kind: str | None = None,
            kind_weights: dict | None = None) -> tuple[str, str, str]:
    """Pick a question about ``scene`` (position only when there is one shape);
    return (kind, question, answer)."""
    if kind is None:
        kw = kind_weights or DEFAULT_KIND_WEIGHTS
        kinds = ["colour", "shape", "count"] + (["position"] if scene["count"] == 1 else [])
        kind = rng.choices(kinds, [kw[k] for k in kinds])[0]
    n = 1 if scene["count"] == 1 else 2
    if kind == "colour":
        return kind, rng.choice(QUESTIONS["colour"][n]), scene["colour"]
    if kind == "shape":
        return kind, rng.choice(QUESTIONS["shape"][n]), scene["shape"]
    if kind == "count":
        return kind, rng.choice(QUESTIONS["count"]), str(scene["count"])
    if kind == "position":
        assert scene["count"] == 1
        return kind, rng.choice(QUESTIONS["position"]), scene["position"]
    raise ValueError(kind)


# ---------------------------------------------------------------------------
# Chat format (must equal chat_template.jinja's output; checked by check_template.py)
# ---------------------------------------------------------------------------


def render_image_prompt(question: str, enable_thinking: bool, system: str | None = None) -> str:
    """The prompt for one user turn (image first, then text), with the generation prompt."""
    out = ""
    if system is not None:
        out += f"<|im_start|>system\n{system}<|im_end|>\n"
    out += f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
    out += "<|im_start|>assistant\n"
    out += "<think>\n" if enable_thinking else "<think>\n\n</think>\n\n"
    return out


def render_answer(answer: str, enable_thinking: bool) -> str:
    """What the assistant writes after the generation prompt (the training target)."""
    return ("\n</think>\n\n" if enable_thinking else "") + answer + "<|im_end|>"


# ---------------------------------------------------------------------------
# Image preprocessing (Qwen2/3-VL layout) and M-RoPE positions
# ---------------------------------------------------------------------------


def smart_resize(height: int, width: int, factor: int = PATCH * MERGE, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(img) -> tuple[np.ndarray, tuple[int, int, int]]:
    """PIL image -> (pixel rows [gh*gw, 3*2*16*16] float32, grid (1, gh, gw)).

    Rows are ordered by 2x2 merge window, each row is (channel, time, y, x), values
    normalised with mean = std = 0.5, the frame repeated along time.
    """
    from PIL import Image

    img = img.convert("RGB")
    w, h = img.size
    rh, rw = smart_resize(h, w)
    if (rw, rh) != (w, h):
        img = img.resize((rw, rh), resample=Image.BICUBIC)
    x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0  # C,H,W
    x = (x - 0.5) / 0.5
    gh, gw = rh // PATCH, rw // PATCH
    x = np.repeat(x[None], TEMPORAL_PATCH, axis=0)  # T,C,H,W
    x = x.reshape(TEMPORAL_PATCH, 3, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    # -> (gh/m, gw/m, m, m, C, T, P, P)
    x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * TEMPORAL_PATCH * PATCH * PATCH)), (1, gh, gw)


def mrope_positions(ids: list[int], grids: list[tuple[int, int, int]]) -> np.ndarray:
    """3 x L position ids: text tokens share one counter on all axes; the k-th run of
    image tokens gets (t, row, col) offsets from the running position, and the text
    after it resumes at start + max(rows, cols)."""
    pos = np.zeros((3, len(ids)), dtype=np.int64)
    cur = 0
    i = 0
    g = 0
    while i < len(ids):
        if ids[i] == IMAGE_PAD:
            _, gh, gw = grids[g]
            g += 1
            lh, lw = gh // MERGE, gw // MERGE
            n = lh * lw
            rows = np.repeat(np.arange(lh), lw)
            cols = np.tile(np.arange(lw), lh)
            pos[0, i:i + n] = cur
            pos[1, i:i + n] = cur + rows
            pos[2, i:i + n] = cur + cols
            cur += max(lh, lw)
            i += n
        else:
            pos[:, i] = cur
            cur += 1
            i += 1
    return pos
