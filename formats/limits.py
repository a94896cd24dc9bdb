"""Sane bounds on every size a file can claim, checked before anything is allocated or looped over.

A config that says 10^9 layers or a header dim of 2^63 is a bad input, not a reason to allocate until the
kernel kills us: each count is an integer (not a bool, not a float) inside a range far above any real
model's (Qwen3.6-35B-A3B: 40 layers, 256 experts, hidden 2048, vocab 248,320) and far below what a
machine could hold, and the sizes that must agree with each other are checked against each other.
"""

from __future__ import annotations

import json

from .errors import fail

MAX_DIM = 1 << 40  # one tensor dimension, in elements
MAX_RANK = 8
MAX_TENSORS = 1 << 20  # tensors in one safetensors header or blob table
MAX_FILE_BYTES = 1 << 50  # 1 PiB: any size or offset a file claims

# config.json text-config keys: (smallest, largest) allowed value
CONFIG_INTS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 16),
    "num_hidden_layers": (1, 1024),
    "num_experts": (1, 1 << 14),
    "num_local_experts": (1, 1 << 14),
    "num_experts_per_tok": (1, 1 << 14),
    "moe_intermediate_size": (1, 1 << 18),
    "intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 18),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "linear_num_key_heads": (1, 1024),
    "linear_num_value_heads": (1, 1024),
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_conv_kernel_dim": (1, 64),
    "vocab_size": (1, 1 << 23),
    "full_attention_interval": (1, 1024),
    "max_position_embeddings": (1, 1 << 31),
    "sliding_window": (1, 1 << 31),
}
VISION_INTS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 16),
    "depth": (1, 1024),
    "intermediate_size": (1, 1 << 18),
    "num_heads": (1, 1024),
    "patch_size": (1, 1024),
    "temporal_patch_size": (1, 64),
    "spatial_merge_size": (1, 64),
    "in_channels": (1, 64),
    "out_hidden_size": (1, 1 << 16),
    "num_position_embeddings": (1, 1 << 24),
}
QUANT_INTS: dict[str, tuple[int, int]] = {"bits": (1, 16), "group_size": (1, 1 << 16)}


def is_int(v: object) -> bool:
    """A JSON integer (bool is an int to Python, never to us)."""
    return isinstance(v, int) and not isinstance(v, bool)


def json_type(v: object) -> str:
    """What a parsed JSON value is, in JSON's words (a message about config.json says null, not NoneType)."""
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object")):
        if isinstance(v, t):
            return name
    return "null" if v is None else type(v).__name__


def check_int(v: object, lo: int, hi: int, what: str, path: object) -> int:
    """`v` as an int in [lo, hi], else one error naming `path` and `what`."""
    if not is_int(v):
        shown = "" if v is None else " " + json.dumps(v, default=str)[:40]
        raise fail(path, f"{what} must be an integer, got {json_type(v)}{shown}")
    if not lo <= v <= hi:
        raise fail(path, f"{what} = {v} is out of range [{lo}, {hi}]")
    return v


# the real numbers a config states: (exclusive low, inclusive high); a norm's epsilon of 0 or below, or a rope base
# of 0, makes every logit nan or inf
CONFIG_REALS: dict[str, tuple[float, float]] = {"rms_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e15),
                                                "partial_rotary_factor": (0.0, 1.0)}


def check_real(v: object, lo: float, hi: float, what: str, path: object) -> float:
    """`v` as a finite JSON number in (lo, hi], else one error naming `path` and `what`."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        shown = "" if v is None else " " + json.dumps(v, default=str)[:40]
        raise fail(path, f"{what} must be a number, got {json_type(v)}{shown}")
    if not (lo < v <= hi):  # nan fails it too
        raise fail(path, f"{what} = {v} is out of range ({lo:g}, {hi:g}]")
    return float(v)


def _check_block(block: dict, bounds: dict[str, tuple[int, int]], where: str, path: object,
                 null_ok: bool = True) -> None:
    """Each bounded key present is an int in range; `null_ok`: null stands for "absent" (a config's head_dim)."""
    for key, (lo, hi) in bounds.items():
        if key in block and (block[key] is not None or not null_ok):
            check_int(block[key], lo, hi, f"{where}{key}", path)


def check_config_sizes(config: object, path: object) -> None:
    """Every size config.json states is an integer in its range, and related ones agree (top-k within the
    experts, key/value heads dividing the heads). Only bounds: the meaning of the config is parsed elsewhere."""
    if not isinstance(config, dict):
        raise fail(path, "config is not a JSON object")
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise fail(path, "text_config is not a JSON object")
    _check_block(text, CONFIG_INTS, "text_config." if text is not config else "", path)
    k = text.get("num_experts_per_tok")
    for key in ("num_experts", "num_local_experts"):
        n = text.get(key)
        if is_int(k) and is_int(n) and k > n:
            raise fail(path, f"num_experts_per_tok = {k} exceeds {key} = {n}")
    for a, b in (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads")):
        x, y = text.get(a), text.get(b)
        if is_int(x) and is_int(y) and x % y:
            raise fail(path, f"{a} = {x} is not a multiple of {b} = {y}")
    where = "text_config." if text is not config else ""
    for block, at in ((text, where), (text.get("rope_parameters"), f"{where}rope_parameters.")):
        for key, (lo, hi) in CONFIG_REALS.items():
            if isinstance(block, dict) and block.get(key) is not None:
                check_real(block[key], lo, hi, f"{at}{key}", path)
    types = text.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) > CONFIG_INTS["num_hidden_layers"][1]):
        raise fail(path, "layer_types must be a list of at most 1024 names")
    vision = config.get("vision_config")
    if vision is not None:
        if not isinstance(vision, dict):
            raise fail(path, "vision_config is not a JSON object")
        _check_block(vision, VISION_INTS, "vision_config.", path)
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if q is None:
            continue
        if not isinstance(q, dict):
            raise fail(path, f"{key} is not a JSON object")
        _check_block(q, QUANT_INTS, f"{key}.", path, null_ok=False)  # a null bits or group_size means nothing
        for module, o in q.items():
            if isinstance(o, dict):
                _check_block(o, QUANT_INTS, f"{key}.{module}.", path, null_ok=False)
            elif module not in QUANT_INTS and not isinstance(o, bool | str | int | float | type(None)):
                raise fail(path, f"{key}.{module} must be an object or a boolean")


def check_shape(shape: object, path: object, name: str) -> tuple[int, ...]:
    """A tensor shape from a file: a list of at most MAX_RANK integers in [0, MAX_DIM]."""
    if not isinstance(shape, list | tuple) or len(shape) > MAX_RANK:
        raise fail(path, f"tensor {name!r}: shape must be a list of at most {MAX_RANK} integers")
    for d in shape:
        if not is_int(d) or not 0 <= d <= MAX_DIM:
            raise fail(path, f"tensor {name!r}: shape {str(shape)[:80]} has a dimension that is not an integer "
                             f"in [0, {MAX_DIM}]")
    return tuple(shape)


def nbytes_of(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes a tensor of `shape` needs, in exact integer arithmetic (numpy's int64 product wraps)."""
    n = itemsize
    for d in shape:
        n *= d
    return n
