"""The tensor table an mlx-community export of a config holds: every tensor's name, dtype and shape.

A model fact, derived from the config alone: `streamoe synth` writes exactly these tensors, and
`streamoe plan config.json` sizes the non-expert weights from them before anything is downloaded. One function per
family lists its tensors in mlx-lm's module order (the order `model.parameters()` flattens to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import ModelArgs, quant_mode
from .errors import StreamoeError
from .record import MXFP4_GROUP, MXFP4_SCALE
from .safetensors import tensor_nbytes

INIT_STD = 0.02  # the spread a drawn weight gets (the configs' `initializer_range`) unless its family says otherwise


@dataclass(frozen=True)
class Spec:
    """One stored tensor: safetensors dtype and shape, how to fill it, and its quantization (if any)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str  # qweight | scales | biases | one | zero | normal | sink | a_log | dt_bias | conv
    bits: int = 0  # quantized tensors only
    mode: str = "affine"  # quantized tensors only: affine, or mxfp4 (codes and uint8 scales, no biases)
    group: int = 0  # quantized tensors only: values per scale
    std: float = INIT_STD  # the spread of a drawn weight (a quantized module's dequantized one); its bias draws half

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def float_shape(self) -> tuple[int, ...]:
        """Shape of the unquantized weight of a quantized module."""
        return (*self.shape[:-1], self.shape[-1] * 32 // self.bits)


def specs(config: dict, *, a_log_dtype: str | None = None, path: object = "config.json") -> list[Spec]:
    """Every tensor of the export in module order (the order `model.parameters()` flattens to).

    `a_log_dtype` defaults to what the export implies: BF16 when the quantization block carries the 8-bit
    router overrides (the Qwen3.6 export), F32 otherwise (the Qwen3.5 export). `path`: the file the config came
    from, which a problem with it names.
    """
    a = ModelArgs.from_config(config, path)
    quant = a.quantization or {}
    if a_log_dtype is None:
        has_8bit = any(isinstance(v, dict) and v.get("bits") == 8 for v in quant.values())
        a_log_dtype = "BF16" if has_8bit else "F32"
    out: list[Spec] = []

    def plain(name: str, shape: tuple[int, ...], kind: str, dtype: str = "BF16", std: float = INIT_STD) -> None:
        out.append(Spec(name, dtype, tuple(shape), kind, std=std))

    def linear(module: str, out_dim: int, in_dim: int, lead: tuple[int, ...] = (), bias: bool = False,
               std: float = INIT_STD) -> None:
        """A quantized linear layer (affine, or MXFP4 where the config says so), then its own bias if it has one."""
        mode = quant_mode(quant, module)
        bits, group = (4, MXFP4_GROUP) if mode == "mxfp4" else a.quant_params(module)
        if in_dim % group:
            raise StreamoeError(f"config.json: {module} has input dimension {in_dim}, "
                                f"not a multiple of the group size {group}")
        scale_dtype = MXFP4_SCALE if mode == "mxfp4" else "BF16"
        out.append(Spec(f"{module}.weight", "U32", (*lead, out_dim, in_dim * bits // 32), "qweight", bits, mode, group,
                        std))
        out.append(Spec(f"{module}.scales", scale_dtype, (*lead, out_dim, in_dim // group), "scales", bits, mode, group,
                        std))
        if mode == "affine":
            out.append(Spec(f"{module}.biases", "BF16", (*lead, out_dim, in_dim // group), "biases", bits, mode, group,
                            std))
        if bias:
            plain(f"{module}.bias", (*lead, out_dim), "zero", std=std)

    v = config.get("vision_config")
    if v is not None:
        dv, p, tp, c = v["hidden_size"], v["patch_size"], v["temporal_patch_size"], v["in_channels"]
        merged = dv * v["spatial_merge_size"] ** 2
        plain("vision_tower.patch_embed.proj.weight", (dv, tp, p, p, c), "normal")
        plain("vision_tower.patch_embed.proj.bias", (dv,), "zero")
        plain("vision_tower.pos_embed.weight", (v["num_position_embeddings"], dv), "normal")
        for i in range(v["depth"]):
            b = f"vision_tower.blocks.{i}"
            for norm in ("norm1", "norm2"):
                plain(f"{b}.{norm}.weight", (dv,), "one")
                plain(f"{b}.{norm}.bias", (dv,), "zero")
            for mod, o, n in (("attn.qkv", 3 * dv, dv), ("attn.proj", dv, dv),
                              ("mlp.linear_fc1", v["intermediate_size"], dv),
                              ("mlp.linear_fc2", dv, v["intermediate_size"])):
                plain(f"{b}.{mod}.weight", (o, n), "normal")
                plain(f"{b}.{mod}.bias", (o,), "zero")
        plain("vision_tower.merger.norm.weight", (dv,), "one")
        plain("vision_tower.merger.norm.bias", (dv,), "zero")
        plain("vision_tower.merger.linear_fc1.weight", (merged, merged), "normal")
        plain("vision_tower.merger.linear_fc1.bias", (merged,), "zero")
        plain("vision_tower.merger.linear_fc2.weight", (v["out_hidden_size"], merged), "normal")
        plain("vision_tower.merger.linear_fc2.bias", (v["out_hidden_size"],), "zero")

    if a.model_type == "qwen3_moe":
        _qwen3_moe_tensors(a, plain, linear)
    elif a.model_type == "gpt_oss":
        _gpt_oss_tensors(a, plain, linear)
    elif a.model_type == "mixtral":
        _mixtral_tensors(a, plain, linear)
    else:
        _qwen3_5_moe_tensors(a, plain, linear, a_log_dtype)
    return out


def _qwen3_5_moe_tensors(a: ModelArgs, plain, linear, a_log_dtype: str) -> None:
    """Gated DeltaNet / gated attention layers, routed experts and a gated shared expert, under `language_model.`
    (qwen3_next: under `model.`/`lm_head`, each Gated DeltaNet's input projections fused in two)."""
    h, vocab = a.hidden_size, a.vocab_size
    nq, nkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    hv, dvv, value_dim, conv_dim = a.linear_num_value_heads, a.linear_value_head_dim, a.value_dim, a.conv_dim
    e, inter, shared = a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
    lm = f"{a.prefix}model"
    linear(f"{lm}.embed_tokens", vocab, h)
    for i in range(a.num_hidden_layers):
        L = f"{lm}.layers.{i}"
        if a.is_linear(i):
            p = f"{L}.linear_attn"
            plain(f"{p}.conv1d.weight", (conv_dim, a.linear_conv_kernel_dim, 1), "conv")
            if a.model_type == "qwen3_next":
                linear(f"{p}.in_proj_qkvz", conv_dim + value_dim, h)
                linear(f"{p}.in_proj_ba", 2 * hv, h)
            else:
                linear(f"{p}.in_proj_qkv", conv_dim, h)
                linear(f"{p}.in_proj_z", value_dim, h)
                linear(f"{p}.in_proj_b", hv, h)
                linear(f"{p}.in_proj_a", hv, h)
            plain(f"{p}.dt_bias", (hv,), "dt_bias")
            plain(f"{p}.A_log", (hv,), "a_log", a_log_dtype)
            plain(f"{p}.norm.weight", (dvv,), "one")
            linear(f"{p}.out_proj", h, value_dim)
        else:
            p = f"{L}.self_attn"
            linear(f"{p}.q_proj", 2 * nq * hd, h)
            linear(f"{p}.k_proj", nkv * hd, h)
            linear(f"{p}.v_proj", nkv * hd, h)
            linear(f"{p}.o_proj", h, nq * hd)
            plain(f"{p}.q_norm.weight", (hd,), "one")
            plain(f"{p}.k_norm.weight", (hd,), "one")
        plain(f"{L}.input_layernorm.weight", (h,), "one")
        plain(f"{L}.post_attention_layernorm.weight", (h,), "one")
        m = f"{L}.mlp"
        linear(f"{m}.gate", e, h)
        linear(f"{m}.switch_mlp.gate_proj", inter, h, (e,))
        linear(f"{m}.switch_mlp.up_proj", inter, h, (e,))
        linear(f"{m}.switch_mlp.down_proj", h, inter, (e,))
        linear(f"{m}.shared_expert.gate_proj", shared, h)
        linear(f"{m}.shared_expert.down_proj", h, shared)
        linear(f"{m}.shared_expert.up_proj", shared, h)
        linear(f"{m}.shared_expert_gate", 1, h)
    plain(f"{lm}.norm.weight", (h,), "one")
    linear(f"{a.prefix}lm_head", vocab, h)


def fused_gdn_rows(a: ModelArgs) -> dict[str, dict[str, np.ndarray]]:
    """Where Qwen3.5's Gated DeltaNet projections sit in a qwen3_next export's fused ones: for `in_proj_qkvz` and
    `in_proj_ba`, the rows of each of `in_proj_qkv` (q of every key head, then k, then v), `in_proj_z`, `in_proj_b`
    and `in_proj_a`. The export groups rows by key head: [q, k, v, z] of the first key head, then of the next, and
    [b, a] likewise (as mlx-lm's `fix_query_key_value_ordering` reads them)."""
    nk, dk, dv = a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim
    r = a.linear_num_value_heads // nk
    qkvz = np.arange(nk * (2 * dk + 2 * r * dv)).reshape(nk, -1)
    ba = np.arange(nk * 2 * r).reshape(nk, -1)
    return {"in_proj_qkvz": {"in_proj_qkv": np.concatenate([qkvz[:, :dk].ravel(), qkvz[:, dk:2 * dk].ravel(),
                                                            qkvz[:, 2 * dk:2 * dk + r * dv].ravel()]),
                             "in_proj_z": qkvz[:, 2 * dk + r * dv:].ravel()},
            "in_proj_ba": {"in_proj_b": ba[:, :r].ravel(), "in_proj_a": ba[:, r:].ravel()}}


def residual_std(a: ModelArgs, fan_in: int) -> float:
    """The spread a synthetic projection into the residual stream (o_proj, down_proj) is drawn with where the family
    routes by its plain attention: 2/sqrt(2·layers·hidden·fan_in).

    Drawn at the 0.02 of every other weight, the first layer's attention output is 2.2 times the embedding at hidden
    256 and 25 times it at Qwen3-30B-A3B's 2048, and near the same for every token (attention averages the values):
    every router sees about one input, the picks fall on a few experts and greedy decode loops (`bench/routing.py`:
    the busiest quarter of the experts takes 0.82-0.996 of the picks). Drawn so, it is about 0.85/sqrt(2·layers) of
    the embedding at any width and depth (GPT-2's residual scaling with the fan-ins divided out; 0.21 at 8 layers,
    0.086 at 48), and the picks spread. Qwen3.6's gated attention and gated delta rule spread them as drawn (0.35):
    its tensors keep 0.02.
    """
    return 2.0 / math.sqrt(2 * a.num_hidden_layers * a.hidden_size * fan_in)


def _gqa(a: ModelArgs, linear, p: str, bias: bool = False, o_std: float = INIT_STD) -> None:
    """Grouped-query attention's four projections under `p`, in mlx-lm's order: q, k, v, o."""
    nq, nkv, hd, h = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.hidden_size
    linear(f"{p}.q_proj", nq * hd, h, bias=bias)
    linear(f"{p}.k_proj", nkv * hd, h, bias=bias)
    linear(f"{p}.v_proj", nkv * hd, h, bias=bias)
    linear(f"{p}.o_proj", h, nq * hd, bias=bias, std=o_std)


def _qwen3_moe_tensors(a: ModelArgs, plain, linear) -> None:
    """mlx-lm's qwen3_moe module order: attention (q, k, v, o, per-head q/k norms), the two norms, the router
    and the routed experts in every layer; `lm_head` unless the embedding is tied (mlx-lm then has none)."""
    h, vocab = a.hidden_size, a.vocab_size
    hd = a.head_dim
    e, inter = a.num_experts, a.moe_intermediate_size
    linear("model.embed_tokens", vocab, h)
    for i in range(a.num_hidden_layers):
        L = f"model.layers.{i}"
        p = f"{L}.self_attn"
        _gqa(a, linear, p, o_std=residual_std(a, a.num_attention_heads * hd))
        plain(f"{p}.q_norm.weight", (hd,), "one")
        plain(f"{p}.k_norm.weight", (hd,), "one")
        plain(f"{L}.input_layernorm.weight", (h,), "one")
        plain(f"{L}.post_attention_layernorm.weight", (h,), "one")
        m = f"{L}.mlp"
        linear(f"{m}.gate", e, h)
        linear(f"{m}.switch_mlp.gate_proj", inter, h, (e,))
        linear(f"{m}.switch_mlp.up_proj", inter, h, (e,))
        linear(f"{m}.switch_mlp.down_proj", h, inter, (e,), std=residual_std(a, inter))
    plain("model.norm.weight", (h,), "one")
    if not a.tie_word_embeddings:
        linear("lm_head", vocab, h)


def _gpt_oss_tensors(a: ModelArgs, plain, linear) -> None:
    """mlx-lm's gpt_oss module order: the embedding and the final norm first, then per layer the attention (the
    sinks, then q, k, v, o, each with its bias), the routed experts (gate, up, down: MXFP4 codes, uint8 scales,
    bias) and the router (with its bias), the two norms; `lm_head` last (mlx-lm's gpt_oss always has one)."""
    h, vocab = a.hidden_size, a.vocab_size
    nq = a.num_attention_heads
    e, inter = a.num_experts, a.moe_intermediate_size
    linear("model.embed_tokens", vocab, h)
    plain("model.norm.weight", (h,), "one")
    for i in range(a.num_hidden_layers):
        L = f"model.layers.{i}"
        p = f"{L}.self_attn"
        plain(f"{p}.sinks", (nq,), "sink")
        _gqa(a, linear, p, bias=True, o_std=residual_std(a, nq * a.head_dim))
        m = f"{L}.mlp"
        linear(f"{m}.experts.gate_proj", inter, h, (e,), bias=True)
        linear(f"{m}.experts.up_proj", inter, h, (e,), bias=True)
        linear(f"{m}.experts.down_proj", h, inter, (e,), bias=True, std=residual_std(a, inter))
        linear(f"{m}.router", e, h, bias=True)
        plain(f"{L}.input_layernorm.weight", (h,), "one")
        plain(f"{L}.post_attention_layernorm.weight", (h,), "one")
    linear("lm_head", vocab, h)


def _mixtral_tensors(a: ModelArgs, plain, linear) -> None:
    """mlx-lm's mixtral module order: the embedding, then per layer the attention (q, k, v, o), the MoE block (the
    router, then the routed experts) and the two norms; the final norm; `lm_head` unless the embedding is tied."""
    h, vocab = a.hidden_size, a.vocab_size
    e, inter = a.num_experts, a.moe_intermediate_size
    linear("model.embed_tokens", vocab, h)
    for i in range(a.num_hidden_layers):
        L = f"model.layers.{i}"
        _gqa(a, linear, f"{L}.self_attn", o_std=residual_std(a, a.num_attention_heads * a.head_dim))
        m = f"{L}.block_sparse_moe"
        linear(f"{m}.gate", e, h)
        linear(f"{m}.switch_mlp.gate_proj", inter, h, (e,))
        linear(f"{m}.switch_mlp.up_proj", inter, h, (e,))
        linear(f"{m}.switch_mlp.down_proj", h, inter, (e,), std=residual_std(a, inter))
        plain(f"{L}.input_layernorm.weight", (h,), "one")
        plain(f"{L}.post_attention_layernorm.weight", (h,), "one")
    plain("model.norm.weight", (h,), "one")
    if not a.tie_word_embeddings:
        linear("lm_head", vocab, h)


def tensor_table(config: dict, *, a_log_dtype: str | None = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor, in module order."""
    return [(s.name, s.dtype, s.shape) for s in specs(config, a_log_dtype=a_log_dtype)]
