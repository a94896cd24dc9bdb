"""runtime/models/qwen3_5_moe.py and the kernels it is built from against mlx-lm's qwen3_5_moe on a tiny faithful
checkpoint (real MLX, no mocks).

The checkpoint has the tiny faithful config (`streamoe synth --size tiny`, text part): 6 Gated DeltaNet + 2 gated attention
layers, 8 experts top-2, 4-bit group 64 with 8-bit router and shared-expert gate, bf16 scales/biases/norms,
bf16 A_log. It is built with mlx-lm's own model class and quantizer, written with mx.save_safetensors and
read back, so the runtime sees the tensors exactly as an export stores them.

Bounds below are stated relative to the largest |value| compared. Measured with mlx 0.32.4 / mlx-lm 0.32.2
on the CPU backend: the teacher-forced logits equal mlx-lm's bit for bit (max |diff| 0.0), one-call,
7-token-chunk and token-by-token prefill give identical logits (0.0), the chunked delta rule differs from the
token loop by ~1e-6 relative. The asserted bounds leave headroom over those figures but stay tight.
"""

from __future__ import annotations

import collections
import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3_5_moe
from mlx_lm.utils import quantize_model

from bench.common import random_experts
from bench.gpu_parts import graph_ops
from streamoe.formats.config import PREFIX, ModelArgs
from streamoe.formats.errors import StreamoeError
from streamoe.formats.record import ExpertWeights
from streamoe.runtime.models import family, forward, kernels
from streamoe.runtime.models.delta_rule import gated_delta_chunked, gated_delta_loop
from streamoe.runtime.models.kernels import (
    BLAS_TOKENS,
    ExpertKernel,
    MRoPE,
    ResidentExperts,
    _switch_glu,
    clamped_swiglu,
    combine,
    swiglu,
    switch_glu,
    text_positions,
)
from streamoe.runtime.models.qwen3_5_moe import Model

TOL_REF = 1e-5  # vs mlx-lm, relative to max |logit| (measured 0.0)
TOL_CHUNKING = 1e-5  # one call vs chunks of 7 vs token by token (measured 0.0)
TOL_GDN_CHUNKED = 2e-5  # chunked delta rule vs token loop (measured <= 1.5e-6 on random inputs, 3e-7 on logits)
N_LAYERS = 8


def tiny_config() -> dict:
    text = {
        "attention_bias": False,
        "attn_output_gate": True,
        "bos_token_id": 512,
        "dtype": "bfloat16",
        "eos_token_id": 512,
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 64,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(N_LAYERS)
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 64,
        "num_attention_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": N_LAYERS,
        "num_key_value_heads": 1,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "shared_expert_intermediate_size": 64,
        "vocab_size": 576,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "eos_token_id": [514, 512],
        "image_token_id": 524,
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
    }


def random_weights(model, rng) -> list[tuple[str, mx.array]]:
    """bf16 weights with sane scales: projections std 0.02, norms ~1, A_log = log U(1, 16)."""
    out = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("A_log"):
            v = np.log(rng.uniform(1, 16, p.shape))
        elif name.endswith("dt_bias"):
            v = rng.uniform(-1, 1, p.shape)
        elif name.endswith("norm.weight"):
            v = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif "conv1d" in name:
            v = 0.3 * rng.standard_normal(p.shape)
        elif "embed_tokens" in name:
            v = rng.standard_normal(p.shape)
        else:
            v = 0.02 * rng.standard_normal(p.shape)
        out.append((name, mx.array(v.astype(np.float32)).astype(mx.bfloat16)))
    return out


class Tiny:
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config()
    ref = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(copy.deepcopy(cfg)))
    ref.update(tree_unflatten(random_weights(ref, np.random.default_rng(0))))
    ref, cfg = quantize_model(ref, cfg, group_size=64, bits=4)  # 8-bit mlp.gate / shared_expert_gate
    params = dict(tree_flatten(ref.parameters()))
    assert all(k.startswith(PREFIX) for k in params)  # mlx-lm names are the export names

    d = tmp_path_factory.mktemp("tiny")
    mx.save_safetensors(str(d / "model.safetensors"), params, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(cfg, indent=4, sort_keys=True))
    config = json.loads((d / "config.json").read_text())
    stored = mx.load(str(d / "model.safetensors"))
    assert stored[f"{PREFIX}model.layers.0.mlp.gate.scales"].dtype == mx.bfloat16
    assert stored[f"{PREFIX}model.layers.0.linear_attn.A_log"].dtype == mx.bfloat16

    t = Tiny()
    t.config = config
    t.args = ModelArgs.from_config(config)
    t.nonexpert = {k: v for k, v in stored.items() if ".mlp.switch_mlp." not in k}
    t.experts_w = {k: v for k, v in stored.items() if ".mlp.switch_mlp." in k}
    t.model = Model(t.args, dict(t.nonexpert))
    t.experts = ResidentExperts(t.args, t.experts_w, mx.float32)
    ref.set_dtype(mx.float32)
    t.ref = ref
    t.prompt = mx.array(np.random.default_rng(1).integers(0, 576, size=(1, 40)), dtype=mx.int32)
    return t


def rel_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item() / max(mx.abs(b).max().item(), 1e-30)


# --------------------------------------------------------------------------------------------------
# the whole model against mlx-lm


def test_config(tiny):
    a = tiny.args
    assert a.layer_types == tuple(tiny_config()["text_config"]["layer_types"])
    assert [a.is_linear(i) for i in range(N_LAYERS)] == [True, True, True, False] * 2
    assert (a.rotary_dim, a.mrope_section, a.rope_theta) == (16, (3, 3, 2), 1e7)
    assert a.eos_token_ids == (514, 512)
    assert a.quant_params(f"{PREFIX}model.layers.5.mlp.gate") == (8, 64)
    assert a.quant_params(f"{PREFIX}model.layers.5.mlp.shared_expert_gate") == (8, 64)
    assert a.quant_params(f"{PREFIX}model.layers.5.linear_attn.in_proj_qkv") == (4, 64)
    assert a.expert_quant(2) == (4, 64)

    # a text-only export: same keys without vision_config, rope "type" instead of "rope_type"
    text_only = copy.deepcopy(tiny.config)
    text_only["text_config"]["rope_parameters"]["type"] = text_only["text_config"]["rope_parameters"].pop(
        "rope_type"
    )
    assert ModelArgs.from_config(text_only) == a
    # a flat config (no text_config) reads the same
    flat = {**copy.deepcopy(tiny.config["text_config"]), "quantization": tiny.config["quantization"]}
    flat["eos_token_id"], flat["model_type"] = [514, 512], "qwen3_5_moe"
    assert ModelArgs.from_config(flat) == a

    bad = copy.deepcopy(tiny.config)
    bad["text_config"]["layer_types"][0] = "full_attention"
    with pytest.raises(StreamoeError, match="layer_types"):
        ModelArgs.from_config(bad)


def test_matches_mlx_lm_teacher_forced(tiny):
    """40-token prefill + 24 greedy decode steps, the reference's tokens fed to both."""
    m, ref = tiny.model, tiny.ref
    ref_cache, cache = ref.make_cache(), m.make_cache(128)
    worst = 0.0
    checked = 0
    tokens = tiny.prompt
    for step in range(25):
        want = ref(tokens, cache=ref_cache)
        got = forward(m, tokens, cache, tiny.experts)
        mx.eval(want, got)
        assert got.shape == want.shape and got.dtype == mx.float32
        worst = max(worst, rel_diff(got, want))
        # greedy choice must agree wherever the top-2 gap exceeds the error bound
        scale = mx.abs(want).max().item()
        top2 = np.sort(np.array(want[0]), axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * TOL_REF * scale
        same = np.array(mx.argmax(got[0], axis=-1) == mx.argmax(want[0], axis=-1))
        assert same[clear].all(), f"step {step}: greedy token differs"
        checked += int(clear.sum())
        tokens = mx.argmax(want[:, -1:], axis=-1)
    assert worst <= TOL_REF, f"max relative logit difference {worst:.3g}"
    assert checked >= 50
    assert cache[0].offset == cache[3].offset == 40 + 24


def test_deterministic(tiny):
    m = tiny.model
    a = forward(m, tiny.prompt, m.make_cache(64), tiny.experts)
    b = forward(m, tiny.prompt, m.make_cache(64), tiny.experts)
    assert mx.array_equal(a, b)


def test_prefill_chunking(tiny):
    """One call vs chunks of 7 vs token by token, then one decode step from each cache."""
    m, prompt = tiny.model, tiny.prompt
    results = {}
    for size in (40, 7, 1):
        cache = m.make_cache(64)
        logits = [forward(m, prompt[:, s : s + size], cache, tiny.experts) for s in range(0, 40, size)]
        nxt = forward(m, mx.array([[17]], dtype=mx.int32), cache, tiny.experts)
        results[size] = mx.concatenate([*logits, nxt], axis=1)
        mx.eval(results[size])
    for size in (7, 1):
        d = rel_diff(results[size], results[40])
        assert d <= TOL_CHUNKING, f"chunks of {size}: {d:.3g}"


def test_gdn_chunked_form_in_model(tiny):
    """Prefill of 150 tokens (3 chunks of 64, padded) with the chunked delta rule vs the token loop."""
    loop = tiny.model
    chunked = Model(tiny.args, dict(tiny.nonexpert), gdn_chunked=True)
    prompt = mx.array(np.random.default_rng(2).integers(0, 576, size=(1, 150)), dtype=mx.int32)
    c1, c2 = loop.make_cache(160), chunked.make_cache(160)
    a = forward(loop, prompt, c1, tiny.experts)
    b = forward(chunked, prompt, c2, tiny.experts)
    assert rel_diff(b, a) <= TOL_GDN_CHUNKED
    assert rel_diff(c2[0].state, c1[0].state) <= TOL_GDN_CHUNKED
    nxt = mx.array([[3]], dtype=mx.int32)
    assert (
        rel_diff(forward(chunked, nxt, c2, tiny.experts), forward(loop, nxt, c1, tiny.experts))
        <= TOL_GDN_CHUNKED
    )


@pytest.mark.parametrize("L", [65, 128, 150])
def test_gdn_chunked_vs_loop(L):
    """The chunked (WY) delta rule against the token loop on random inputs with a nonzero start state."""
    rng = np.random.default_rng(L)
    B, H, dk, dv = 2, 4, 32, 16

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    k = arr(B, L, H, dk)
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    q = arr(B, L, H, dk)
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    v = arr(B, L, H, dv)
    log_g = -mx.exp(mx.array(rng.uniform(0, 2.7, H).astype(np.float32))) * mx.logaddexp(arr(B, L, H), 0)
    beta = mx.sigmoid(arr(B, L, H))
    s0 = 0.1 * arr(B, H, dv, dk)
    y1, s1 = gated_delta_loop(q, k, v, log_g, beta, s0)
    y2, s2 = gated_delta_chunked(q, k, v, log_g, beta, s0)
    assert y2.shape == y1.shape == (B, L, H, dv) and s2.shape == s1.shape
    assert rel_diff(y2, y1) <= TOL_GDN_CHUNKED
    assert rel_diff(s2, s1) <= TOL_GDN_CHUNKED


def test_fused_delta_rule_op_is_the_token_loop_on_the_cpu():
    """`mx.fast.gated_delta_update` (what decode runs on the CPU and Metal) against our token loop, float32,
    grouped heads: on the CPU backend they are the same arithmetic, bit for bit (CUDA runs its own kernel,
    which tests/test_gpu.py checks against the loop and mlx-lm)."""
    rng = np.random.default_rng(7)
    B, L, Hk, Hv, dk, dv = 1, 5, 2, 4, 32, 16

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    device = mx.default_device()
    mx.set_default_device(mx.cpu)  # the claim is the CPU backend's, on any machine
    try:
        q, k, v = 0.2 * arr(B, L, Hk, dk), 0.2 * arr(B, L, Hk, dk), arr(B, L, Hv, dv)
        log_g, beta, s0 = -0.1 * mx.abs(arr(B, L, Hv)), mx.sigmoid(arr(B, L, Hv)), 0.1 * arr(B, Hv, dv, dk)
        y, s = mx.fast.gated_delta_update(q, k, v, mx.exp(log_g), beta, s0)
        y_ref, s_ref = gated_delta_loop(mx.repeat(q, 2, axis=2), mx.repeat(k, 2, axis=2), v, log_g, beta, s0)
        assert mx.array_equal(y, y_ref) and mx.array_equal(s, s_ref)
    finally:
        mx.set_default_device(device)


def test_fused_projections_equal_separate_ones(tiny):
    """Projections that read the same input run as one matmul per quantization: every output equals its own
    layer's, bit for bit (the 8-bit router and output gate, the 4-bit shared gate/up: two matmuls)."""
    from streamoe.runtime.models.kernels import Loader, Projections, QLinear

    p = f"{PREFIX}model.layers.2.mlp."
    a = tiny.args
    modules = [(f"{p}gate", a.num_experts), (f"{p}shared_expert.gate_proj", a.shared_expert_intermediate_size),
               (f"{p}shared_expert.up_proj", a.shared_expert_intermediate_size), (f"{p}shared_expert_gate", 1)]
    ld = Loader(a, tiny.nonexpert, mx.float32)
    fused = Projections(ld, modules, a.hidden_size)
    assert len(fused.linears) == 2  # 8-bit and 4-bit
    x = mx.random.normal((1, 3, a.hidden_size), key=mx.random.key(9))
    for (module, out_dims), got in zip(modules, fused(x), strict=True):
        want = QLinear(*ld.quantized(module, out_dims, a.hidden_size))(x)
        assert got.shape == want.shape and mx.array_equal(got, want), module


def test_kv_cache(tiny):
    m = tiny.model
    cache = m.make_cache(40, kv_dtype=mx.float16)
    assert cache[3].keys.shape == (1, 1, 40, 64) and cache[3].keys.dtype == mx.float16
    assert cache[0].state.dtype == mx.float32 and cache[0].conv.shape == (1, 3, tiny.args.conv_dim)
    f16 = forward(m, tiny.prompt, cache, tiny.experts)
    f32 = forward(m, tiny.prompt, m.make_cache(40), tiny.experts)
    assert rel_diff(f16, f32) < 1e-2  # f16 keys/values: rounding only
    with pytest.raises(StreamoeError, match="KV cache holds 40 tokens; 41"):
        forward(m, tiny.prompt[:, :1], cache, tiny.experts)
    assert [c.offset for c in cache] == [40] * N_LAYERS  # nothing moved


# --------------------------------------------------------------------------------------------------
# pieces


def test_mrope_text_equals_rope():
    """All three position rows equal: bit-identical to mx.fast.rope (non-traditional) on the rotary dims."""
    x = mx.random.normal((2, 4, 37, 256), key=mx.random.key(0))
    for dims, base, section in ((64, 1e7, (11, 11, 10)), (16, 1e7, (3, 3, 2)), (64, 5e6, (11, 11, 10))):
        rope = MRoPE(dims, base, section)
        for offset in (0, 1000, 200_000):
            cos, sin = rope.cos_sin(text_positions(offset, 37, batch=2))
            want = mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=offset)
            assert mx.array_equal(rope(x, (cos, sin)), want), (dims, base, offset)
            assert mx.array_equal(rope(x, rope.prepare(offset)), want)  # plain text takes the kernel itself


def test_mrope_image_positions_match_mlx_vlm():
    """Distinct t/h/w rows: the interleaved sections as mlx-vlm's qwen3_5 applies them (its inverse
    frequencies are computed differently, hence a rounding-level bound at small positions)."""
    from mlx_vlm.models.qwen3_5.language import Qwen3_5RotaryEmbedding

    rng = np.random.default_rng(0)
    pos = mx.array(rng.integers(0, 64, size=(3, 2, 30)), dtype=mx.int32)
    q = mx.random.normal((2, 4, 30, 256), key=mx.random.key(1))
    k = mx.random.normal((2, 2, 30, 256), key=mx.random.key(2))
    want_q, want_k = Qwen3_5RotaryEmbedding(64, base=1e7, mrope_section=[11, 11, 10]).apply_rotary(q, k, pos)
    rope = MRoPE(64, 1e7, (11, 11, 10))
    cos, sin = rope.cos_sin(pos)
    assert mx.abs(rope(q, (cos, sin)) - want_q).max().item() < 1e-5
    assert mx.abs(rope(k, (cos, sin)) - want_k).max().item() < 1e-5
    assert mx.array_equal(rope(q, (cos, sin))[..., 64:], q[..., 64:])  # pass-through dims untouched


def test_text_positions():
    p = text_positions(5, 3, batch=2)
    assert p.shape == (3, 2, 3) and p.dtype == mx.int32
    assert np.array(p).tolist() == [[[5, 6, 7]] * 2] * 3


def test_switch_glu_matches_mlx_lm_per_expert(tiny):
    """Each expert through our stacked-weights path against mlx-lm's SwitchGLU on the same weights."""
    x = mx.random.normal((5, 64), key=mx.random.key(3))
    for layer in (0, 3):
        switch = tiny.ref.language_model.model.layers[layer].mlp.switch_mlp
        weights = tiny.experts.layers[layer]
        for e in range(tiny.args.num_experts):
            idx = mx.full((5, 1), e, dtype=mx.uint32)
            got = switch_glu(x, weights, idx, tiny.experts.kernel)[:, 0]
            assert rel_diff(got, switch(x, idx)[:, 0]) <= 1e-6, (layer, e)


def test_route_and_resident_experts_match_mlx_lm(tiny):
    """route() + ResidentExperts against mlx-lm's SparseMoeBlock arithmetic for the routed part."""
    m = tiny.model
    x = mx.random.normal((1, 9, 64), key=mx.random.key(4))
    block = tiny.ref.language_model.model.layers[1].mlp
    inds, scores = m.route(m.router_logits(1, x))
    assert inds.dtype == mx.uint32 and scores.dtype == mx.float32 and inds.shape == (1, 9, 2)
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    want_inds = mx.argpartition(gates, kth=-2, axis=-1)[..., -2:]
    assert mx.array_equal(inds, want_inds)  # same experts in the same (router-rank) order
    assert mx.abs(scores.sum(axis=-1) - 1).max().item() < 1e-6
    top = np.sort(np.argsort(-np.array(gates), axis=-1)[..., :2], axis=-1)
    assert (np.sort(np.array(inds), axis=-1) == top).all()

    want = (block.switch_mlp(x, want_inds) * scores[..., None]).sum(axis=-2)
    got = combine(tiny.experts(1, x, inds), scores)
    assert rel_diff(got, want) <= 1e-6


def test_a_decode_step_builds_no_batch_indices_and_no_window_copies(tiny, monkeypatch):
    """One token through a Gated DeltaNet layer and its routed experts: `gather_qmm` is handed its batch indices
    (left out, each of its three calls builds an `arange`: a kernel on a GPU), and the convolution's window is
    handed on as rows, neither joined to the token nor copied; a call of several tokens still joins them. The
    kernels a step encodes are a GPU's decode time (docs/performance.md); the values are the same either way."""
    m, experts = tiny.model, tiny.experts
    layer = next(lay for lay in m.layers if lay.is_linear)
    cache = m.make_cache(16)[layer.i]

    def step(tokens: int) -> collections.Counter:
        h = mx.random.normal((1, tokens, tiny.args.hidden_size), key=mx.random.key(tokens))
        h, x, inds, *_, rows, state = layer.gdn_front(h, cache.rows, cache.state)
        return collections.Counter(graph_ops(experts(layer.i, x, inds), h, *rows, state)["by_kind"])

    one = step(1)
    assert one["GatherQMM"] == 3 and one["Arange"] == 0
    assert one["Concatenate"] == 0 and one["Contiguous"] == 0
    several = step(3)
    assert several["Concatenate"] >= 1 and several["Contiguous"] == 1  # a prefill joins the window to its tokens
    kernels.batch_indices.cache_clear()
    monkeypatch.setattr(kernels, "BATCH_INDICES_MAX", 0)  # gather_qmm left to make its own
    assert step(1)["Arange"] == 3
    kernels.batch_indices.cache_clear()


def test_combine_is_reproducible():
    outs = mx.random.normal((3, 5, 8, 64), key=mx.random.key(5))
    scores = mx.softmax(mx.random.normal((3, 5, 8), key=mx.random.key(6)), axis=-1)
    a = combine(outs, scores)
    assert a.shape == (3, 5, 64)
    assert mx.array_equal(a, combine(outs, scores))
    # the same token gives the same bits whatever else is in the batch
    assert mx.array_equal(a[1, 2], combine(outs[1, 2], scores[1, 2]))
    assert mx.array_equal(a[:, 1:3], combine(outs[:, 1:3], scores[:, 1:3]))
    assert mx.abs(a - (outs * scores[..., None]).sum(axis=-2)).max().item() < 1e-6


# --------------------------------------------------------------------------------------------------
# bad weights


def test_missing_tensor_is_named(tiny):
    for name in (
        f"{PREFIX}model.layers.3.self_attn.k_norm.weight",
        f"{PREFIX}model.layers.6.linear_attn.in_proj_b.scales",
        f"{PREFIX}lm_head.biases",
    ):
        weights = {k: v for k, v in tiny.nonexpert.items() if k != name}
        with pytest.raises(StreamoeError, match=f"missing tensor {name}"):
            Model(tiny.args, weights)
    name = f"{PREFIX}model.layers.2.mlp.switch_mlp.down_proj.weight"
    with pytest.raises(StreamoeError, match=f"missing tensor {name}"):
        ResidentExperts(tiny.args, {k: v for k, v in tiny.experts_w.items() if k != name}, mx.float32)


def test_wrong_shape_or_bits_is_named(tiny):
    name = f"{PREFIX}model.layers.1.linear_attn.conv1d.weight"
    weights = {**tiny.nonexpert, name: mx.zeros((tiny.args.conv_dim, 1, 4), dtype=mx.bfloat16)}
    with pytest.raises(StreamoeError, match=name):
        Model(tiny.args, weights)

    # the router is 8-bit; a config claiming 4 bits must be caught from the shapes
    cfg = copy.deepcopy(tiny.config)
    del cfg["quantization"][f"{PREFIX}model.layers.4.mlp.gate"]
    cfg.pop("quantization_config", None)
    with pytest.raises(StreamoeError, match=rf"{PREFIX}model\.layers\.4\.mlp\.gate\.weight.*8 bits"):
        Model(ModelArgs.from_config(cfg), dict(tiny.nonexpert))


def test_family_is_chosen_by_model_type():
    from streamoe.runtime.models import qwen3_5_moe as family_module

    assert family("qwen3_5_moe") is family_module and family_module.Model is Model
    with pytest.raises(StreamoeError, match="model_type 'llama' is not a family streamoe runs"):
        family("llama")


def test_plain_rope_is_mlx_lms_rope():
    """`kernels.RoPE` (families with plain token positions) rotates as mlx-lm's `nn.RoPE` does, at any offset."""
    import mlx.nn as nn

    from streamoe.runtime.models.kernels import RoPE

    x = mx.random.normal((1, 4, 5, 64), key=mx.random.key(3))
    ours, peer = RoPE(64, 1e6), nn.RoPE(64, traditional=False, base=1e6)
    for offset in (0, 17):
        assert mx.array_equal(ours(x, ours.prepare(offset)), peer(x, offset=offset))
    partial = RoPE(32, 1e4)  # the first 32 dims rotate, the rest pass through
    assert mx.array_equal(partial(x, 3)[..., 32:], x[..., 32:]) and not mx.array_equal(partial(x, 3), x)


@pytest.mark.parametrize("mode,bias,block", [("affine", False, 1024), ("mxfp4", True, 1024), ("affine", False, 48)])
def test_prefill_experts_through_blas_match_gather_qmm_and_ignore_slot_numbers(mode, bias, block, monkeypatch):
    """Many tokens on the CPU take the experts expert by expert through numpy's BLAS: the same values as the
    quantized kernel's per-row path (within float32 rounding), with gpt-oss's expert biases and clamped SwiGLU
    too; and bit for bit the same whichever slots hold the experts (a capped run places them elsewhere). With a
    dequantized block smaller than an expert's matrix (`block` 48 rows), each matrix goes in row blocks."""
    monkeypatch.setattr(kernels, "BLAS_BLOCK", block)
    n_exp, hidden, inter, k, n = 6, 64, 128, 2, 2 * BLAS_TOKENS + 3
    w = random_experts(n_exp, hidden, inter, mode=mode, bias=bias, key=11)
    kernel = ExpertKernel(4, 32 if mode == "mxfp4" else 64, mode, clamped_swiglu(1.702, 7.0) if bias else swiglu)
    x = mx.random.normal((n, hidden), key=mx.random.key(5))
    picks = mx.array(np.stack([np.random.default_rng(t).choice(n_exp - 1, k, replace=False) for t in range(n)]),
                     dtype=mx.uint32)  # expert n_exp - 1 is never picked
    got = switch_glu(x, w, picks, kernel)
    assert got.shape == (n, k, hidden) and rel_diff(got, _switch_glu(x, w, picks, kernel)) <= 1e-5
    perm = np.random.default_rng(1).permutation(n_exp)  # slot perm[e] holds expert e
    inv = np.argsort(perm)
    moved = ExpertWeights(*(None if a is None else a[mx.array(inv)] for a in w))
    assert mx.array_equal(switch_glu(x, moved, mx.array(perm)[picks], kernel), got)
    assert mx.array_equal(switch_glu(x[:1], w, picks[:1], kernel), _switch_glu(x[:1], w, picks[:1], kernel))
    # another rank's picks filled with an expert of this one (ranks.RankExperts): that expert's group grows, and
    # every row that was there keeps its bits
    filled = np.array(picks)
    filled[:7, 1] = filled[0, 0]
    again = switch_glu(x, w, mx.array(filled), kernel)
    assert mx.array_equal(again[7:], got[7:]) and mx.array_equal(again[:, 0], got[:, 0])


@pytest.mark.parametrize("mode,bias", [("affine", False), ("mxfp4", True)])
def test_experts_grouped_by_expert_give_the_per_pair_bits_whatever_the_picks(mode, bias):
    """A GPU prefill step's experts go grouped by expert (`_switch_glu_grouped`: the pairs sorted by slot on the
    device, a fixed number of `gather_qmm` batches): every row the bits of the per-pair path, with gpt-oss's biases
    and clamped SwiGLU too, for picks spread over every expert, all on one, and another rank's picks filled with
    one expert (`ranks.RankExperts`); the batches never outnumber the bound."""
    n_exp, hidden, inter, k, n = 8, 64, 128, 2, 37
    w = random_experts(n_exp, hidden, inter, mode=mode, bias=bias, key=21)
    kernel = ExpertKernel(4, 32 if mode == "mxfp4" else 64, mode, clamped_swiglu(1.702, 7.0) if bias else swiglu,
                          n_experts=n_exp)
    x = mx.random.normal((n, hidden), key=mx.random.key(6))
    spread = np.stack([np.random.default_rng(t).choice(n_exp, k, replace=False) for t in range(n)])
    one = np.zeros((n, k), dtype=np.int64)
    one[:, 1] = 3
    filled = spread.copy()
    filled[:20, 1] = filled[0, 0]
    for picks in (spread, one, filled):
        slots = mx.array(picks, dtype=mx.uint32)
        got = kernels._switch_glu_grouped(x, w, slots, kernel)
        assert mx.array_equal(got, _switch_glu(x, w, slots, kernel))
        batches, src, back = kernels.group_by_expert(slots, 16, n_exp)
        assert batches.size == -(-n * k // 16) + n_exp and src.size == 16 * batches.size
        assert sorted(np.array(back).tolist()) == sorted(set(np.array(back).tolist()))  # one row per pair
        assert (np.array(src)[np.array(back)] == np.repeat(np.arange(n), k)).all()  # each pair's row holds its token
        assert (np.array(batches)[np.array(back) // 16] == picks.reshape(-1)).all()  # in a batch of its slot


@pytest.mark.parametrize("bits", [4, 8])
def test_one_group_quantized_matmul_goes_as_the_dequantized_matmul_on_cuda(bits, monkeypatch):
    """Where one group spans K, `kernels.quantized_matmul` on CUDA multiplies by the dequantized weights (off the
    `qmm_sm90` kernel, wrong on an H200): on the CPU backend exactly `x @ dequantize(w).T` in float32, within one
    bfloat16 rounding of the exact product (closer than MLX's own bfloat16 CPU kernel, which is off by ~2 %).
    Wider K, and the values' untransposed product, go to `mx.quantized_matmul` unchanged."""
    monkeypatch.setattr(kernels, "_on_cuda", lambda: True)
    calls = []
    real = mx.quantized_matmul

    def spy(*args, **kw):
        calls.append(kw["group_size"])
        return real(*args, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    for k in (64, 128):
        w = mx.random.normal((256, k), key=mx.random.key(k)).astype(mx.bfloat16)
        x = mx.random.normal((8, k), key=mx.random.key(k + 1)).astype(mx.bfloat16)  # under BLAS_TOKENS rows
        q, s, b = mx.quantize(w, group_size=64, bits=bits)
        calls.clear()
        ours = np.array(kernels.QLinear(q, s, b, bits, 64)(x).astype(mx.float32))
        if k == 64:
            assert calls == []
            f32 = mx.float32
            plain = (x.astype(f32) @ mx.dequantize(q, s.astype(f32), b.astype(f32), group_size=64, bits=bits).T)
            plain = plain.astype(x.dtype)
            assert np.array_equal(ours, np.array(plain.astype(mx.float32)))
            exact = np.array(x.astype(f32), np.float64) @ np.array(mx.dequantize(q, s.astype(f32), b.astype(f32),
                                                                              group_size=64, bits=bits), np.float64).T
            assert np.abs(ours - exact).max() <= 2**-8 * np.abs(exact).max()  # one bfloat16 rounding of the output
        else:
            fused = np.array(real(x, q, s, b, transpose=True, group_size=64, bits=bits).astype(mx.float32))
            assert calls == [64] and np.array_equal(ours, fused)
    q, s, b = mx.quantize(mx.random.normal((64, 256), key=mx.random.key(9)), group_size=64, bits=bits)
    kernels.quantized_matmul(mx.ones((8, 64)), q, s, b, 64, bits, transpose=False)
    assert calls[-1] == 64
