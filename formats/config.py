"""Model facts: everything derived from a checkpoint's config.json, in one place.

`ModelArgs` is the language model's shape and numerics; `quant_for` resolves the per-module quantization
overrides of an MLX export; `eos_ids` collects the stop tokens. The converter, the planner and the runtime
all read configs through this module, so a fact is derived once and a bad config fails the same way
everywhere: one `StreamoeError` naming the file.

Families (`model_type`), and what each config says:

- `qwen3_5_moe` (Qwen3.5/3.6-MoE): Gated DeltaNet layers with every `full_attention_interval`-th one gated
  full attention (partial, interleaved M-RoPE), a shared expert beside the routed ones; tensors under
  `language_model.` (the mlx-vlm export's prefix, kept by mlx-lm's text-only one).
- `qwen3_moe` (Qwen3-MoE, e.g. Qwen3-30B-A3B): every layer full attention (GQA, RMSNorm on each head's
  queries and keys, plain RoPE over the whole head), every layer MoE (`decoder_sparse_step` 1, no
  `mlp_only_layers`), no shared expert; a flat config.json and tensors under `model.`/`lm_head`. Its
  linear-attention and shared-expert fields are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import StreamoeError, fail

PREFIX = "language_model."  # where a qwen3_5_moe export keeps its language model's tensors
LINEAR, FULL = "linear_attention", "full_attention"
FAMILIES = ("qwen3_5_moe", "qwen3_moe")  # the model_types streamoe runs
TENSOR_PREFIX = {"qwen3_5_moe": PREFIX, "qwen3_moe": ""}


def text_config(config: dict) -> dict:
    """The language model's config: nested `text_config` in VLM exports, else the top level."""
    text = config.get("text_config", config)
    return text if isinstance(text, dict) else {}


def quant_for(quant: dict, module: str) -> tuple[int, int] | None:
    """(bits, group_size) of a module from an export's `quantization` block, honouring per-module overrides;
    None where the export left the module unquantized (`"module": false`)."""
    o = quant.get(module)
    if o is False:
        return None
    o = o if isinstance(o, dict) else {}
    return int(o.get("bits", quant["bits"])), int(o.get("group_size", quant["group_size"]))


def eos_ids(config: dict, generation_config: dict | None = None) -> list[int]:
    """Stop tokens, in first-seen order: config.json (top level and text config), then generation_config."""
    out: list[int] = []
    for src in (config, text_config(config), config.get("generation_config") or {}, generation_config or {}):
        ids = src.get("eos_token_id") if isinstance(src, dict) else None
        for t in [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []:
            if isinstance(t, int) and not isinstance(t, bool) and t not in out:
                out.append(t)
    return out


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    full_attention_interval: int = 4
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    quantization: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3_5_moe"

    @classmethod
    def from_config(cls, config: dict, path: object = "config.json") -> ModelArgs:
        """Read config.json: a vision export (`text_config` inside) or a text-only one (flat or nested).
        Every problem is a `StreamoeError` naming `path`."""
        try:
            return cls._from_config(config, path)
        except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong type or out of int/float range
            raise fail(path, f"a text config value has the wrong type ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_config(cls, config: dict, path: object) -> ModelArgs:
        text = text_config(config)

        def need(key):
            if key not in text:
                raise fail(path, f"text config has no '{key}'")
            return text[key]

        model_type = config.get("model_type", text.get("model_type", "qwen3_5_moe"))
        model_type = {"qwen3_5_moe_text": "qwen3_5_moe"}.get(model_type, model_type) if isinstance(model_type, str) else model_type
        if model_type not in FAMILIES:
            raise fail(path, f"unsupported model_type {str(model_type)[:40]!r} (supported: {', '.join(FAMILIES)})")
        if int(need("num_experts")) <= 0:
            raise fail(path, "num_experts must be > 0 (only the MoE model is supported)")
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
            raise fail(path, "dense MLP layers (mlp_only_layers / decoder_sparse_step) are not supported"
            )
        if text.get("attention_bias", False):
            raise fail(path, "attention_bias = true is not supported")
        head_dim = int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        family = _hybrid_fields if model_type == "qwen3_5_moe" else _all_attention_fields
        fields = family(text, need, head_dim, path)

        quant = config.get("quantization") or config.get("quantization_config") or text.get("quantization")
        if not quant or "bits" not in quant or "group_size" not in quant:
            raise fail(path, "no quantization block (only quantized exports are supported)")
        if quant.get("mode", "affine") != "affine":
            raise fail(path, f"quantization mode {quant.get('mode')!r} is not supported")

        args = cls(
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            num_experts=int(need("num_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            rms_norm_eps=float(need("rms_norm_eps")),
            vocab_size=int(need("vocab_size")),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            tie_word_embeddings=bool(
                config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            quantization=dict(quant),
            eos_token_ids=tuple(eos_ids(config)),
            model_type=model_type,
            **fields,
        )
        if args.linear_num_key_heads and args.linear_num_value_heads % args.linear_num_key_heads:
            raise fail(path, "linear_num_value_heads must be a multiple of linear_num_key_heads")
        if args.num_attention_heads % args.num_key_value_heads:
            raise fail(path, "num_attention_heads must be a multiple of num_key_value_heads")
        return args

    @property
    def prefix(self) -> str:
        """What the export puts before `model.`/`lm_head` in a tensor's name ("language_model." or "")."""
        return TENSOR_PREFIX[self.model_type]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == LINEAR

    def quant_params(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of a quantized module, e.g. 'language_model.model.layers.0.mlp.gate' (the full
        name, with the family's `prefix`)."""
        q = self.quantization or {}
        spec = q.get(module)
        if isinstance(spec, dict) and spec.get("mode", "affine") != "affine":
            raise StreamoeError(f"{module}: quantization mode {spec.get('mode')!r} is not supported")
        bg = quant_for(q, module)
        if bg is None:
            raise StreamoeError(f"{module}: left unquantized by the export; not supported")
        return bg

    def expert_quant(self, i: int) -> tuple[int, int]:
        """(bits, group_size) of layer i's routed experts, as the export's config states them."""
        return self.quant_params(f"{self.prefix}model.layers.{i}.mlp.switch_mlp.gate_proj")


    @property
    def n_full_attention(self) -> int:
        return sum(1 for t in self.layer_types if t == FULL)

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def _rope_params(text: dict) -> dict:
    return dict(text.get("rope_parameters") or text.get("rope_scaling") or {})


def _hybrid_fields(text: dict, need, head_dim: int, path: object) -> dict:
    """qwen3_5_moe: Gated DeltaNet and gated full attention by the interval, partial M-RoPE, a shared expert."""
    n_layers = int(need("num_hidden_layers"))
    interval = int(text.get("full_attention_interval", 4))
    by_interval = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))
    layer_types = tuple(text.get("layer_types") or by_interval)
    if layer_types != by_interval:
        # mlx-lm/mlx-vlm place the layers by the interval; a config that disagrees would run differently.
        raise fail(path, f"layer_types {list(layer_types)} disagree with full_attention_interval {interval}")
    rope = _rope_params(text)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise fail(path, f"rope type {rope_type!r} is not supported")
    if rope.get("mrope_interleaved", True) is False:
        raise fail(path, "only interleaved M-RoPE (mrope_interleaved = true) is supported")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise fail(path, "no rope_theta")
    prf = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    rot = int(head_dim * prf)
    section = tuple(int(s) for s in (rope.get("mrope_section") or (rot // 2, 0, 0)))
    if rot % 2 or len(section) != 3 or sum(section) != rot // 2:
        raise fail(path, f"mrope_section {list(section)} must have 3 parts summing to {rot // 2}")
    return dict(
        layer_types=layer_types,
        linear_num_key_heads=int(need("linear_num_key_heads")),
        linear_num_value_heads=int(need("linear_num_value_heads")),
        linear_key_head_dim=int(need("linear_key_head_dim")),
        linear_value_head_dim=int(need("linear_value_head_dim")),
        linear_conv_kernel_dim=int(need("linear_conv_kernel_dim")),
        shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
        rope_theta=float(theta),
        partial_rotary_factor=prf,
        mrope_section=section,
        full_attention_interval=interval,
    )


def _all_attention_fields(text: dict, need, head_dim: int, path: object) -> dict:
    """qwen3_moe: every layer full attention with plain RoPE over the whole head; no linear attention, no shared
    expert. RoPE scaling (YaRN) and sliding windows are refused: the layers would compute something else."""
    rope = _rope_params(text)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise fail(path, f"rope_scaling type {rope_type!r} is not supported (only plain RoPE)")
    if text.get("use_sliding_window", False):
        raise fail(path, "use_sliding_window = true is not supported")
    if head_dim % 2:
        raise fail(path, f"head_dim {head_dim} must be even (RoPE rotates pairs)")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise fail(path, "no rope_theta")
    n_layers = int(need("num_hidden_layers"))
    return dict(
        layer_types=(FULL,) * n_layers,
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=0, shared_expert_intermediate_size=0,
        rope_theta=float(theta), partial_rotary_factor=1.0, mrope_section=(head_dim // 2, 0, 0),
        full_attention_interval=1,
    )
