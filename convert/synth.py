"""`streamoe synth`: write a checkpoint shaped exactly like mlx-community/Qwen3.6-35B-A3B-4bit (or, with `--family`,
like mlx-community's Qwen3-30B-A3B-4bit, gpt-oss-20b-MXFP4-Q8 or Mixtral-8x7B-Instruct-v0.1-4bit), random weights.

Structure follows the real export: the mlx-vlm 0.4.4 `config.json` (top-level keys sorted,
`quantization` == `quantization_config`, 8-bit router/shared-gate overrides), tensors in module order
(vision tower first, then the language model), the `make_shards` rule with a 5 GiB cap, shards named
`model-0000N-of-0000M.safetensors` with metadata `{"format": "mlx"}`, a sorted index, and tokenizer files.
`--size full` reproduces the real export's tensor table (names, dtypes, shapes, shard files) tensor for tensor
(2,090 tensors, 20,401,929,952 B; tests/test_synth.py compares it with the recorded layout).

Weights are random but numerically sane and reproducible from the seed: every tensor draws from its own
generator seeded by (seed, crc32(name)), so a tensor's bytes do not depend on which other tensors exist.

- Quantized modules (tiny, small): float weights ~ N(0, 0.02) rounded to bf16, then a real
  `mx.quantize(w, group_size=64, bits=b)` (bf16 scales/biases, negative scales included).
- Quantized modules (full): 35 billion normals plus a quantization pass would take hours on a small
  CPU, so codes are drawn directly as uniform random uint32 words and each group gets a bf16 scale of
  random sign and magnitude ≈ 0.02/std(code) (x U(0.75, 1.25)) and a bias of -scale·(2^b-1)/2 plus a
  little noise: the dequantized weights have mean ≈ 0 and std ≈ 0.02 like real ones, at disk speed.
- Qwen3-MoE, gpt-oss and Mixtral draw their projections into the residual stream (o_proj, the experts'
  down_proj, their biases) smaller, at 2/sqrt(2·layers·hidden·fan-in) (`formats.export.residual_std`): drawn at
  0.02 their stacks of plain attention send every token's hidden state one way, every router picks the same few
  experts, and a capped run measures a model that never streams (`bench/routing.py`).
- Norm weights ≈ 1 (the export already holds `1 + w`; `linear_attn.norm` ≈ 1 as well), `A_log` =
  log U(1, 16), `dt_bias` and `conv1d` small normals, the vision tower bf16 and unquantized
  (LayerNorm weights ≈ 1, biases ≈ 0).

Qwen3-MoE (`--family qwen3_moe`) is mlx-lm's export: a flat `config.json` (Hugging Face's Qwen3-30B-A3B config
with the `quantization` block, keys sorted), tensors in mlx-lm's module order under `model.`/`lm_head`, shards
by `make_shards` (5 GiB, no empty first shard), an index with `total_parameters`, the Qwen2 tokenizer with
its chat template in tokenizer_config.json. Variant `qwen3` is the export as mlx-community ships it (every
module 4-bit); `qwen3-gate8` is what today's mlx-lm converter writes (its `quant_predicate` keeps each
`mlp.gate` at 8 bits). `--size full` is the real table: 1,351 tensors, 17,174,622,208 B, 4 shards.

gpt-oss (`--family gpt_oss`) is mlx-lm's conversion of openai/gpt-oss-20b as mlx-community ships it: Hugging Face's
config plus the `quantization` block mlx-lm writes for it (top level `mxfp4`, the MXFP4 experts kept; every other
quantized module its own affine entry, the routers `{"group_size": 64, "bits": 8}` by the model's quant_predicate),
tensors in mlx-lm's gpt_oss module order, the harmony tokenizer and a minimal harmony chat template. Variant
`mxfp4-q8` is gpt-oss-20b-MXFP4-Q8 (the rest 8-bit), `mxfp4-q4` gpt-oss-20b-MXFP4-Q4 (the rest 4-bit, routers 8).
Its MXFP4 experts are a real `mx.quantize(mode="mxfp4")` of bf16 normals at tiny/small; at full size random
E2M1 codes with E8M0 scales 2^-8 .. 2^-6 (dequantized std ≈ 0.03, measured). `--size full` is the real table (`GPT_OSS_DIMS`).

Mixtral (`--family mixtral`) is mlx-lm's 4-bit conversion of mistralai/Mixtral-8x7B-Instruct-v0.1 as mlx-community
ships it: Hugging Face's config plus the quantization block and its copy (every module 4-bit, routers included),
tensors in mlx-lm's mixtral module order, Llama's SentencePiece tokenizer (specials first) with the model's `[INST]`
chat template in tokenizer_config.json. `--size full` is the real table (`MIXTRAL_DIMS`): 839 tensors,
26,270,703,616 B, 6 shards.

Writing streams: the tensor table fixes every header before any data exists, so each shard is written
as header, then tensor after tensor; large tensors are generated in row chunks, so memory stays at
one module (tiny, small) or one chunk (full). Output goes to a temporary sibling directory that is
renamed to OUT at the end, so an interrupted run never leaves a complete-looking checkpoint.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..formats.config import text_config
from ..formats.errors import StreamoeError, fail
from ..formats.export import INIT_STD, Spec, specs
from ..formats.files import check_writable_dir, exclusive_lock, existing_ancestor
from ..formats.safetensors import build_header, tensor_nbytes
from .synth_tokenizer import (
    HARMONY_BASE,
    MIXTRAL_VOCAB,
    QWEN3_BASE,
    REAL_BASE,
    SPM_TRAINED,
    TRAINED_VOCAB,
    harmony_id,
    token_id,
    write_tokenizer_files,
)

GROUP_SIZE = 64
DEFAULT_SHARD_BYTES = 5 << 30  # mlx-vlm / mlx-lm MAX_FILE_SIZE_GB = 5
TRANSFORMERS_VERSION = "4.57.0.dev0"
SIZES = ("tiny", "small", "small-vocab", "full")
# per family, its variants (the first is the default)
VARIANTS_OF = {"qwen3_5_moe": ("qwen3.6", "qwen3.5"), "qwen3_moe": ("qwen3", "qwen3-gate8"),
               "gpt_oss": ("mxfp4-q8", "mxfp4-q4"), "mixtral": ("mixtral",), "qwen3_next": ("qwen3-next",)}
FAMILIES = tuple(VARIANTS_OF)
VARIANTS = VARIANTS_OF["qwen3_5_moe"]
QWEN3_TRANSFORMERS_VERSION = "4.51.0"
CHUNK_ELEMS = 1 << 22  # elements generated at a time on the streaming path
FREE_SPACE_MARGIN = 64 << 20


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    vocab: int
    token_base: int  # id of <|endoftext|> (= base BPE vocabulary size)
    mrope: tuple[int, int, int]
    v_depth: int
    v_hidden: int
    v_inter: int
    v_heads: int
    v_npos: int


DIMS: dict[str, Dims] = {
    # the smallest faithful config: mlx-lm and mlx-vlm load it (tests/test_synth.py)
    "tiny": Dims(hidden=64, layers=8, heads=2, kv_heads=1, head_dim=64, lin_k_heads=2, lin_v_heads=4,
                 lin_k_dim=32, lin_v_dim=32, experts=8, top_k=2, moe_inter=64, shared_inter=64, vocab=576,
                 token_base=TRAINED_VOCAB, mrope=(3, 3, 2), v_depth=2, v_hidden=64, v_inter=128, v_heads=2,
                 v_npos=64),
    # expert records of 110,592 B, 7 MiB per layer: big enough to exercise caching and I/O
    "small": Dims(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, lin_k_heads=4, lin_v_heads=8,
                  lin_k_dim=64, lin_v_dim=64, experts=64, top_k=8, moe_inter=256, shared_inter=256, vocab=576,
                  token_base=TRAINED_VOCAB, mrope=(3, 3, 2), v_depth=2, v_hidden=128, v_inter=256, v_heads=2,
                  v_npos=64),
    # small, with the real model's 248,320-row (padded) vocabulary: what choosing a token costs at full size
    "small-vocab": Dims(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, lin_k_heads=4, lin_v_heads=8,
                        lin_k_dim=64, lin_v_dim=64, experts=64, top_k=8, moe_inter=256, shared_inter=256, vocab=248320,
                        token_base=TRAINED_VOCAB, mrope=(3, 3, 2), v_depth=2, v_hidden=128, v_inter=256, v_heads=2,
                        v_npos=64),
    # the real Qwen3.6-35B-A3B (its config.json)
    "full": Dims(hidden=2048, layers=40, heads=16, kv_heads=2, head_dim=256, lin_k_heads=16, lin_v_heads=32,
                 lin_k_dim=128, lin_v_dim=128, experts=256, top_k=8, moe_inter=512, shared_inter=512,
                 vocab=248320, token_base=REAL_BASE, mrope=(11, 11, 10), v_depth=27, v_hidden=1152,
                 v_inter=4304, v_heads=16, v_npos=2304),
}


@dataclass(frozen=True)
class Qwen3Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_inter: int
    inter: int  # the dense MLP's width (a config fact; no layer of these models has one)
    vocab: int
    token_base: int


QWEN3_DIMS: dict[str, Qwen3Dims] = {
    # every quantized input dim a multiple of 64: mlx-lm loads it and quantizes every module
    "tiny": Qwen3Dims(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=64, experts=8, top_k=2, moe_inter=64,
                      inter=128, vocab=576, token_base=TRAINED_VOCAB),
    "small": Qwen3Dims(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, experts=64, top_k=8, moe_inter=256,
                       inter=512, vocab=576, token_base=TRAINED_VOCAB),
    "small-vocab": Qwen3Dims(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, experts=64, top_k=8,
                             moe_inter=256, inter=512, vocab=151936, token_base=TRAINED_VOCAB),
    # the real Qwen3-30B-A3B (its config.json)
    "full": Qwen3Dims(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_inter=768,
                      inter=6144, vocab=151936, token_base=QWEN3_BASE),
}


@dataclass(frozen=True)
class GptOssDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    inter: int  # each expert's width (the config's intermediate_size)
    window: int  # sliding_window
    vocab: int
    token_base: int  # id of <|startoftext|> (= base BPE vocabulary size)


GPT_OSS_DIMS: dict[str, GptOssDims] = {
    # every affine input dim a multiple of 64, every MXFP4 one of 32: mlx-lm loads it; a window of 8, so prompts
    # of a few dozen tokens reach past it
    "tiny": GptOssDims(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=64, experts=8, top_k=2, inter=64, window=8,
                       vocab=576, token_base=TRAINED_VOCAB),
    "small": GptOssDims(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, experts=32, top_k=4, inter=256,
                        window=32, vocab=576, token_base=TRAINED_VOCAB),
    "small-vocab": GptOssDims(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, experts=32, top_k=4, inter=256,
                              window=32, vocab=201088, token_base=TRAINED_VOCAB),
    # the real gpt-oss-20b (its config.json)
    "full": GptOssDims(hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, inter=2880,
                       window=128, vocab=201088, token_base=HARMONY_BASE),
}
GPT_OSS_TRANSFORMERS_VERSION = "4.55.0.dev0"


@dataclass(frozen=True)
class MixtralDims:
    hidden: int
    layers: int
    heads: int  # the head is hidden / heads wide
    kv_heads: int
    experts: int
    top_k: int
    inter: int  # each expert's width (the config's intermediate_size)
    vocab: int  # the tokenizer's too: its specials come first, so there is no base vocabulary to place them after

    @property
    def token_base(self) -> int:
        return self.vocab


MIXTRAL_DIMS: dict[str, MixtralDims] = {
    # every quantized input dim a multiple of 64: mlx-lm loads it and quantizes every module
    "tiny": MixtralDims(hidden=128, layers=4, heads=2, kv_heads=1, experts=8, top_k=2, inter=64, vocab=SPM_TRAINED),
    "small": MixtralDims(hidden=256, layers=8, heads=4, kv_heads=2, experts=8, top_k=2, inter=512, vocab=SPM_TRAINED),
    "small-vocab": MixtralDims(hidden=256, layers=8, heads=4, kv_heads=2, experts=8, top_k=2, inter=512,
                               vocab=MIXTRAL_VOCAB),
    # the real Mixtral-8x7B (its config.json)
    "full": MixtralDims(hidden=4096, layers=32, heads=32, kv_heads=8, experts=8, top_k=2, inter=14336, vocab=MIXTRAL_VOCAB),
}
MIXTRAL_TRANSFORMERS_VERSION = "4.36.0.dev0"


# --------------------------------------------------------------------------------------------- config


def make_config(size: str, variant: str | None = None, text_only: bool = False, family: str = "qwen3_5_moe") -> dict:
    """The `config.json` dict exactly as the export writes it (top-level keys sorted, nested order kept).

    Vision exports are mlx-vlm 0.4.4's; `text_only` gives mlx-lm's text-only export (no `vision_config`,
    `rope_parameters` with `type` instead of `rope_type`, model_type and token ids kept). `family` qwen3_moe
    is always text-only (`qwen3_moe_config`). `variant` None: the family's first.
    """
    if family not in FAMILIES:
        raise StreamoeError(f"unknown family {family!r} (expected one of {', '.join(FAMILIES)})")
    variant = variant or VARIANTS_OF[family][0]
    if variant not in VARIANTS_OF[family]:
        raise StreamoeError(f"unknown variant {variant!r} for {family} (expected one of {', '.join(VARIANTS_OF[family])})")
    if family == "qwen3_moe":
        return qwen3_moe_config(size, variant)
    if family == "gpt_oss":
        return gpt_oss_config(size, variant)
    if family == "mixtral":
        return mixtral_config(size)
    if family == "qwen3_next":
        return qwen3_next_config(size)
    if size not in DIMS:
        raise StreamoeError(f"unknown size {size!r} (expected one of {', '.join(SIZES)})")
    if variant not in VARIANTS:
        raise StreamoeError(f"unknown variant {variant!r} (expected one of {', '.join(VARIANTS)})")
    d = DIMS[size]
    base = d.token_base
    rotary = d.head_dim * 0.25
    assert sum(d.mrope) * 2 == rotary, "mrope_section must sum to head_dim * partial_rotary_factor / 2"
    assert d.lin_v_heads % d.lin_k_heads == 0 and int(d.v_npos ** 0.5) ** 2 == d.v_npos
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(d.layers)]
    rope = {"mrope_interleaved": True, "mrope_section": list(d.mrope), "partial_rotary_factor": 0.25,
            "rope_theta": 10000000, "rope_type": "default"}
    if text_only:  # mlx-lm's ModelArgs renames rope_type -> type in place before the config is saved
        rope["type"] = rope.pop("rope_type")
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": base,
        "dtype": "bfloat16",
        "eos_token_id": base,
        "full_attention_interval": 4,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": d.lin_k_dim,
        "linear_num_key_heads": d.lin_k_heads,
        "linear_num_value_heads": d.lin_v_heads,
        "linear_value_head_dim": d.lin_v_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": d.moe_inter,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": d.heads,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "output_router_logits": False,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": rope,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": d.shared_inter,
        "use_cache": True,
        "vocab_size": d.vocab,
    }
    vision = {
        "deepstack_visual_indexes": [],
        "depth": d.v_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": d.v_hidden,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": d.v_inter,
        "model_type": "qwen3_5_moe",
        "num_heads": d.v_heads,
        "num_position_embeddings": d.v_npos,
        "out_hidden_size": d.hidden,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    quant: dict[str, object] = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
    if variant == "qwen3.6":  # the model's quant_predicate: 8-bit router and shared-expert gate
        for i in range(d.layers):
            for mod in ("mlp.gate", "mlp.shared_expert_gate"):
                quant[f"language_model.model.layers.{i}.{mod}"] = {"group_size": GROUP_SIZE, "bits": 8}
    config: dict[str, object] = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": token_id("<|image_pad|>", base),
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "video_token_id": token_id("<|video_pad|>", base),
        "vision_config": vision,
        "vision_end_token_id": token_id("<|vision_end|>", base),
        "vision_start_token_id": token_id("<|vision_start|>", base),
        # load_config copies generation_config's eos_token_id to the top level
        "eos_token_id": [token_id("<|im_end|>", base), token_id("<|endoftext|>", base)],
        "quantization": quant,
        "quantization_config": quant,
    }
    if text_only:
        del config["vision_config"]
    return dict(sorted(config.items()))


def qwen3_moe_config(size: str, variant: str = "qwen3") -> dict:
    """Qwen3-30B-A3B's config.json as mlx-lm saves it: Hugging Face's config plus the quantization block (and
    its copy), keys sorted. `qwen3-gate8` adds today's converter's 8-bit override for every layer's router."""
    if size not in QWEN3_DIMS:
        raise StreamoeError(f"unknown size {size!r} (expected one of {', '.join(SIZES)})")
    d = QWEN3_DIMS[size]
    quant: dict[str, object] = {"group_size": GROUP_SIZE, "bits": 4}
    if variant == "qwen3-gate8":
        quant["mode"] = "affine"
        for i in range(d.layers):
            quant[f"model.layers.{i}.mlp.gate"] = {"group_size": GROUP_SIZE, "bits": 8}
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id("<|endoftext|>", d.token_base),
        "decoder_sparse_step": 1,
        "eos_token_id": token_id("<|im_end|>", d.token_base),
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.inter,
        "max_position_embeddings": 40960,
        "max_window_layers": d.layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": d.moe_inter,
        "norm_topk_prob": True,
        "num_attention_heads": d.heads,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "output_router_logits": False,
        "quantization": quant,
        "quantization_config": quant,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": QWEN3_TRANSFORMERS_VERSION,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": d.vocab,
    }
    return dict(sorted(config.items()))


# Qwen3.6's sizes (`DIMS`, their vision left out), and at full size the real Qwen3-Next-80B-A3B (its config.json)
QWEN3_NEXT_DIMS: dict[str, Dims] = {**DIMS, "full": Dims(
    hidden=2048, layers=48, heads=16, kv_heads=2, head_dim=256, lin_k_heads=16, lin_v_heads=32, lin_k_dim=128,
    lin_v_dim=128, experts=512, top_k=10, moe_inter=512, shared_inter=512, vocab=151936, token_base=QWEN3_BASE,
    mrope=(32, 0, 0), v_depth=0, v_hidden=0, v_inter=0, v_heads=0, v_npos=0)}


def qwen3_next_config(size: str) -> dict:
    """Qwen3-Next-80B-A3B's config.json as mlx-lm saves it: Hugging Face's flat config plus the quantization block
    (and its copy), keys sorted; the model's quant_predicate keeps each router and shared-expert gate at 8 bits."""
    if size not in QWEN3_NEXT_DIMS:
        raise StreamoeError(f"unknown size {size!r} (expected one of {', '.join(SIZES)})")
    d = QWEN3_NEXT_DIMS[size]
    quant: dict[str, object] = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
    for i in range(d.layers):
        for mod in ("mlp.gate", "mlp.shared_expert_gate"):
            quant[f"model.layers.{i}.{mod}"] = {"group_size": GROUP_SIZE, "bits": 8}
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id("<|endoftext|>", d.token_base),
        "decoder_sparse_step": 1,
        # mlx-lm's load_config copies generation_config's eos_token_id to the top level
        "eos_token_id": [token_id("<|im_end|>", d.token_base), token_id("<|endoftext|>", d.token_base)],
        "full_attention_interval": 4,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": d.lin_k_dim,
        "linear_num_key_heads": d.lin_k_heads,
        "linear_num_value_heads": d.lin_v_heads,
        "linear_value_head_dim": d.lin_v_dim,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": d.moe_inter,
        "norm_topk_prob": True,
        "num_attention_heads": d.heads,
        "num_experts": d.experts,
        "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "quantization": quant,
        "quantization_config": quant,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": d.shared_inter,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": d.vocab,
    }
    return dict(sorted(config.items()))


def gpt_oss_config(size: str, variant: str = "mxfp4-q8") -> dict:
    """openai/gpt-oss-20b's config.json as mlx-lm saves its MXFP4 conversion: Hugging Face's config (its own
    `quantization_config` replaced), the `quantization` block and its copy, keys sorted."""
    if size not in GPT_OSS_DIMS:
        raise StreamoeError(f"unknown size {size!r} (expected one of {', '.join(SIZES)})")
    d = GPT_OSS_DIMS[size]
    bits = 8 if variant == "mxfp4-q8" else 4
    affine = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    quant: dict[str, object] = {"group_size": 32, "bits": 4, "mode": "mxfp4", "model.embed_tokens": dict(affine)}
    for i in range(d.layers):
        for mod in ("q_proj", "k_proj", "v_proj", "o_proj"):
            quant[f"model.layers.{i}.self_attn.{mod}"] = dict(affine)
        quant[f"model.layers.{i}.mlp.router"] = {"group_size": GROUP_SIZE, "bits": 8}  # gpt_oss's quant_predicate
    quant["lm_head"] = dict(affine)
    config = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        # mlx-lm's load_config copies generation_config's eos_token_id to the top level
        "eos_token_id": [harmony_id(t, d.token_base) for t in ("<|return|>", "<|endoftext|>", "<|call|>")],
        "experts_per_token": d.top_k,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": d.inter,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": d.heads,
        "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "num_local_experts": d.experts,
        "output_router_logits": False,
        "pad_token_id": harmony_id("<|endoftext|>", d.token_base),
        "quantization": quant,
        "quantization_config": quant,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": d.window,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": GPT_OSS_TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": d.vocab,
    }
    return dict(sorted(config.items()))


def mixtral_config(size: str) -> dict:
    """mistralai/Mixtral-8x7B-Instruct-v0.1's config.json as mlx-lm saves its 4-bit conversion (mlx-community's):
    Hugging Face's config plus the quantization block and its copy, keys sorted."""
    if size not in MIXTRAL_DIMS:
        raise StreamoeError(f"unknown size {size!r} (expected one of {', '.join(SIZES)})")
    d = MIXTRAL_DIMS[size]
    quant = {"group_size": GROUP_SIZE, "bits": 4}
    config = {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.inter,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": d.heads,
        "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "num_local_experts": d.experts,
        "output_router_logits": False,
        "quantization": quant,
        "quantization_config": quant,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": MIXTRAL_TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": d.vocab,
    }
    return dict(sorted(config.items()))


def token_base(size: str, family: str = "qwen3_5_moe") -> int:
    """The id of the first added token (the base BPE vocabulary's size) of a family's size (mixtral: its vocabulary's
    size, the specials coming first)."""
    dims = {"qwen3_moe": QWEN3_DIMS, "gpt_oss": GPT_OSS_DIMS, "mixtral": MIXTRAL_DIMS, "qwen3_next": QWEN3_NEXT_DIMS}
    return dims.get(family, DIMS)[size].token_base


# --------------------------------------------------------------------------------------------- tensors


def assign_shards(table: list, shard_bytes: int | None = None, *, leading_empty: bool = True) -> list[tuple[str, list]]:
    """Split `table` (module order) into shard files: [(file name, [entries])].

    A new shard starts when adding the next tensor would exceed `shard_bytes` (default 5 GiB); a tensor
    larger than the cap gets a shard of its own. Entries are table rows (name, dtype, shape, ...) or
    `Spec`s. With `leading_empty` (mlx-vlm's `make_shards`, the vision exports) a first tensor larger
    than the cap leaves an empty first shard, which the index never names; without it (mlx-lm) it does
    not. One shard is `model.safetensors`, several `model-0000N-of-0000M.safetensors`.
    """
    cap = DEFAULT_SHARD_BYTES if shard_bytes is None else int(shard_bytes)
    if cap <= 0:
        raise StreamoeError(f"shard size must be positive, got {cap} bytes")
    shards: list[list] = [] if not leading_empty else [[]]
    size = 0
    for entry in table:
        n = entry.nbytes if isinstance(entry, Spec) else tensor_nbytes(entry[1], tuple(entry[2]))
        if not shards or size + n > cap:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    if len(shards) == 1:
        return [("model.safetensors", shards[0])]
    k = len(shards)
    return [(f"model-{i + 1:05d}-of-{k:05d}.safetensors", s) for i, s in enumerate(shards)]


def layout(config: dict, shard_bytes: int | None = None) -> list[dict]:
    """Rows like the reference layout jsonl: {name, dtype, shape, nbytes, file}, in module order."""
    rows = []
    for file, entries in assign_shards(specs(config), shard_bytes, leading_empty="vision_config" in config):
        for s in entries:
            rows.append({"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "nbytes": s.nbytes, "file": file})
    return rows


def total_parameters(spec_list: list[Spec]) -> int:
    """mlx-lm's `get_total_parameters`: quantized weights count their unpacked elements, scales/biases none; it sums
    leaf modules only, so gpt-oss's attention sinks (a parameter of the attention block itself) are not counted."""
    n = 0
    for s in spec_list:
        if s.kind == "qweight":
            n += int(np.prod(s.float_shape, dtype=np.int64))
        elif s.kind not in ("scales", "biases", "sink"):
            n += int(np.prod(s.shape, dtype=np.int64))
    return n


# --------------------------------------------------------------------------------------------- values


def _rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([seed & ((1 << 64) - 1), zlib.crc32(key.encode())])


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (inputs are finite)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def _float_values(kind: str, rng: np.random.Generator, n: int, std: float = INIT_STD) -> np.ndarray:
    if kind == "one":
        return 1.0 + 0.02 * rng.standard_normal(n, dtype=np.float32)
    if kind == "zero":
        return std / 2 * rng.standard_normal(n, dtype=np.float32)
    if kind == "normal":
        return std * rng.standard_normal(n, dtype=np.float32)
    if kind == "sink":  # attention sinks: logits of the size of a head's scores
        return rng.standard_normal(n, dtype=np.float32)
    if kind == "a_log":
        return np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
    if kind == "dt_bias":
        return 0.1 * rng.standard_normal(n, dtype=np.float32)
    if kind == "conv":
        return 0.1 * rng.standard_normal(n, dtype=np.float32)
    raise AssertionError(kind)


def _encode(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        return _bf16(values).tobytes()
    if dtype == "F32":
        return values.astype("<f4").tobytes()
    raise AssertionError(dtype)


def _chunks(spec: Spec):
    """Element counts of whole-row chunks of `spec` (flattened to [rows, cols]), about CHUNK_ELEMS each."""
    cols = spec.shape[-1] if len(spec.shape) > 1 else int(np.prod(spec.shape))
    rows = int(np.prod(spec.shape, dtype=np.int64)) // max(cols, 1)
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    for r in range(0, rows, step):
        yield min(step, rows - r) * cols


def _plain_bytes(spec: Spec, seed: int):
    rng = _rng(seed, spec.name)
    for n in _chunks(spec):
        yield _encode(_float_values(spec.kind, rng, n, spec.std), spec.dtype)


def _code_std(bits: int) -> float:
    levels = 1 << bits
    return float(np.sqrt((levels * levels - 1) / 12.0))


def _fast_scales(spec: Spec, n: int, rng: np.random.Generator) -> np.ndarray:
    """Per-group scales: magnitude std/std(code) x U(0.75, 1.25), random sign (as mx.quantize gives)."""
    u = rng.random(n, dtype=np.float32) - np.float32(0.5)
    return np.copysign(np.float32(0.75) + np.abs(u), u) * np.float32(spec.std / _code_std(spec.bits))


def _fast_quant_bytes(spec: Spec, seed: int):
    """Streaming path (full): random codes, then scales/biases that make the dequantized std ≈ spec.std (MXFP4: E8M0
    scales 2^-8 .. 2^-6 over uniform E2M1 codes, whose std is about 2.9: a dequantized std of about 0.03 at 0.02,
    the exponents shifted by log2(std/0.02) rounded)."""
    if spec.kind == "qweight":
        rng = _rng(seed, spec.name)
        for n in _chunks(spec):
            yield rng.integers(0, 1 << 32, n, dtype=np.uint32).astype("<u4").tobytes()
        return
    if spec.mode == "mxfp4":
        rng = _rng(seed, spec.name)
        shift = round(math.log2(spec.std / INIT_STD))
        for n in _chunks(spec):
            yield rng.integers(127 - 8 + shift, 127 - 5 + shift, n, dtype=np.uint8).tobytes()
        return
    # scales and biases replay the same scale stream, so bias = -scale * mid holds group by group
    srng = _rng(seed, f"{spec.module}.scales")
    brng = _rng(seed, f"{spec.module}.biases")
    mid = np.float32(((1 << spec.bits) - 1) / 2.0)
    for n in _chunks(spec):
        s = _fast_scales(spec, n, srng)
        if spec.kind == "scales":
            yield _bf16(s).tobytes()
        else:
            b = s * -mid + np.float32(spec.std / 10) * brng.standard_normal(n, dtype=np.float32)
            yield _bf16(b).tobytes()


class _ExactQuantizer:
    """tiny/small: a real `mx.quantize` of a bf16 N(0, std) weight; keeps one module's three tensors."""

    def __init__(self, seed: int):
        self.seed = seed
        self.module: str | None = None
        self.parts: dict[str, bytes] = {}

    def bytes_for(self, spec: Spec) -> bytes:
        if spec.module != self.module:
            import mlx.core as mx

            rng = _rng(self.seed, spec.module)
            w = spec.std * rng.standard_normal(spec.float_shape, dtype=np.float32)
            self.module = spec.module
            if spec.mode == "mxfp4":
                wq, scales = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=spec.group, bits=4, mode="mxfp4")
                self.parts = {"qweight": np.array(wq).astype("<u4").tobytes(), "scales": np.array(scales).tobytes()}
            else:
                wq, scales, biases = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=spec.group or GROUP_SIZE,
                                                 bits=spec.bits)
                self.parts = {
                    "qweight": np.array(wq).astype("<u4").tobytes(),
                    "scales": np.array(scales.view(mx.uint16)).astype("<u2").tobytes(),
                    "biases": np.array(biases.view(mx.uint16)).astype("<u2").tobytes(),
                }
        data = self.parts.pop(spec.kind)
        assert len(data) == spec.nbytes, (spec.name, len(data), spec.nbytes)
        return data


# --------------------------------------------------------------------------------------------- writing


def _format_row(row: dict) -> str:
    shape = json.dumps(row["shape"], separators=(",", ":"))
    return f"{row['name']}\t{row['dtype']}\t{shape}\t{row['nbytes']}\t{row['file']}"


def _check_out(out: Path) -> None:
    if out.is_symlink() and not out.exists():
        raise fail(out, "is a dangling symbolic link")
    if out.exists():
        if not out.is_dir():
            raise fail(out, "exists and is not a directory (will not overwrite)")
        try:
            empty = not any(out.iterdir())
        except OSError as e:
            raise fail(out, f"cannot read directory ({e.strerror})") from None
        if not empty:
            raise fail(out, "exists and is not empty (will not overwrite)")


def _remove_stale_temps(out: Path) -> None:
    """Remove temporaries that interrupted (killed) runs for the same OUT left behind."""
    for tmp in out.parent.glob(f".{glob.escape(out.name)}.synth-*.tmp"):
        pid = tmp.name[len(out.name) + len(".synth-") + 1:-len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # alive (or not ours to judge)


def _write_json(path: Path, obj: object, indent: int = 4) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent)


def synth(out: Path, *, size: str, variant: str | None, text_only: bool, seed: int, shard_bytes: int | None,
          dry_run: bool, family: str = "qwen3_5_moe") -> None:
    """Write (or with `dry_run`, print the table of) a synthetic checkpoint of `family` at `out`."""
    out = Path(out)
    config = make_config(size, variant, text_only, family)
    spec_list = specs(config)
    shards = assign_shards(spec_list, shard_bytes, leading_empty="vision_config" in config)
    total = sum(s.nbytes for s in spec_list)

    if dry_run:
        lines = []
        for file, entries in shards:
            for s in entries:
                lines.append(_format_row({"name": s.name, "dtype": s.dtype, "shape": list(s.shape),
                                          "nbytes": s.nbytes, "file": file}))
        named = sum(1 for _, entries in shards if entries)
        lines.append(f"total\t{total}\t{len(spec_list)} tensors\t{named} shard files")
        sys.stdout.write("\n".join(lines) + "\n")
        return

    if out.is_symlink():  # `~/ckpt -> /mnt/nvme/ckpt`: written where the link points (its space weighed there), as convert
        out = Path(os.path.realpath(out))
        print(f"(OUT is a link: writing into {out})", file=sys.stderr, flush=True)
    _check_out(out)
    target = Path(os.path.abspath(out))  # '.', '..' and trailing slashes resolved
    check_writable_dir(target.parent, out)  # a read-only or locked place, before its free space is weighed
    anchor = existing_ancestor(target.parent)
    try:
        free = shutil.disk_usage(anchor).free
    except OSError as e:
        raise fail(out, f"cannot check free space ({e.strerror})") from None
    need = total + FREE_SPACE_MARGIN
    if free < need:
        raise fail(out, f"not enough free disk space: needs {need / 2**30:.2f} GiB, "
                        f"{free / 2**30:.2f} GiB free on {anchor}")

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fail(out, f"cannot create output directory ({e.strerror})") from None
    with exclusive_lock(target.parent / f".{target.name}.lock", out, "this OUT"):  # a second synth fails at once
        _check_out(out)  # again, now that no other run can fill it
        _write_into(target, out, config, seed, shard_bytes, size, family)


def _write_into(target: Path, out: Path, config: dict, seed: int, shard_bytes: int | None, size: str,
                family: str) -> None:
    """The checkpoint written into a temporary beside `target`, then renamed to it; the temporary removed on any
    failure or interruption."""
    tmp = target.parent / f".{target.name}.synth-{os.getpid()}.tmp"
    try:
        _remove_stale_temps(target)
        tmp.mkdir()
    except OSError as e:
        raise fail(out, f"cannot create output directory ({e.strerror})") from None
    try:
        write_checkpoint(tmp, config, seed=seed, shard_bytes=shard_bytes, exact=size != "full",
                         token_base=token_base(size, family))
        if target.is_dir():
            target.rmdir()  # empty (checked above); rename cannot replace a directory everywhere
        os.rename(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise fail(e.filename or out, f"write failed ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_checkpoint(directory: Path, config: dict, *, seed: int = 0, shard_bytes: int | None = None,
                     exact: bool = True, token_base: int | None = None) -> None:
    """Write shards, index, config and tokenizer files for `config` into the existing `directory`.

    `exact` quantizes real float weights with `mx.quantize` (tiny, small); otherwise quantized tensors take
    the streaming random-code path used for `full`. `token_base` is the id of `<|endoftext|>`
    (default: taken from the text config's `bos_token_id`).
    """
    from tqdm import tqdm

    directory = Path(directory)
    spec_list = specs(config)
    vision = "vision_config" in config
    shards = assign_shards(spec_list, shard_bytes, leading_empty=vision)
    total = sum(s.nbytes for s in spec_list)
    weight_map: dict[str, str] = {}
    quantizer = _ExactQuantizer(seed)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="synth", file=sys.stderr,
              mininterval=0.5, leave=False, disable=None) as bar:  # drawn on a terminal, not into a log
        for file, entries in shards:
            header, _ = build_header([(s.name, s.dtype, s.shape) for s in entries], {"format": "mlx"})
            with open(directory / file, "wb") as f:
                f.write(header)
                for s in entries:
                    written = 0
                    if s.kind in ("qweight", "scales", "biases"):
                        parts = [quantizer.bytes_for(s)] if exact else _fast_quant_bytes(s, seed)
                    else:
                        parts = _plain_bytes(s, seed)
                    for chunk in parts:
                        f.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
                    if written != s.nbytes:
                        raise AssertionError(f"{s.name}: wrote {written} bytes, expected {s.nbytes}")
                    weight_map[s.name] = file
    metadata: dict[str, int] = {"total_size": total}
    if not vision:  # mlx-lm's save_model also records the parameter count
        metadata["total_parameters"] = total_parameters(spec_list)
    _write_json(directory / "model.safetensors.index.json",
                {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(directory / "config.json", config)
    base = text_config(config)["bos_token_id"] if token_base is None else token_base
    write_tokenizer_files(directory, base=base, vision_config=config.get("vision_config"),
                          transformers_version=config["transformers_version"], family=config["model_type"])
