"""Exactness on a GPU (MLX's CUDA or Metal backend): bit-identical logits across caps, prefetch widths,
tier policies and repeated runs, with every filled slot checked against the file; per-layer hidden
states against mlx-lm's. Skipped where MLX has no GPU; run on the H200 in every session that touches
the engine (see docs/performance.md for the command)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from streamoe.runtime import experts as experts_mod
from streamoe.runtime.engine import Engine, Options, plan_for

from .conftest import RUNTIME

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(mx.default_device() != mx.gpu, reason="MLX has no GPU here (CPU backend only)"),
]
PROMPT = ("import os\nimport sys\n\nclass Reader:\n    def __init__(self, path):\n        self.path = path\n"
          "    def read(self):\n        with open(self.path) as f:\n            return f.read()\n")


def run(conv, slots: int | None, dtype: str, steps: int = 12, **opts) -> tuple[bytes, int]:
    """Greedy logits (prompt + steps) as bytes, and the misses the run had."""
    o = dict(ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME, dtype=dtype, **opts)
    base = plan_for(conv, Options(cap_gib=64, **o))
    cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
    eng = Engine(conv, Options(cap_gib=cap, **o))
    out = [np.array(eng.prefill(eng.text.encode(PROMPT)).astype(mx.float32))]
    for _ in range(steps):
        out.append(np.array(eng.decode(int(out[-1].argmax())).astype(mx.float32)))
    eng.close()
    logits = np.stack(out)
    assert np.isfinite(logits).all(), "non-finite logits (equal NaN bytes would pass a bit-identity check)"
    return logits.tobytes(), sum(ly.misses for s in eng.steps for ly in s.layers)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_logits_bit_identical_across_caps_prefetch_tiers_and_runs(small_conv, dtype, monkeypatch):
    monkeypatch.setattr(experts_mod, "VERIFY", True)  # every slot's bytes against the file after each fill
    runs = {}
    for key in [(0, 8, "freq"), (0, 8, "freq"), (0, 0, "lru"), (24, 8, "lru"), (200, 0, "freq"), (None, 8, "freq"),
                (None, 8, "freq")]:
        runs.setdefault(key, []).append(run(small_conv, key[0], dtype, prefetch_width=key[1], tier=key[2]))
    first = runs[(0, 8, "freq")][0][0]
    assert runs[(0, 0, "lru")][0][1] > 0 and runs[(None, 8, "freq")][0][1] == 0  # streamed .. resident
    for key, results in runs.items():
        for data, _ in results:
            assert data == first, f"logits differ at {key}"


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the warp-a-row kernels are CUDA's")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_warp_kernels_logits_bit_identical_across_caps(small_conv, dtype, monkeypatch):
    """The decode step's experts a warp an output row (`kernels.EXPERTS_QMV`), the delta rule a warp a state row
    (`delta_rule.DELTA_RULE_WARP_ROWS`) and the router's top-k as one kernel (`kernels.ROUTE_KERNEL`): the same
    logits' bits streamed and resident; other bits than the forms before them (so the switches took effect),
    within float32 rounding of them."""
    from streamoe.runtime.models import delta_rule, kernels

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    as_is = np.frombuffer(run(small_conv, None, dtype, steps=6)[0], np.float32)
    monkeypatch.setattr(kernels, "EXPERTS_QMV", True)
    monkeypatch.setattr(kernels, "ROUTE_KERNEL", True)
    monkeypatch.setattr(delta_rule, "DELTA_RULE_WARP_ROWS", True)
    runs = [run(small_conv, slots, dtype, steps=6) for slots in (None, 24, 0)]
    assert runs[0][1] == 0 and runs[2][1] > 0
    assert runs[0][0] == runs[1][0] == runs[2][0]
    warp = np.frombuffer(runs[0][0], np.float32)
    assert warp.tobytes() != as_is.tobytes()
    # float32: every step; bf16: the prompt's logits (a rounding may turn a later greedy pick, and all after it)
    n = warp.size if dtype == "float32" else warp.size // 7
    tol = 1e-4 if dtype == "float32" else 5e-2
    assert np.abs(warp[:n] - as_is[:n]).max() <= tol * np.abs(as_is[:n]).max(), np.abs(warp[:n] - as_is[:n]).max()


def test_gpu_prompt_logprobs_bit_identical_across_caps(small_conv):
    """A prompt's logprobs (completions' `echo`), read off each prefill step's hidden states 16 rows of logits at a
    time (`logprobs.PromptScores`): the same bits resident and at caps that stream, in bf16, chunked as the plan
    chooses."""
    from streamoe.runtime.serve.logprobs import PromptScores

    o = dict(ctx=256, runtime_bytes=RUNTIME, dtype="bfloat16")
    base = plan_for(small_conv, Options(cap_gib=64, **o))
    got = []
    for slots in (None, 24, 200):
        cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
        eng = Engine(small_conv, Options(cap_gib=cap, **o))
        ids = eng.text.encode(PROMPT)
        eng.scorer = scores = PromptScores(ids, 5)
        eng.prefill(ids)
        eng.close()
        assert scores.scores[0] is None and all(s is not None for s in scores.scores[1:])
        got.append(scores.scores)
    assert got[1] == got[0] and got[2] == got[0]


@pytest.mark.parametrize("slots", [None, 0])
def test_gpu_compiled_decode_step_is_the_step_built_op_by_op(small_conv, slots, monkeypatch):
    """Each layer's one-token call compiled (`kernels.COMPILED_STEP`; MLX fuses its elementwise ops into kernels of
    its own on the GPU) gives the logits' bits of the same step built op by op, resident and streamed."""
    from streamoe.runtime.models import kernels

    on, _ = run(small_conv, slots, "bfloat16")
    monkeypatch.setattr(kernels, "COMPILED_STEP", False)
    off, _ = run(small_conv, slots, "bfloat16")
    assert on == off


def test_gpu_decode_layers_run_ahead_of_their_picks_give_the_same_bits(small_conv, monkeypatch):
    """A capped decode step runs layers on the hot tier's slots before reading their picks (`experts.DECODE_AHEAD`,
    on by default on GPUs): the logits' bits of the step that waits for each layer's picks and of the resident run,
    in bf16, every filled slot checked; some runs missed a pick and were thrown away (their caches rewound)."""
    from .test_runtime import run_ahead_bits

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    ahead, usual, resident = run_ahead_bits(small_conv, monkeypatch, 460, dtype="bfloat16")
    assert ahead == usual == resident


def test_gpu_long_prefill_chunks_give_the_one_block_logits(small_conv, monkeypatch):
    """The plan's longer chunks run their layers block by block, each block's MoE input and routing recomputed
    when its experts run (`kernels.run_layers`): the logits of one-block chunks bit for bit on the GPU too (the
    recomputed routing must be the same bits as the picks landed), every filled slot checked."""
    from streamoe.runtime import plan as plan_mod

    from .test_runtime import run_logits

    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 16)
    monkeypatch.setattr(experts_mod, "VERIFY", True)
    want, _ = run_logits(small_conv, 24, steps=3, chunk=16, dtype="bfloat16")
    for slots in (2, 200):
        got, eng = run_logits(small_conv, slots, steps=3, chunk="auto", dtype="bfloat16")
        assert eng.plan.prefill_chunk > 16 and got == want, f"logits differ at {slots} slots"


def test_gpu_host_tier_logits_bit_identical_at_every_pair_of_caps(small_conv, monkeypatch):
    """A GPU with memory of its own (CUDA): no host tier, a part of the records, all of them, under a device tier of
    none or some, records landed by the upload ring or the copy engine (a call per segment, or a layer's segments
    in one batched call); the same bits, every filled slot checked against the file, and a host tier that holds
    every record reads nothing from disk after open."""
    from streamoe.runtime import copy_engine
    from streamoe.runtime.plan import split_memory

    from .test_host_tier import caps_for, logits_of

    if not split_memory():
        pytest.skip("unified memory (Metal): --cap bounds all of it, no host tier")
    monkeypatch.setattr(experts_mod, "VERIFY", True)
    runs = {}
    for hot, host, path in [(0, None, "ring"), (0, None, "each"), (0, 120, "each"), (0, 512, "each"),
                            (24, 200, "each"), (24, 200, "ring"), (0, None, "batch"), (0, 120, "batch"),
                            (24, 200, "batch")]:
        monkeypatch.setattr(copy_engine, "ENABLED", path != "ring")  # CUDA's copy engine, or the upload ring
        monkeypatch.setattr(copy_engine, "BATCH", path == "batch")
        data, eng = logits_of(small_conv, caps_for(small_conv, hot, host, dtype="bfloat16"))
        pools = eng.experts.pools
        assert (pools.engine is not None) == (path != "ring")
        if path == "batch":
            assert pools.engine.batch is not None, "the driver has no cuMemcpyBatchAsync (or refused it)"
        layers = [ly for s in eng.steps for ly in s.layers]
        runs[(hot, host, path)] = (data, sum(ly.bytes_read for ly in layers), sum(ly.hits_host for ly in layers))
    first = runs[(0, None, "ring")][0]
    assert all(data == first for data, *_ in runs.values()), {k: v[1:] for k, v in runs.items()}
    assert runs[(0, 512, "each")][1] == 0 and runs[(0, 512, "each")][2] > 0 and runs[(0, 120, "each")][2] > 0


@pytest.mark.parametrize("form", ["direct", "take"])
def test_gpu_host_tier_read_in_place_by_the_device(small_conv, monkeypatch, form):
    """Every expert in host memory (`host_reads`: managed memory advised to stay on the host), read in place by the
    device's kernels (or their rows gathered into device memory first: `take`): the same bits as records landed in
    device slots, with a prefill chunk of several blocks whose layers are copied into device memory, and nothing
    read from disk after open."""
    from dataclasses import replace

    from streamoe.runtime import plan as plan_mod
    from streamoe.runtime.plan import split_memory

    from .test_host_tier import caps_for, logits_of

    if not split_memory():
        pytest.skip("unified memory (Metal): --cap bounds all of it, no host tier")
    monkeypatch.setattr(experts_mod, "VERIFY", True)
    monkeypatch.setattr(experts_mod, "HOST_READ_FORM", form)
    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 8)
    want, _ = logits_of(small_conv, replace(caps_for(small_conv, 0, None, dtype="bfloat16"), prefill_chunk="auto"))
    got, eng = logits_of(small_conv, replace(caps_for(small_conv, 80, 580, dtype="bfloat16"), prefill_chunk="auto",
                                             host_reads=True))
    assert eng.plan.host_reads and eng.experts.resident and eng.experts.pools.host_bytes > 0
    assert eng.plan.prefill_chunk > eng.plan.prefill_step
    assert sum(ly.bytes_read for s in eng.steps for ly in s.layers) == 0
    assert got == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_sampled_decode_identical_across_caps_and_loops(small_conv, dtype, monkeypatch):
    """The checkpoint's sampling defaults with penalties, chosen on the device: resident (each step queued from
    the token still being drawn) and capped at two caps give the same tokens and the same logits' bits."""
    from streamoe.runtime.sampling import Sampler

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    outs = []
    for slots in (None, 24, 200):
        o = dict(ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME, dtype=dtype)
        base = plan_for(small_conv, Options(cap_gib=64, **o))
        cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
        eng = Engine(small_conv, Options(cap_gib=cap, **o))
        eng.text.stop_ids = set()
        s = Sampler(temp=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, repetition_penalty=1.05, seed=2)
        outs.append([(t, np.array(lg).tobytes()) for t, lg in eng.generate(eng.text.encode(PROMPT), 16, s)])
        assert eng.experts.resident == (slots is None)
        eng.close()
    assert outs[0] == outs[1] == outs[2]
    assert len({t for t, _ in outs[0]}) > 4


def test_gpu_hidden_states_match_mlx_lm(small_ckpt, small_conv):
    """float32: the residual stream after every layer within 1e-4 relative of mlx-lm's, prompt and decode."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    ref, _ = load_model(small_ckpt)
    ref.set_dtype(mx.float32)
    eng = Engine(small_conv, Options(cap_gib=64, ctx=256, prefill_chunk=256, runtime_bytes=RUNTIME, dtype="float32"))
    ours_h, ref_h = tap_moe_out(eng.model.layers), tap(ref.language_model.model.layers)
    ids = eng.text.encode(PROMPT)
    cache = make_prompt_cache(ref)
    lr, le = ref(mx.array([ids]), cache=cache)[0, -1], eng.prefill(ids)
    for _ in range(4):
        t = int(np.array(lr).argmax())
        lr, le = ref(mx.array([[t]]), cache=cache)[0, -1], eng.decode(t)
    mx.eval(lr, le)
    assert len(ours_h) == len(ref_h)
    errs = [float(mx.abs(a - b).max() / mx.abs(b).max()) for a, b in zip(ours_h, ref_h, strict=True)]
    eng.close()
    n = len(eng.model.layers)  # errs: the prompt's layers, then each decode step's
    assert max(errs) < 1e-4, [f"step {j // n} layer {j % n}: {e:.2e}" for j, e in enumerate(errs) if e >= 1e-5]


@pytest.mark.parametrize("qmv", [False, True])
def test_gpu_capped_decode_never_copies_a_pool(small_conv, qmv, monkeypatch):
    """A capped decode's memory stays what the plan counts: every pool update is in place, so the peak over
    decode grows by less than the smallest weight pool (a copied pool would add at least that). Three runs: the
    copy it guards against depended on the timing of MLX's completion handlers (runtime/experts.py,
    release_pool_readers). `qmv`: the experts a warp a row (`kernels.EXPERTS_QMV`, CUDA), a custom kernel, which
    must read a layer's view of the pools where it lies, not a contiguous copy."""
    from streamoe.runtime.models import kernels

    monkeypatch.setattr(experts_mod, "VERIFY", False)  # measure the run as users run it
    monkeypatch.setattr(kernels, "EXPERTS_QMV", qmv)
    o = dict(ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME, dtype="bfloat16")
    base = plan_for(small_conv, Options(cap_gib=64, **o))
    for _ in range(3):
        eng = Engine(small_conv, Options(cap_gib=(base.fixed + 24 * base.slot_bytes + 1) / 2**30, **o))
        assert not eng.experts.resident  # CUDA: the ring's scatters; Metal: direct writes (no MLX update at all)
        tok = int(np.array(eng.prefill(eng.text.encode(PROMPT)).astype(mx.float32)).argmax())
        start = mx.get_active_memory()
        mx.reset_peak_memory()
        for _ in range(24):
            tok = int(np.array(eng.decode(tok).astype(mx.float32)).argmax())
        grew = mx.get_peak_memory() - start
        pools = eng.experts.pools
        smallest = min(a.nbytes for a, sg in zip(pools.arrays, pools.lay.segments, strict=True) if sg.part == "weight")
        misses = sum(ly.misses for s in eng.steps[-24:] for ly in s.layers)
        eng.close()
        assert misses > 0 and grew < smallest, (grew, smallest, misses)


def tap(layers: list) -> list:
    """Record every layer's output (the residual stream) by wrapping the layers in place."""
    seen: list = []

    class Tap:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *a, **k):
            y = self.inner(*a, **k)
            seen.append(y.astype(mx.float32))
            return y

    for i, layer in enumerate(layers):
        layers[i] = Tap(layer)
    return seen


def tap_moe_out(layers: list) -> list:
    """Record every layer's output as our layers give it: the MoE block's `finish` (residual + MoE) ends a layer
    both in a decode step and in a prefill, which runs each layer's mixer and MoE block as separate calls."""
    seen: list = []

    def recorded(finish):
        def call(*a, **k):
            y = finish(*a, **k)
            seen.append(y.astype(mx.float32))
            return y
        return call

    for layer in layers:
        layer.mlp.finish = recorded(layer.mlp.finish)
    return seen


@pytest.mark.parametrize("kv", ["q8", "q4"])
def test_gpu_quantized_kv_logits_bit_identical_across_caps(small_conv, kv, monkeypatch):
    """A quantized KV cache on the GPU: the live codes are a strided view of the preallocated cache (ctx 256,
    far from full), which MLX's CUDA quantized matmuls refuse unless each head's codes go alone; the same logits'
    bits at every cap."""
    monkeypatch.setattr(experts_mod, "VERIFY", True)
    runs = [run(small_conv, slots, "bfloat16", steps=6, kv=kv) for slots in (None, 24, 200)]
    assert runs[1][1] > 0 and runs[0][1] == 0
    assert runs[0][0] == runs[1][0] == runs[2][0]


def test_gpu_float32_matmul_is_float32_only_without_tf32():
    """The kernel-level difference behind float32 drift on CUDA: MLX runs float32 matmuls in TF32 unless
    MLX_ENABLE_TF32=0, which importing streamoe.runtime sets. Each setting in a fresh process (MLX reads it once)."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np, mlx.core as mx; r = np.random.default_rng(0); a = r.standard_normal((256, 512), np.float32); "
            "b = r.standard_normal((512, 256), np.float32); ref = a.astype(np.float64) @ b; "
            "got = np.array(mx.array(a) @ mx.array(b)); print(float(np.abs(got - ref).max() / np.abs(ref).max()))")
    err = {}
    for tf32 in ("1", "0"):
        env = {**os.environ, "MLX_ENABLE_TF32": tf32}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        err[tf32] = float(out.stdout.strip())
    assert err["0"] < 1e-6 < 1e-4 < err["1"], err
    assert os.environ.get("MLX_ENABLE_TF32") == "0"  # set by importing streamoe.runtime (this module did)


def test_gpu_upload_ring_is_advised_to_stay_on_the_host(small_conv):
    """On CUDA the capped path's upload ring must be host-resident and mapped for the GPU (runtime/managed.py):
    without the advice every fill migrates its pages twice (bench/fill.py). Metal's memory is unified: no advice."""
    from streamoe.formats.manifest import load_manifest
    from streamoe.runtime.experts import SlotPools

    lay = load_manifest(small_conv).expert_formats()["q4"].layout
    pools = SlotPools(4, lay, mx.bfloat16, 8, direct=False)
    pools.close()
    assert pools.host_mapped == mx.cuda.is_available()


def test_gpu_pools_are_updated_in_place_whatever_mlx_has_cached(small_conv, monkeypatch):
    """MLX's GPU buffer cache hands a freed buffer up to two 16 KiB pages larger than asked to a new array, and MLX
    donates a buffer to an in-place update only if it is at most one page larger: a pool given such a buffer would
    be copied whole by every landing. With a freed buffer one page too large for each pool waiting in the cache,
    the pools are still updated in place (`cache.clear_for_in_place`; the slot check fails on a copy)."""
    from streamoe.formats.manifest import load_manifest
    from streamoe.runtime.experts import SlotPools
    from streamoe.runtime.store import ExpertStore

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    m = load_manifest(small_conv)
    store = ExpertStore.open(small_conv, m, "q4", 2, ring=8)
    n, page = 65, 16384  # 65 rows: the 2,048-byte segments' pools are not a whole number of pages
    mx.synchronize()
    mx.clear_cache()  # nothing cached but the spares below: none of an earlier test's buffers fits a pool exactly
    spare = [mx.zeros((-(-n * s.nbytes // page) * page + page,), dtype=mx.uint8) for s in store.lay.segments]
    mx.eval(spare)
    del spare  # back in MLX's cache, each a page larger than its pool's page-rounded size
    pools = SlotPools(n, store.lay, mx.bfloat16, 8, direct=False)
    record = memoryview(bytearray(store.read_bytes(1, 3).ljust(store.lay.stride, b"\0")))
    try:
        for slot in (5, 64):
            pools.stage(slot, record, lambda: None)
            pools.flush()  # raises if a pool was copied
        assert pools.bytes_at([5, 64]) == [store.read_bytes(1, 3)] * 2
    finally:
        pools.close()
        store.close()


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the delta-rule kernel is CUDA's form (delta_rule.gdn_form)")
@pytest.mark.parametrize("warp_rows", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_delta_rule_kernel_is_the_token_loop(dtype, warp_rows, monkeypatch):
    """CUDA runs the delta rule as one kernel (delta_rule.delta_rule_cuda), a thread or a warp a state row:
    grouped heads, one token and a prompt's worth, against the token loop (float32 state; the kernel sums over dk in
    another order: 1e-5 relative)."""
    from streamoe.runtime.models import delta_rule
    from streamoe.runtime.models.delta_rule import delta_rule_cuda, gated_delta_loop

    monkeypatch.setattr(delta_rule, "DELTA_RULE_WARP_ROWS", warp_rows)
    rng = np.random.default_rng(3)
    B, Hk, Hv, dk, dv, extra = 2, 2, 4, 64 if warp_rows else 32, 16, 24  # conv: q, k, then v; extra columns test VOFF

    def arr(*shape, dt=mx.float32):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    dt = getattr(mx, dtype)
    for L in (1, 37):
        qk = (0.2 * arr(B, L, 2 * Hk, dk)).astype(dt)
        conv = arr(B, L, 2 * Hk * dk + extra + Hv * dv, dt=dt)
        v = conv[..., -Hv * dv:].reshape(B, L, Hv, dv)
        log_g, beta, s0 = -0.1 * mx.abs(arr(B, L, Hv)), mx.sigmoid(arr(B, L, Hv, dt=dt)), 0.1 * arr(B, Hv, dv, dk)
        y, s = delta_rule_cuda(qk, conv, log_g, beta, s0, Hk, Hv, dk, dv)
        q, k = (mx.repeat(t, Hv // Hk, axis=2) for t in (qk[:, :, :Hk], qk[:, :, Hk:]))
        y_ref, s_ref = gated_delta_loop(q, k, v, log_g, beta, s0)
        assert y.dtype == dt and y.shape == y_ref.shape and s.shape == s_ref.shape
        for got, want in ((y, y_ref), (s, s_ref)):
            err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max() / mx.abs(want.astype(mx.float32)).max())
            assert err < (1e-5 if dtype == "float32" else 1e-2), (L, err)
        y2, s2 = delta_rule_cuda(qk, conv, log_g, beta, s0, Hk, Hv, dk, dv)
        assert mx.array_equal(y, y2) and mx.array_equal(s, s2)  # deterministic
        for threads in (32, 64):  # a block's size changes where rows run, not one bit of them
            monkeypatch.setattr(delta_rule, "DELTA_RULE_THREADS", threads)
            y3, s3 = delta_rule_cuda(qk, conv, log_g, beta, s0, Hk, Hv, dk, dv)
            assert mx.array_equal(y, y3) and mx.array_equal(s, s3), threads
        monkeypatch.setattr(delta_rule, "DELTA_RULE_THREADS", 128)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="gather_qmv is a CUDA kernel")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_experts_a_warp_a_row_match_the_exact_product_and_gather_qmm(dtype):
    """`kernels._switch_glu_qmv` (decode's routed experts a warp an output row): against the float32 product of the
    dequantized weights no further off than `gather_qmm`'s path (bf16: the same roundings of gate, up and the
    output; float32: 1e-5 relative); each (token, pick) row the same bits alone or in a call of several tokens,
    run after run; pools read through a view at an offset (a layer's slots of a larger pool) as they are."""
    from bench.common import random_experts
    from streamoe.runtime.models import kernels

    dt, f32 = getattr(mx, dtype), mx.float32
    n_exp, hidden, inter, k = 32, 2048, 512, 8
    kernel = kernels.ExpertKernel(4, 64, n_experts=n_exp)
    x = (mx.random.normal((3, hidden), key=mx.random.key(7)) * 0.5).astype(dt)
    rng = np.random.default_rng(5)
    picks = mx.array(np.stack([rng.choice(n_exp, k, replace=False) for _ in range(3)]), dtype=mx.uint32)

    def product(a, wq, s, b, bias):  # a [3, k or 1, K] times each pick's dequantized matrix, float32 throughout
        m = mx.dequantize(wq[picks], s[picks].astype(f32), b[picks].astype(f32), group_size=64, bits=4)
        y = (m @ a[..., None])[..., 0]
        return y if bias is None else y + bias[picks].astype(f32)

    def rounded(a):  # the roundings both paths make at the dtype: gate and up, the activation's output
        return a.astype(dt).astype(f32)

    for bias in (False, True):
        big = random_experts(2 * n_exp, hidden, inter, 4, dt, bias=bias)
        w = type(big)(*(None if a is None else a[n_exp:] for a in big))  # views at an offset into the pool
        got = kernels._switch_glu_qmv(x, w, picks, kernel)
        theirs = kernels._switch_glu(x, w, picks, kernel)
        xs = x.astype(f32)[:, None, :]
        gate = rounded(product(xs, w.gate_w, w.gate_s, w.gate_b, w.gate_bias))
        up = rounded(product(xs, w.up_w, w.up_s, w.up_b, w.up_bias))
        h = kernel.act(gate.astype(dt), up.astype(dt)).astype(f32)
        exact = product(h, w.down_w, w.down_s, w.down_b, w.down_bias)
        scale = float(mx.abs(exact).max())
        ours, mlx = (float(mx.abs(y.astype(f32) - exact).max()) / scale for y in (got, theirs))
        assert got.dtype == dt and got.shape == theirs.shape == (3, k, hidden)
        if dt == f32:
            assert ours < 1e-5, (bias, ours, mlx)
        else:
            assert ours <= 2 * mlx + 1e-3, (bias, ours, mlx)
        assert mx.array_equal(got, kernels._switch_glu_qmv(x, w, picks, kernel))  # deterministic
        one = kernels._switch_glu_qmv(x[1:2], w, picks[1:2], kernel)
        assert mx.array_equal(one[0], got[1])  # a row alone: the bits it has among others
        copied = type(w)(*(None if a is None else a + 0 for a in w))  # fresh arrays, no offset
        assert mx.array_equal(kernels._switch_glu_qmv(x, copied, picks, kernel), got)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="gather_qmv is a CUDA kernel")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_dense_layer_a_warp_a_row_matches_quantized_matmul(dtype, monkeypatch):
    """One token through a dense 4-bit layer by `gather_qmv` (`kernels.DENSE_QMV`), a bias added: against the
    float32 product of the dequantized weights no further off than MLX's `quantized_matmul` (float32: 1e-5 of the
    largest output; bf16: twice its difference and a rounding), the same bits run after run."""
    from streamoe.runtime.models import kernels

    dt, f32 = getattr(mx, dtype), mx.float32
    w = mx.quantize(mx.random.normal((1000, 512), key=mx.random.key(3)) / 512**0.5, group_size=64, bits=4)
    s, b = w[1].astype(dt), w[2].astype(dt)
    bias = mx.random.normal((1000,), key=mx.random.key(4)).astype(dt)
    layer = kernels.QLinear(w[0], s, b, 4, 64, (), bias)
    x = mx.random.normal((1, 1, 512), key=mx.random.key(5)).astype(dt)
    exact = x.astype(f32) @ mx.dequantize(w[0], s.astype(f32), b.astype(f32), group_size=64, bits=4).T
    exact = exact + bias.astype(f32)
    theirs = layer(x)
    monkeypatch.setattr(kernels, "DENSE_QMV", True)
    got = layer(x)
    assert got.shape == theirs.shape == (1, 1, 1000) and got.dtype == dt
    ours, mlx = (float(mx.abs(y.astype(f32) - exact).max() / mx.abs(exact).max()) for y in (got, theirs))
    assert ours <= (1e-5 if dtype == "float32" else 2 * mlx + 2**-8), (ours, mlx)
    assert mx.array_equal(got, layer(x))


@pytest.mark.skipif(not mx.cuda.is_available(), reason="top_gates is a CUDA kernel")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_router_kernel_picks_the_largest_gates_as_a_stable_sort_does(dtype):
    """`kernels.top_gates` (the router's top-k after its softmax, `ROUTE_KERNEL`): the k largest gates of each row,
    of equal gates the higher index, in ascending (gate, index) order, as the last k of a stable ascending sort;
    scores each gate over their sum (bf16: the sum rounded once, as `route`'s). Rows with many ties (gates of a
    few values) and without; Qwen3.6's 256 experts and k = 8, and sizes that leave lanes empty."""
    from streamoe.runtime.models import kernels

    dt = getattr(mx, dtype)
    rng = np.random.default_rng(11)
    for E, k in ((256, 8), (64, 8), (8, 2), (40, 3)):
        logits = rng.standard_normal((6, E)).astype(np.float32)
        logits[:3] = np.round(logits[:3] * 2) / 2  # ties
        gates = mx.softmax(mx.array(logits).astype(dt), axis=-1, precise=True)
        for norm in (True, False):
            inds, scores = kernels.top_gates(gates, k, norm)
            g = np.array(gates.astype(mx.float32))
            want = np.array([sorted(range(E), key=lambda e, r=r: (g[r, e], e))[-k:] for r in range(6)])
            assert inds.dtype == mx.uint32 and scores.dtype == dt
            assert (np.array(inds) == want).all(), (E, k, np.array(inds), want)
            picked = np.take_along_axis(g, want, axis=1)
            ref = picked / np.array(mx.array(picked).astype(dt).sum(axis=-1, keepdims=True).astype(mx.float32)) if norm else picked
            assert np.abs(np.array(scores.astype(mx.float32)) - ref).max() <= (2**-8 if dtype == "bfloat16" else 1e-6)
        ours = kernels.top_gates(gates, k, True)
        theirs = kernels.route(mx.array(logits).astype(dt), k, True)  # argpartition's order may differ: the set
        apart = np.sort(g, axis=1)[:, ::-1]
        apart = apart[:, k - 1] > apart[:, k]  # rows whose k-th and next gate differ: one right set
        assert apart[3:].any()
        assert (np.sort(np.array(ours[0])[apart], 1) == np.sort(np.array(theirs[0])[apart], 1)).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_one_group_quantized_matmul_matches_the_exact_product_and_itself(dtype):
    """K = group size with several rows (the shapes MLX's CUDA `qmm_sm90` got wrong and unstable on the H200:
    `bench/device_vs_cpu.py --qmm-sweep`) through `kernels.quantized_matmul`: finite, within one rounding to the
    dtype of the exact product of the dequantized weights (float64 on the host), and the same bytes in 10 reruns."""
    from streamoe.runtime.models.kernels import quantized_matmul

    dt = getattr(mx, dtype)
    for bits in (4, 8):
        for m in (16, 33):
            w = mx.random.normal((256, 64), key=mx.random.key(m), stream=mx.cpu) / 8
            q, s, b = mx.quantize(w, group_size=64, bits=bits, stream=mx.cpu)
            x = mx.random.normal((1, m, 64), key=mx.random.key(m + bits), stream=mx.cpu).astype(dt)
            s, b = s.astype(dt), b.astype(dt)
            w64 = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=bits,
                                         stream=mx.cpu), np.float64)
            ref = np.array(x.astype(mx.float32), np.float64) @ w64.T
            outs = [np.array(quantized_matmul(x, q, s, b, 64, bits).astype(mx.float32)) for _ in range(10)]
            assert np.isfinite(outs[0]).all()
            tol = (1e-5 if dt == mx.float32 else 2**-8) * np.abs(ref).max()
            assert np.abs(outs[0] - ref).max() <= tol, (bits, m, float(np.abs(outs[0] - ref).max()))
            assert len({o.tobytes() for o in outs}) == 1, (bits, m)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the experts go grouped by expert on CUDA only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_experts_grouped_by_expert_are_the_per_pair_bits(dtype):
    """A prefill step's routed experts on CUDA go grouped by expert (`kernels._switch_glu_grouped`, several rows to
    a `gather_qmm` batch: an expert's codes read once per batch), which is only sound if each row comes out with
    the bits of the per-pair path (`_switch_glu`, one one-row batch per pair) that decode and small calls take:
    Qwen3.6's expert shapes at 4 and 3 bits, each step size's batch rows (16, 32, 64)."""
    from bench.common import random_experts
    from streamoe.runtime.models import kernels

    dt = getattr(mx, dtype)
    n_exp, hidden, inter, k = 64, 2048, 512, 8
    for bits in (4, 3):
        w = random_experts(n_exp, hidden, inter, bits, dt)
        kernel = kernels.ExpertKernel(bits, 64, n_experts=n_exp)
        for n in (16, 300, 700):  # 2, 37.5 and 87.5 pairs an expert: rows 16, 32, 64
            x = (mx.random.normal((n, hidden), key=mx.random.key(n)) * 0.5).astype(dt)
            rng = np.random.default_rng(n)
            picks = mx.array(np.stack([rng.choice(n_exp, k, replace=False) for _ in range(n)]), dtype=mx.uint32)
            got, ref = kernels.switch_glu(x, w, picks, kernel), kernels._switch_glu(x, w, picks, kernel)
            assert mx.array_equal(got, kernels._switch_glu_grouped(x, w, picks, kernel))  # the grouped path, called directly
            assert bool(mx.isfinite(ref.astype(mx.float32)).all().item())
            assert mx.array_equal(got, ref), (bits, n, mx.abs(got - ref).max().item())


def test_gpu_a_chunk_of_many_blocks_stays_inside_its_activation_account(small_conv, monkeypatch):
    """On a GPU the host queues a chunk's blocks faster than the device runs them: MLX's peak over a 38-block chunk
    still within the plan's activation account (one block's temporaries), each block queued once the one before it
    is computed (`kernels.run_layers`)."""
    from .test_runtime import chunk_of_many_blocks

    chunk_of_many_blocks(small_conv, monkeypatch, 600)
