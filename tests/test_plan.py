"""MemoryPlan: every account of a known config, in bytes, computed here by hand from the formula's inputs.

The config is the text part of the real Qwen3.6-35B-A3B (40 layers, every 4th gated full attention, 256
experts top-8). The planner's inputs that depend on the machine (the measured runtime allowance) are fixed,
so each number below follows from the config alone.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from streamoe.formats.config import ModelArgs
from streamoe.formats.errors import StreamoeError
from streamoe.formats.record import RecordLayout
from streamoe.runtime.plan import (
    GiB,
    MemoryPlan,
    MiB,
    Options,
    activation_bytes,
    attention_elements,
    chunk_token_bytes,
    make_plan,
    read_ring,
    slot_bytes,
    state_bytes,
)

TEXT = {
    "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "vocab_size": 248320,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
CONFIG = {"model_type": "qwen3_5_moe", "text_config": TEXT, "quantization": {"bits": 4, "group_size": 64}}

STRIDE_Q4 = 1_769_472  # one 4-bit expert record of this config (docs/FORMAT.md)
# one slot of the pools at float32: the packed weights as stored (gate and up 512 x 256 uint32, down 2048 x 64)
# and the 6 x 16,384 scales and biases (gate/up 512 x 32, down 2048 x 8) at 4 bytes instead of bf16's 2
SLOT_F32 = 3 * 524_288 + 6 * 16_384 * 4
NONEXPERT = 1 * GiB  # given, not derived: what the non-expert tensors hold at the compute dtype
RUNTIME = 256 * MiB  # given: the interpreter allowance (measured at open when not given)

# Hand-computed accounts at ctx 4096, prefill chunk 256, float32 activations and KV cache.
# 10 full-attention layers x (K, V) x 2 KV heads x head_dim 256 x 4096 tokens x 4 bytes
KV = 10 * 2 * 2 * 256 * 4096 * 4
# 30 Gated DeltaNet layers x (conv window + recurrent state value_dim x key_dim) x 4 bytes; the window's K-1 rows
# each hold their token's input projection row: conv_dim + value_dim + 2 x 32 value heads (the b and a gates),
# conv_dim = 2 x 16 key heads x 128 + 32 value heads x 128 = 8192, value_dim = 32 x 128 = 4096
LINEAR = 30 * (3 * (8192 + 4096 + 64) + 4096 * 128) * 4
# one chunk of 256 tokens: hidden 8·T·H, attention max(T·(2·nq·hd + 2·nkv·hd) + nq·T·ctx, GDN temporaries
# 3·T·(conv_dim + value_dim) + 48·value_dim·key_dim), MoE 3·T·k·H + 4·T·inter, logits 2·V; x 1.5 x 4 bytes
HIDDEN = 8 * 256 * 2048
ATTN = 256 * (2 * 16 * 256 + 2 * 2 * 256) + 16 * 256 * 4096
GDN = 3 * 256 * (8192 + 4096) + 48 * 4096 * 128
MOE = 3 * 256 * 8 * 2048 + 4 * 256 * 512
LOGITS = 2 * 248320
# prefill on the CPU: one dequantized block of 1024 rows of the widest input (4096: GDN out_proj, o_proj), and
# the chunk's float32 input and output of the widest projection (GDN in_proj: qkv 8192 + z 4096 + b, a 32 each)
BLAS = 4 * (1024 * 4096 + 256 * (4096 + 2 * 12352))
ACTIVATIONS = 3 * (HIDDEN + max(ATTN, GDN) + MOE + LOGITS) * 4 // 2 + BLAS
# CUDA's 256-token step grouped by expert: 2,048 pairs, 16 rows a batch, 128 + 256 batches (the padding rows too),
# each row's input, output and gate/up outputs
GROUPED = 3 * (16 * (128 + 256) * 2 * (2048 + 512)) * 4 // 2
# MLX keeps freed buffers for reuse up to this: a decode step's new recurrent states (LINEAR) + 32 MiB
ALLOC_CACHE = LINEAR + 32 * MiB
STAGING = 256 * SLOT_F32  # one slot per expert of a layer
# host staging the reads land in: 2 x top-k 8 (a layer's misses) + 8 guesses (prefetch width = top-k by default)
# + 8 I/O threads = 32 records, counted twice (the staging and the copies in flight)
RING = 2 * 8 + 8 + 8
READ_STAGING = 2 * RING * STRIDE_Q4
FIXED = NONEXPERT + KV + LINEAR + ACTIVATIONS + ALLOC_CACHE + STAGING + READ_STAGING + RUNTIME


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_config(CONFIG)


def plan(args: ModelArgs, cap: float, **kw) -> MemoryPlan:
    opts = {"ctx": 4096, "expert_format": "q4", "stride": STRIDE_Q4, "nonexpert_resident": NONEXPERT,
            "runtime_bytes": RUNTIME, "dtype": "float32", "kv_dtype": "float32", "prefill_chunk": 256, "ring": RING,
            "slot": SLOT_F32, "blas": True, "grouped": False, **kw}
    return make_plan(args=args, cap=int(cap * GiB), **opts)


def test_a_cap_the_prefill_step_misses_names_the_longest_step_that_fits(args):
    """Where the fixed accounts miss the cap by less than the prefill step's activations, the refusal also names the
    longest shorter step (of 128, 64, 32, 16) that fits this cap, and it does; where none would, only the cap."""
    from streamoe.runtime.plan import plan_with_limits

    kw = {"args": args, "ctx": 32768, "expert_format": "q4", "stride": STRIDE_Q4, "nonexpert_resident": NONEXPERT,
          "runtime_bytes": RUNTIME, "dtype": "float32", "kv_dtype": "float32", "ring": RING, "slot": SLOT_F32,
          "blas": True, "grouped": False}
    at = {n: make_plan(cap=64 * GiB, prefill_chunk=n, **kw).fixed for n in (256, 128, 64, 32)}
    assert at[256] > at[128] > at[64] > at[32]
    cap = (at[64] + at[128]) // 2  # 64 fits, 128 does not
    p = plan_with_limits(cap=cap, **kw)
    assert p.fitting_chunk == 64
    with pytest.raises(StreamoeError, match=r"smallest cap that fits: --cap [0-9.]+, or --prefill-chunk 64 at this cap"):
        p.require_fit()
    plan_with_limits(cap=cap, prefill_chunk=64, **kw).require_fit()
    with pytest.raises(StreamoeError) as e:
        plan_with_limits(cap=NONEXPERT, **kw).require_fit()
    assert "--prefill-chunk" not in str(e.value)


def test_hand_computed_values_are_the_ones_above():
    assert (KV, LINEAR, ACTIVATIONS, STAGING, READ_STAGING) == (167_772_160, 67_361_280, 360_675_328, 503_316_480,
                                                                113_246_208)
    assert read_ring(Options(), top_k=8, n_experts=256) == RING
    # a --prefetch-width past the experts a layer has plans the staging of every expert, no more
    assert read_ring(Options(prefetch_width=1000), top_k=8, n_experts=256) == 2 * 8 + 256 + Options().io_threads
    assert RecordLayout.make(2048, 512, 4, 64).stride == STRIDE_Q4
    assert slot_bytes(RecordLayout.make(2048, 512, 4, 64), "float32") == SLOT_F32 == 1_966_080
    assert slot_bytes(RecordLayout.make(2048, 512, 4, 64), "bfloat16") == STRIDE_Q4  # as stored
    assert GDN > ATTN  # at ctx 4096 the Gated DeltaNet temporaries are the largest; the scores outgrow them past 7,872


def test_only_the_cpu_backend_plans_for_blas_prefill(args):
    """Prefill through numpy's BLAS is the CPU backend's alone: a GPU's plan gives that block to the hot tier, and
    CUDA's holds its experts grouped by expert instead (`kernels._switch_glu_grouped`)."""
    p = plan(args, 4, blas=False)
    assert p.accounts["activations"] == ACTIVATIONS - BLAS
    assert p.hot_slots == (4 * GiB - (FIXED - BLAS)) // SLOT_F32 == 857  # 24 more than the CPU plan
    p = plan(args, 4, blas=False, grouped=True)
    assert p.accounts["activations"] == ACTIVATIONS - BLAS + GROUPED
    assert p.hot_slots == (4 * GiB - (FIXED - BLAS + GROUPED)) // SLOT_F32 == 761  # 72 fewer than the CPU plan
    # MXFP4 experts (gpt-oss) keep the per-pair path on CUDA: nothing grouped to hold
    assert plan(args, 4, blas=False, grouped=True, expert_mode="mxfp4").accounts["activations"] == ACTIVATIONS - BLAS
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert make_plan(args=args, cap=4 * GiB, ctx=4096, expert_format="q4", stride=STRIDE_Q4, nonexpert_resident=NONEXPERT,
                     runtime_bytes=RUNTIME, ring=RING, slot=SLOT_F32, prefill_chunk=256).accounts["activations"] == (
        ACTIVATIONS if mx.default_device() == mx.cpu else ACTIVATIONS - BLAS + GROUPED * on_cuda)  # this process's backend


def test_accounts_exact(args):
    p = plan(args, 4)
    assert p.accounts == {"non-expert": NONEXPERT, "kv cache": KV, "linear state": LINEAR, "activations": ACTIVATIONS,
                          "allocator cache": ALLOC_CACHE, "prefill staging": STAGING, "read staging": READ_STAGING, "vision": 0, "runtime": RUNTIME}
    assert state_bytes(args, 4096, 4) == (KV, LINEAR)
    assert activation_bytes(args, 4096, 256, 4) == ACTIVATIONS
    assert p.fixed == FIXED == 2_655_464_448
    assert p.hot_bytes == 4 * GiB - FIXED
    assert p.hot_slots == (4 * GiB - FIXED) // SLOT_F32 == 833
    assert p.staging_slots == 256 and p.n_layers == 40 and p.n_experts == 256
    assert p.fits and p.min_cap == FIXED
    p.require_fit()


def test_a_callers_accounts_are_fixed_before_the_hot_tier_is_sized(args):
    """`serve` adds its prompt cache and requests: accounts of the plan (shown before the runtime allowance, with
    their notes) from which the hot tier is sized, never written into a plan after use."""
    extra = (("prompt cache", 64 * MiB, "snapshots"), ("requests", 100 * SLOT_F32, "bodies"))
    p = plan(args, 4, extra=extra)
    assert list(p.accounts)[-3:] == ["prompt cache", "requests", "runtime"]
    assert p.accounts["prompt cache"] == 64 * MiB and p.notes["requests"] == "bodies"
    assert p.fixed == FIXED + 64 * MiB + 100 * SLOT_F32
    assert p.hot_slots == (4 * GiB - FIXED - 64 * MiB) // SLOT_F32 - 100 == 699


def test_dtypes_and_context_scale_their_accounts(args):
    half = plan(args, 4, kv_dtype="float16", dtype="bfloat16")
    assert half.accounts["kv cache"] == KV // 2
    assert half.accounts["linear state"] == LINEAR  # the recurrent state is float32 whatever the dtype
    assert half.accounts["activations"] == 3 * (HIDDEN + max(ATTN, GDN) + MOE + LOGITS) * 2 // 2 + BLAS  # BLAS: float32
    short = plan(args, 4, ctx=128)  # a chunk never exceeds the context
    hidden, attn = 8 * 128 * 2048, 128 * (2 * 16 * 256 + 2 * 2 * 256) + 2 * 16 * 128 * 128
    gdn, moe = 3 * 128 * (8192 + 4096) + 48 * 4096 * 128, 3 * 128 * 8 * 2048 + 4 * 128 * 512
    blas = 4 * (1024 * 4096 + 128 * (4096 + 2 * 12352))
    assert short.accounts["activations"] == 3 * (hidden + max(attn, gdn) + moe + LOGITS) * 4 // 2 + blas
    assert short.accounts["kv cache"] == KV // 32
    assert plan(args, 4, vision_bytes=12345).accounts["vision"] == 12345


def test_hot_slots_never_exceed_every_expert(args):
    p = plan(args, 512)
    assert p.hot_bytes // SLOT_F32 > 40 * 256
    assert p.hot_slots == 40 * 256


def test_allocator_cache_takes_what_the_cap_leaves_unplanned(args):
    capped = plan(args, 4)
    assert capped.cache_limit == ALLOC_CACHE + (4 * GiB - FIXED) % SLOT_F32
    assert capped.cache_limit - ALLOC_CACHE < SLOT_F32
    resident = plan(args, 512)
    assert resident.cache_limit == ALLOC_CACHE + 512 * GiB - FIXED - 40 * 256 * SLOT_F32


def test_too_small_a_cap_names_the_smallest_that_fits(args):
    p = plan(args, 2)
    assert not p.fits and p.hot_bytes == 0 and p.hot_slots == 0 and p.min_cap == FIXED
    with pytest.raises(StreamoeError) as e:
        p.require_fit()
    need, smallest = FIXED / GiB, (FIXED + 0.01 * GiB) / GiB
    assert str(e.value) == (f"cap 2.00 GiB is too small for this model at ctx 4096: the fixed accounts need "
                            f"{need:.2f} GiB; smallest cap that fits: --cap {smallest:.2f}")
    assert str(e.value).endswith("--cap 2.48")
    plan(args, float(f"{smallest:.2f}")).require_fit()  # the cap it names does fit


def test_render_and_json(args):
    p = plan(args, 4)
    text = p.render().splitlines()
    assert text[0] == "memory plan: cap 4.00 GiB, ctx 4096, experts q4 (1,769,472 B per expert, 1,966,080 B per slot)"
    names = [ln.split("  ")[1].strip() for ln in text[1:]]
    assert names == ["non-expert", "kv cache", "linear state", "activations", "allocator cache", "prefill staging",
                     "read staging", "vision",
                     "runtime", "hot tier", "prefill chunk", "total"]
    assert "   1.000 GiB" in text[1] and "(4096 tokens, float32)" in text[2]
    assert "(256 slots, one per expert of a layer)" in text[6]
    assert "(32 records of host staging + their copies in flight)" in text[7]
    assert f"(833 expert slots of {40 * 256}; +256 lent staging slots during decode)" in text[10]
    assert text[11] == "  prefill chunk         256 tokens  (experts read once per chunk; kernels over 256 tokens at a time)"
    assert text[12].endswith(f"{(FIXED + 833 * SLOT_F32) / GiB:8.3f} GiB of 4.000 GiB")
    assert p.to_json() == {"cap": 4 * GiB, "ctx": 4096, "expert_format": "q4", "stride": STRIDE_Q4, "slot": SLOT_F32,
                           "accounts": p.accounts, "fixed": FIXED, "hot_slots": 833, "staging_slots": 256,
                           "n_layers": 40, "n_experts": 256, "fits": True, "prefill_chunk": 256, "prefill_step": 256}


# What each token of a longer chunk keeps alive while its layers run in steps: 2 x H of residual stream (a
# layer's input and output blocks) and its top-8 picks (indices at 4 bytes), x 1.5, at float32; the MoE input
# and routing are recomputed per block, not kept
PER_TOKEN = 3 * (2 * 2048 * 4 + 4 * 8) // 2


def test_auto_chunk_takes_half_the_hot_tier_at_most(args):
    """`auto`: the largest chunk of whole 256-token steps (at most ctx) whose tokens fit while the hot tier keeps
    half of what it has at one step; one step where everything is resident or nothing fits."""
    assert chunk_token_bytes(args, 4) == PER_TOKEN == 24_624
    cap = int(2.6 * GiB)
    hot_at_one_step = cap - FIXED  # 136,264,294 B
    p = plan(args, 2.6, prefill_chunk="auto")
    assert (p.prefill_chunk, p.prefill_step) == (2816, 256)  # 10 more steps: 10 x 256 x PER_TOKEN <= half the tier
    assert p.accounts["activations"] == ACTIVATIONS + (2816 - 256) * PER_TOKEN == 423_712_768
    assert p.hot_bytes >= hot_at_one_step // 2 > p.hot_bytes - 256 * PER_TOKEN  # one more step would pass the floor
    assert plan(args, 4, prefill_chunk="auto").prefill_chunk == 4096  # room for the whole context
    assert plan(args, 4, prefill_chunk="auto", ctx=1000).prefill_chunk == 1000
    assert plan(args, 64, prefill_chunk="auto").prefill_chunk == 256  # resident: nothing to read, no chunk to grow
    assert plan(args, 2, prefill_chunk="auto").prefill_chunk == 256  # does not fit: nothing to give
    fixed = plan(args, 4, prefill_chunk=1024)  # a number: chunks and kernel calls of that many tokens
    assert (fixed.prefill_chunk, fixed.prefill_step) == (1024, 1024)
    assert fixed.accounts["activations"] == activation_bytes(args, 4096, 1024, 4)


def test_runtime_allowance_is_measured_when_not_given(args):
    p = plan(args, 4, runtime_bytes=None)
    assert p.accounts["runtime"] > 64 * MiB  # this process's RSS + 64 MiB
    assert "measured" in p.notes["runtime"]


def test_kv_auto_follows_the_compute_dtype(args):
    from streamoe.runtime.plan import kv_dtype

    assert kv_dtype(Options(dtype="bfloat16")) == "bfloat16" and kv_dtype(Options(dtype="float32")) == "float32"
    assert kv_dtype(Options(dtype="bfloat16", kv="float32")) == "float32"
    assert plan(args, 4, kv_dtype=kv_dtype(Options(dtype="bfloat16")), dtype="bfloat16").accounts["kv cache"] == KV // 2


@pytest.mark.parametrize("family,dtype,n", [("qwen3_5_moe", mx.float32, 2048), ("qwen3_5_moe", mx.bfloat16, 2048),
                                            ("gpt_oss", mx.float32, 1024)])
def test_plan_bounds_what_attention_allocates(args, family, dtype, n):
    """A 256-token prefill step of a full attention layer against a cache holding n positions (the engine's
    cache and call: `kernels.attention`, MLX's fused attention, which here multiplies, masks and takes the
    softmax as separate ops), its peak memory measured with mx.get_peak_memory: more than half an array short of the
    score arrays the plan expects (one for Qwen3.6, three where gpt-oss's sinks join the softmax), never more
    than the plan's attention term with activation_bytes' margin, and that term not twice what is held (counting
    Qwen3.6's scores twice, as the plan did, planned 2.7 times the peak)."""
    from streamoe.convert.synth import make_config
    from streamoe.runtime.models import kernels
    from streamoe.runtime.models.cache import KVCache

    a = args if family == "qwen3_5_moe" else ModelArgs.from_config(make_config("full", family=family))
    L, nq, nkv, hd, item = 256, a.num_attention_heads, a.num_key_value_heads, a.head_dim, dtype.size
    mx.random.seed(0)
    cache = KVCache(1, nkv, hd, n, dtype)
    cache.update_and_fetch(*(mx.random.normal((1, nkv, n - L, hd)).astype(dtype) for _ in range(2)))
    q, k, v = (mx.random.normal((1, h, L, hd)).astype(dtype) for h in (nq, nkv, nkv))
    sinks = mx.random.normal((nq,)).astype(dtype) if a.attention_sinks else None
    mx.eval(cache.keys, cache.values, q, k, v, *([sinks] if a.attention_sinks else []))
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(kernels.attention(q, k, v, cache, hd**-0.5, sinks=sinks))
    peak = mx.get_peak_memory() - base
    arrays = 3 if a.attention_sinks else 1
    planned = int(1.5 * attention_elements(a, n, L, item) * item)  # as activation_bytes counts it
    assert (arrays - 0.5) * nq * L * n * item < peak <= planned < 2 * peak, (peak, planned)
