"""Model facts: everything derived from a checkpoint's config.json, in one place.

`ModelArgs` is the language model's shape and numerics; `quant_for` resolves the per-module quantization
overrides of an MLX export; `eos_ids` collects the stop tokens. The converter, the planner and the runtime
all read configs through this module, so a fact is derived once and a bad config fails the same way
everywhere: one `StreamoeError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import StreamoeError, fail

PREFIX = "language_model."
LINEAR, FULL = "linear_attention", "full_attention"


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

        n_layers = int(need("num_hidden_layers"))
        interval = int(text.get("full_attention_interval", 4))
        by_interval = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))
        layer_types = tuple(text.get("layer_types") or by_interval)
        if layer_types != by_interval:
            # mlx-lm/mlx-vlm place the layers by the interval; a config that disagrees would run differently.
            raise fail(path, f"layer_types {list(layer_types)} disagree with full_attention_interval {interval}"
            )
        if int(need("num_experts")) <= 0:
            raise fail(path, "num_experts must be > 0 (only the MoE model is supported)")
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
            raise fail(path, "dense MLP layers (mlp_only_layers / decoder_sparse_step) are not supported"
            )
        if text.get("attention_bias", False):
            raise fail(path, "attention_bias = true is not supported")

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise fail(path, f"rope type {rope_type!r} is not supported")
        if rope.get("mrope_interleaved", True) is False:
            raise fail(path, "only interleaved M-RoPE (mrope_interleaved = true) is supported")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise fail(path, "no rope_theta")
        prf = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        head_dim = int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        rot = int(head_dim * prf)
        section = tuple(int(s) for s in (rope.get("mrope_section") or (rot // 2, 0, 0)))
        if rot % 2 or len(section) != 3 or sum(section) != rot // 2:
            raise fail(path, f"mrope_section {list(section)} must have 3 parts summing to {rot // 2}"
            )

        quant = config.get("quantization") or config.get("quantization_config") or text.get("quantization")
        if not quant or "bits" not in quant or "group_size" not in quant:
            raise fail(path, "no quantization block (only quantized exports are supported)")
        if quant.get("mode", "affine") != "affine":
            raise fail(path, f"quantization mode {quant.get('mode')!r} is not supported")

        args = cls(
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(need("linear_conv_kernel_dim")),
            num_experts=int(need("num_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
            rms_norm_eps=float(need("rms_norm_eps")),
            vocab_size=int(need("vocab_size")),
            rope_theta=float(theta),
            partial_rotary_factor=prf,
            mrope_section=section,
            full_attention_interval=interval,
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            tie_word_embeddings=bool(
                config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            quantization=dict(quant),
            eos_token_ids=tuple(eos_ids(config)),
            model_type=str(config.get("model_type", text.get("model_type", "qwen3_5_moe"))),
        )
        if args.linear_num_value_heads % args.linear_num_key_heads:
            raise fail(path, "linear_num_value_heads must be a multiple of linear_num_key_heads")
        if args.num_attention_heads % args.num_key_value_heads:
            raise fail(path, "num_attention_heads must be a multiple of num_key_value_heads")
        return args

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
        """(bits, group_size) of a quantized module, e.g. 'language_model.model.layers.0.mlp.gate'."""
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
        return self.quant_params(f"{PREFIX}model.layers.{i}.mlp.switch_mlp.gate_proj")


    @property
    def n_full_attention(self) -> int:
        return sum(1 for t in self.layer_types if t == FULL)

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim
