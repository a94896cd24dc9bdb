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
- `gpt_oss` (gpt-oss-20b/120b): every layer attention with biases on q/k/v/o and a learned sink logit per head,
  alternating sliding-window and full attention (`layer_types`, `sliding_window`), RoPE with YaRN scaling over
  the whole head; every layer MoE with a biased router (softmax over the top-k logits), experts with biases and
  the clamped SwiGLU (alpha 1.702, limit 7: the constants mlx-lm computes with); MXFP4 routed experts
  (`mlp.experts.*`), the rest affine per the export's `quantization` block; `num_local_experts` and
  `intermediate_size` name the expert count and width. Tensors under `model.`/`lm_head`.
- `mixtral` (Mixtral-8x7B): every layer full attention (GQA, no biases, no per-head norms, plain RoPE over
  the whole head, a head of `hidden_size / num_attention_heads` as mlx-lm computes it), every layer MoE with a
  softmax over the top-k router logits and no shared expert, the routed experts under `block_sparse_moe.switch_mlp`
  and the router at `block_sparse_moe.gate`; `num_local_experts` and `intermediate_size` name the expert count and
  width. Tensors under `model.`/`lm_head`.
- `qwen3_next` (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): `qwen3_5_moe`'s layers (Qwen3.5 is built from it) with
  plain partial RoPE instead of M-RoPE, each Gated DeltaNet's input projections fused as the export keeps them
  (`in_proj_qkvz`, `in_proj_ba`, grouped by key head), no vision tower; a flat config.json and tensors under
  `model.`/`lm_head`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import StreamoeError, fail

PREFIX = "language_model."  # where a qwen3_5_moe export keeps its language model's tensors
LINEAR, FULL, SLIDING = "linear_attention", "full_attention", "sliding_attention"
FAMILIES = ("qwen3_5_moe", "qwen3_moe", "gpt_oss", "mixtral", "qwen3_next")  # the model_types streamoe runs
TENSOR_PREFIX = {"qwen3_5_moe": PREFIX, "qwen3_moe": "", "gpt_oss": "", "mixtral": "", "qwen3_next": ""}
# where a layer's routed experts sit under `model.layers.N.` (mlx-lm's SwitchGLU, by the name its family gives it)
EXPERTS_MODULE = {"qwen3_5_moe": "mlp.switch_mlp", "qwen3_moe": "mlp.switch_mlp", "gpt_oss": "mlp.experts",
                  "mixtral": "block_sparse_moe.switch_mlp", "qwen3_next": "mlp.switch_mlp"}
# families whose routed experts have biases on gate, up and down (mlx-lm's SwitchGLU(bias=True))
EXPERT_BIAS = ("gpt_oss",)
# the text-config keys that give the expert count and width, where a family names them otherwise
EXPERT_KEYS = {"gpt_oss": ("num_local_experts", "intermediate_size"), "mixtral": ("num_local_experts", "intermediate_size")}
DEFAULT_EXPERT_KEYS = ("num_experts", "moe_intermediate_size")


def text_config(config: dict) -> dict:
    """The language model's config: nested `text_config` in VLM exports, else the top level."""
    text = config.get("text_config", config)
    return text if isinstance(text, dict) else {}


def is_expert_tensor(name: str, model_type: str) -> bool:
    """Whether a tensor of a `model_type` export is one of the stacked routed experts (the expert records')."""
    return f".{EXPERTS_MODULE.get(model_type, 'mlp.switch_mlp')}." in name


def family_of(config: dict) -> str | None:
    """The config's `model_type` as a family name (Qwen3.5's text-only export says `qwen3_5_moe_text`)."""
    text = text_config(config)
    mt = config.get("model_type", text.get("model_type", "qwen3_5_moe"))
    return {"qwen3_5_moe_text": "qwen3_5_moe"}.get(mt, mt) if isinstance(mt, str) else None


def expert_keys(config: dict) -> tuple[str, str]:
    """(count key, width key) of the config's routed experts: `num_experts`/`moe_intermediate_size`, or the
    family's own names (gpt-oss: `num_local_experts`/`intermediate_size`)."""
    return EXPERT_KEYS.get(family_of(config) or "", DEFAULT_EXPERT_KEYS)


def quant_mode(quant: dict, module: str) -> str:
    """A module's quantization mode: its own entry's `mode` (absent there: affine, as mlx-lm's `to_quantized`
    defaults it), else the block's top-level mode (absent: affine)."""
    o = quant.get(module)
    if isinstance(o, dict):
        return str(o.get("mode", "affine"))
    return str(quant.get("mode", "affine"))


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
    sliding_window: int = 0  # keys a sliding_attention layer's query sees (itself included); 0: none
    yarn: tuple[float, ...] = ()  # YaRN (factor, original context, beta_fast, beta_slow, mscale, mscale_all_dim)
    swiglu_limit: float = 0.0  # the clamped SwiGLU's limit (gpt-oss); 0: plain SwiGLU
    swiglu_alpha: float = 0.0

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

        model_type = family_of(config)
        if model_type not in FAMILIES:
            mt = config.get("model_type", text.get("model_type"))
            what = "has no model_type" if mt is None else f"unsupported model_type {str(mt)[:40]!r}"
            raise fail(path, f"{what} (supported: {', '.join(FAMILIES)})")
        n_key, width_key = expert_keys(config)
        if int(need(n_key)) <= 0:
            raise fail(path, f"{n_key} must be > 0 (only the MoE model is supported)")
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
            raise fail(path, "dense MLP layers (mlp_only_layers / decoder_sparse_step) are not supported"
            )
        if model_type != "gpt_oss" and text.get("attention_bias", False):
            raise fail(path, "attention_bias = true is not supported")
        head_dim = int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        family = {"qwen3_5_moe": _hybrid_fields, "qwen3_moe": _all_attention_fields, "gpt_oss": _gpt_oss_fields,
                  "mixtral": _mixtral_fields, "qwen3_next": _hybrid_fields}
        fields = family[model_type](text, need, head_dim, path)

        quant = config.get("quantization") or config.get("quantization_config") or text.get("quantization")
        if not quant or "bits" not in quant or "group_size" not in quant:
            raise fail(path, "no quantization block (only quantized exports are supported)")
        modes = QUANT_MODES.get(model_type, ("affine",))
        if quant.get("mode", "affine") not in modes:
            raise fail(path, f"unsupported quantization mode {str(quant.get('mode'))[:40]!r} for {model_type} "
                             f"(supported: {', '.join(modes)})")

        args = cls(
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            num_experts=int(need(n_key)),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need(width_key)),
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
        if not 0 < args.num_experts_per_tok <= args.num_experts:
            raise fail(path, f"num_experts_per_tok = {args.num_experts_per_tok} must be in 1..{args.num_experts}")
        if model_type == "gpt_oss" and args.tie_word_embeddings:
            raise fail(path, "tie_word_embeddings = true is not supported for gpt_oss (mlx-lm's gpt_oss always has lm_head)")
        expert_modes = {args.expert_mode(i) for i in range(args.num_hidden_layers)}
        if not expert_modes <= set(modes) or len(expert_modes) != 1:
            raise fail(path, f"routed experts quantized as {', '.join(sorted(expert_modes))[:60]}: not supported "
                             f"(one of {', '.join(modes)} for every layer)")
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
        """(bits, group_size) of an affine-quantized module, e.g. 'language_model.model.layers.0.mlp.gate' (the
        full name, with the family's `prefix`)."""
        q = self.quantization or {}
        mode = quant_mode(q, module)
        if mode != "affine":
            raise StreamoeError(f"{module}: quantization mode {mode!r} is not supported here (affine only)")
        bg = quant_for(q, module)
        if bg is None:
            raise StreamoeError(f"{module}: left unquantized by the export; not supported")
        return bg

    def experts_module(self, i: int) -> str:
        """The stacked routed experts of layer i, e.g. 'model.layers.3.mlp.experts' (gate_proj etc. under it)."""
        return f"{self.prefix}model.layers.{i}.{EXPERTS_MODULE[self.model_type]}"

    def expert_quant(self, i: int) -> tuple[int, int]:
        """(bits, group_size) of layer i's routed experts, as the export's config states them: mxfp4 is 4 bits in
        groups of 32 whatever the block's numbers say (its only form)."""
        module = self.experts_module(i) + ".gate_proj"
        if self.expert_mode(i) == "mxfp4":
            return 4, 32
        return self.quant_params(module)

    def expert_mode(self, i: int) -> str:
        """The quantization mode of layer i's routed experts: affine or mxfp4."""
        return quant_mode(self.quantization or {}, self.experts_module(i) + ".gate_proj")

    @property
    def expert_bias(self) -> bool:
        """Whether the routed experts' projections have biases (stored in the expert record)."""
        return self.model_type in EXPERT_BIAS

    @property
    def expert_format(self) -> str:
        """The expert format a conversion writes by default: the one the checkpoint holds (mxfp4 for an MXFP4
        export, else q4)."""
        return "mxfp4" if self.expert_mode(0) == "mxfp4" else "q4"

    @property
    def attention_sinks(self) -> bool:
        """Whether every attention head has a learned sink logit joining its softmax (gpt-oss)."""
        return self.model_type == "gpt_oss"

    @property
    def n_full_attention(self) -> int:
        return sum(1 for t in self.layer_types if t == FULL)

    @property
    def n_kv_layers(self) -> int:
        """Layers that keep keys and values (full and sliding-window attention; each a cache of the context)."""
        return sum(1 for t in self.layer_types if t in (FULL, SLIDING))

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


# the quantization modes a family's export may use (its block's top level and its experts): mlx-lm's gpt-oss export
# keeps the checkpoint's MXFP4 experts and says mxfp4 at the top level (every other module has its affine entry)
QUANT_MODES = {"gpt_oss": ("affine", "mxfp4")}


def _rope_params(text: dict) -> dict:
    return dict(text.get("rope_parameters") or text.get("rope_scaling") or {})


def _hybrid_fields(text: dict, need, head_dim: int, path: object) -> dict:
    """qwen3_5_moe, qwen3_next: Gated DeltaNet and gated full attention by the interval, partial M-RoPE (qwen3_next's
    config gives no sections: all the rotary dims on the token index, which is plain RoPE), a shared expert."""
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


# gpt-oss: mlx-lm's SwigluOAI constants (it does not read the config's swiglu_limit; a config saying otherwise would
# compute something else there, so it is refused)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def _gpt_oss_fields(text: dict, need, head_dim: int, path: object) -> dict:
    """gpt_oss: sliding-window and full attention alternating as `layer_types` says (mlx-lm's default when absent:
    sliding first), YaRN RoPE (mlx-lm's YarnRoPE: its floor/ceil correction range, `truncate` not read), biased
    experts with the clamped SwiGLU."""
    n_layers = int(need("num_hidden_layers"))
    layer_types = text.get("layer_types") or [SLIDING, FULL] * (n_layers // 2)
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or any(t not in (SLIDING, FULL) for t in layer_types):
        raise fail(path, f"layer_types must name {n_layers} layers, each sliding_attention or full_attention")
    if SLIDING not in layer_types or FULL not in layer_types:
        raise fail(path, "layer_types must hold both sliding_attention and full_attention layers (as mlx-lm's gpt_oss needs)")
    window = text.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise fail(path, f"sliding_window must be a positive integer, got {str(window)[:40]}")
    if head_dim % 2:
        raise fail(path, f"head_dim {head_dim} must be even (RoPE rotates pairs)")
    limit = text.get("swiglu_limit", SWIGLU_LIMIT)
    if limit != SWIGLU_LIMIT:
        raise fail(path, f"swiglu_limit {str(limit)[:40]} is not supported (mlx-lm's gpt_oss computes with {SWIGLU_LIMIT})")
    rope = dict(text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn: tuple[float, ...] = ()
    if rope_type == "yarn":
        try:
            yarn = (float(rope["factor"]), float(rope.get("original_max_position_embeddings", 4096)),
                    float(rope.get("beta_fast", 32)), float(rope.get("beta_slow", 1)), float(rope.get("mscale", 1)),
                    float(rope.get("mscale_all_dim", 0)))
        except KeyError:
            raise fail(path, "rope_scaling of type yarn has no factor") from None
        if yarn[0] <= 0 or yarn[1] <= 0 or yarn[2] <= 0 or yarn[3] <= 0:
            raise fail(path, "rope_scaling: factor, original_max_position_embeddings, beta_fast and beta_slow must be > 0")
    elif rope_type != "default":
        raise fail(path, f"rope_scaling type {rope_type!r} is not supported (gpt_oss: yarn or none)")
    theta = text.get("rope_theta")
    if theta is None:
        raise fail(path, "no rope_theta")
    return dict(
        layer_types=tuple(layer_types),
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=0, shared_expert_intermediate_size=0,
        rope_theta=float(theta), partial_rotary_factor=1.0, mrope_section=(head_dim // 2, 0, 0),
        full_attention_interval=1, sliding_window=window, yarn=yarn,
        swiglu_limit=SWIGLU_LIMIT, swiglu_alpha=SWIGLU_ALPHA,
    )


def _mixtral_fields(text: dict, need, head_dim: int, path: object) -> dict:
    """mixtral: every layer full attention with plain RoPE over a head of hidden_size / num_attention_heads (mlx-lm's
    mixtral computes that width whatever the config says). What mlx-lm's mixtral does not compute (RoPE scaling, a
    sliding window, traditional RoPE pairing, another head width) is refused rather than run differently."""
    width = int(need("hidden_size")) // int(need("num_attention_heads"))
    if head_dim != width:
        raise fail(path, f"head_dim {head_dim} is not supported for mixtral (mlx-lm computes with hidden_size / "
                         f"num_attention_heads = {width})")
    if text.get("rope_scaling"):
        raise fail(path, "rope_scaling is not supported for mixtral (mlx-lm's mixtral computes plain RoPE)")
    if text.get("sliding_window") is not None:
        raise fail(path, "sliding_window is not supported for mixtral (mlx-lm's mixtral attends to the whole context)")
    if text.get("rope_traditional", False):
        raise fail(path, "rope_traditional = true is not supported (only RoPE's rotate-half pairing)")
    return _all_attention_fields(text, need, head_dim, path)
