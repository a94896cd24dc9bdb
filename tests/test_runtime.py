"""runtime/: exactness against mlx-lm, bit-identical logits across caps, telemetry, the cap under a cgroup,
and every runtime bad input's one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from streamoe.formats.manifest import schema
from streamoe.runtime.engine import Engine, Options, plan_for
from streamoe.runtime.telemetry import summarize, summary_line

from .conftest import LOGIT_ATOL, RUNTIME, cli, one_error_line, run_capped

PROMPTS = [
    "def fibonacci(n):\n    return n if n < 2 else",
    "The quick brown fox",
    # long enough for several prefill chunks (chunk 16 below): expert-major prefill through the staging slots
    "import os\nimport sys\n\nclass Reader:\n    def __init__(self, path):\n        self.path = path\n"
    "    def read(self):\n        with open(self.path) as f:\n            return f.read()\n",
]


def reference(ckpt: Path):
    from mlx_lm.utils import load_model

    model, _ = load_model(ckpt)
    model.set_dtype(mx.float32)
    return model


def teacher_forced(ckpt: Path, conv: Path, prompt: str, steps: int, cap_gib: float = 1.0, **opts) -> tuple[list[int], list[int], float]:
    """Greedy tokens of both, feeding the reference's tokens to both; returns (ref, ours, max |Δlogit|)."""
    from mlx_lm.models.cache import make_prompt_cache

    ref = reference(ckpt)
    eng = Engine(conv, Options(cap_gib=cap_gib, ctx=512, prefill_chunk=16, runtime_bytes=RUNTIME, **opts))
    assert cap_gib >= 1.0 or eng.plan.hot_slots < 100
    ids = eng.text.encode(prompt)
    cache = make_prompt_cache(ref)
    lr, le = ref(mx.array([ids]), cache=cache)[0, -1], eng.prefill(ids)
    ours, theirs, worst = [], [], 0.0
    for _ in range(steps):
        a, b = np.array(lr), np.array(le)
        worst = max(worst, float(np.abs(a - b).max()))
        top2 = np.sort(a)[-2:]
        t = int(a.argmax())
        theirs.append(t)
        ours.append(int(b.argmax()) if top2[1] - top2[0] > 2 * LOGIT_ATOL else t)  # near-ties are not a verdict
        lr, le = ref(mx.array([[t]]), cache=cache)[0, -1], eng.forward([t], "decode")
    eng.close()
    return theirs, ours, worst


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tiny_matches_mlx_lm(tiny_ckpt, tiny_conv, prompt):
    ref, ours, worst = teacher_forced(tiny_ckpt, tiny_conv, prompt, 32)
    assert ours == ref
    assert worst < LOGIT_ATOL


def test_small_matches_mlx_lm_at_a_tight_cap(small_ckpt, small_conv):
    base = plan_for(small_conv, Options(cap_gib=8, ctx=512, prefill_chunk=16, runtime_bytes=RUNTIME))
    cap = (base.fixed + 40 * base.slot_bytes) / 2**30  # 40 hot slots of 512 experts
    ref, ours, worst = teacher_forced(small_ckpt, small_conv, PROMPTS[2], 32, cap_gib=cap, prefetch_width=6)
    assert ours == ref and worst < LOGIT_ATOL
    ref2, ours2, worst2 = teacher_forced(small_ckpt, small_conv, PROMPTS[0], 32, cap_gib=cap, tier="lru")
    assert ours2 == ref2 and worst2 < LOGIT_ATOL


def test_qwen35_variant_matches_mlx_lm(tmp_path):
    from streamoe.convert.convert import convert
    from streamoe.convert.synth import synth

    ck, out = tmp_path / "ck", tmp_path / "out"
    synth(ck, size="tiny", variant="qwen3.5", text_only=True, seed=5, shard_bytes=None, dry_run=False)
    convert(ck, out, formats=["q4"], progress=False)
    ref, ours, worst = teacher_forced(ck, out, PROMPTS[0], 32)
    assert ours == ref and worst < LOGIT_ATOL


def run_logits(conv: Path, cap_slots: int | None, steps: int = 24, chunk: int | str = 16, **opts) -> tuple[bytes, Engine]:
    """Logits of PROMPTS[2]'s prefill and `steps` greedy decode steps, at a cap whose hot tier holds `cap_slots`
    experts at the smallest prefill chunk (None: every expert)."""
    base = plan_for(conv, Options(cap_gib=64, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME, **opts))
    cap = 64.0 if cap_slots is None else (base.fixed + cap_slots * base.slot_bytes + 1) / 2**30
    eng = Engine(conv, Options(cap_gib=cap, ctx=256, prefill_chunk=chunk, runtime_bytes=RUNTIME, **opts))
    out = [np.array(eng.prefill(eng.text.encode(PROMPTS[2])).astype(mx.float32))]
    for _ in range(steps):
        out.append(np.array(eng.forward([int(out[-1].argmax())], "decode").astype(mx.float32)))
    eng.close()
    logits = np.stack(out)
    assert np.isfinite(logits).all(), "non-finite logits (equal NaN bytes would pass a bit-identity check)"
    return logits.tobytes(), eng


def teacher_forced_at_slots(ckpt: Path, conv: Path, prompt: str, slots: int, steps: int = 24) -> tuple[list[int], list[int], float]:
    """`teacher_forced` at the cap whose hot tier holds `slots` experts (the plan's smallest prefill chunk)."""
    base = plan_for(conv, Options(cap_gib=8, ctx=512, prefill_chunk=16, runtime_bytes=RUNTIME))
    return teacher_forced(ckpt, conv, prompt, steps, cap_gib=(base.fixed + slots * base.slot_bytes) / 2**30)


def assert_logits_across_caps(conv: Path, all_slots: int, **opts) -> None:
    """Prefill and decode logits are the same bits with every expert resident (`all_slots` in the tier) and with 0 or
    3 hot slots, whatever the tier and the guesses; the capped runs miss, the resident one never (filled at open)."""
    runs = {}
    for slots, width, tier in [(None, 2, "freq"), (0, 2, "freq"), (3, 0, "lru"), (3, 2, "freq")]:
        data, eng = run_logits(conv, slots, steps=12, prefetch_width=width, tier=tier, **opts)
        runs[(slots, width, tier)] = (data, eng.plan.hot_slots, sum(ly.misses for st in eng.steps for ly in st.layers))
    assert runs[(None, 2, "freq")][1] == all_slots and runs[(0, 2, "freq")][1] == 0
    assert runs[(0, 2, "freq")][2] >= runs[(3, 2, "freq")][2] > 0 == runs[(None, 2, "freq")][2]
    first = runs[(None, 2, "freq")][0]
    for key, (data, _, _) in runs.items():
        assert data == first, f"logits differ at {key}"


def compiled_step_bits(conv: Path, monkeypatch, slots: int | None) -> tuple[bytes, bytes]:
    """`run_logits` with each layer's one-token call compiled (the default) and built op by op; the compiled run must
    have taken the compiled functions (its layers keep them)."""
    from streamoe.runtime.models import kernels

    on, eng = run_logits(conv, slots, steps=8)
    kept = {k for layer in eng.model.layers for k in vars(layer) if k.startswith("compiled_")}
    assert kept and (slots is not None or "compiled_resident_experts" in vars(eng.experts)), kept
    monkeypatch.setattr(kernels, "COMPILED_STEP", False)
    off, eng = run_logits(conv, slots, steps=8)
    assert not {k for layer in eng.model.layers for k in vars(layer) if k.startswith("compiled_")}
    return on, off


@pytest.mark.parametrize("slots", [None, 3])
def test_a_compiled_decode_step_is_the_step_built_op_by_op(tiny_conv, monkeypatch, slots):
    """A one-token call runs each layer's work around its cache (and, resident, its experts) as compiled functions:
    the same logits' bits as the same step built op by op, resident and capped."""
    on, off = compiled_step_bits(tiny_conv, monkeypatch, slots)
    assert on == off


def run_ahead_bits(conv: Path, monkeypatch, slots: int, **opts) -> tuple[bytes, bytes, bytes]:
    """`run_logits` (40 decode steps) at `slots` with decode layers run ahead of their picks (on by default on GPUs,
    forced on here), with each layer waiting for its picks, and resident. The run ahead must have run layers ahead
    and thrown some away (its caches rewound), counted each layer's picks once however often it ran, and shown
    both in its summary; the other capped run none."""
    from streamoe.runtime import experts as experts_mod

    monkeypatch.setattr(experts_mod, "DECODE_AHEAD", ("cpu", "gpu"))
    ahead, eng = run_logits(conv, slots, steps=40, **opts)
    layers = [ly for s in eng.steps if s.phase == "decode" for ly in s.layers]
    assert sum(ly.ran_ahead for ly in layers) > len(layers) // 3 and sum(ly.thrown for ly in layers) > 0
    assert all(ly.thrown <= ly.ran_ahead for ly in layers)
    assert all(ly.picks == ly.hits_hot + ly.hits_lent + ly.hits_prefetch + ly.hits_host + ly.misses > 0 for ly in layers)
    summary = summarize(eng.steps, eng.peak_rss, eng.plan.cap)
    assert summary["thrown"] == sum(ly.thrown for ly in layers) / len(layers) > 0
    assert f"layers run ahead {100 * summary['ran_ahead']:.0f}% (" in summary_line(summary)
    monkeypatch.setattr(experts_mod, "DECODE_AHEAD", ())
    usual, eng = run_logits(conv, slots, steps=40, **opts)
    assert not any(ly.ran_ahead for s in eng.steps for ly in s.layers)
    assert "run ahead" not in summary_line(summarize(eng.steps, eng.peak_rss, eng.plan.cap))
    return ahead, usual, run_logits(conv, None, steps=40, **opts)[0]


def test_decode_layers_run_ahead_of_their_picks_give_the_same_bits(small_conv, monkeypatch):
    """A capped decode step that runs layers on the hot tier's slots before reading their picks gives the logits' bits
    of the step that waits for each layer's picks, and of the resident run (caches rewound: Gated DeltaNet and KV)."""
    ahead, usual, resident = run_ahead_bits(small_conv, monkeypatch, 460)
    assert ahead == usual == resident


@pytest.mark.parametrize("slots", [None, 24])
def test_a_closed_engine_frees_its_memory_without_the_cycle_collector(tiny_conv, slots):
    """Nothing an engine keeps refers back to it: the compiled step's functions hold their layers weakly, the experts
    provider keeps no bound method of its own. Once closed and dropped, an engine's arrays are freed at once, resident
    and capped (a server or a bench opening one engine after another must not hold two models' weights)."""
    import gc

    gc.collect()
    gc.disable()
    try:
        base = mx.get_active_memory()
        o = dict(ctx=64, runtime_bytes=RUNTIME)
        p = plan_for(tiny_conv, Options(cap_gib=64, **o))
        cap = 64.0 if slots is None else (p.fixed + slots * p.slot_bytes + 1) / 2**30
        eng = Engine(tiny_conv, Options(cap_gib=cap, **o))
        assert eng.experts.resident == (slots is None)
        tok = int(np.array(eng.prefill(eng.text.encode(PROMPTS[0]))).argmax())
        for _ in range(2):
            tok = int(np.array(eng.forward([tok], "decode")).argmax())
        assert any(k.startswith("compiled_") for k in vars(eng.model.layers[0]))
        held = mx.get_active_memory() - base
        eng.close()
        del eng
        assert held > 1 << 19 and mx.get_active_memory() - base < held // 100, (held, mx.get_active_memory() - base)
    finally:
        gc.enable()


CASES = [(0, 6, "freq"), (0, 0, "lru"), (24, 6, "lru"), (24, 0, "freq"), (200, 6, "freq"), (None, 6, "freq")]


@pytest.mark.parametrize("experts, cases", [("q4", CASES), ("q3", [CASES[0], CASES[1], CASES[2], CASES[-1]])])
def test_logits_bit_identical_across_caps_prefetch_and_tiers(small_conv, experts, cases):
    """Every cap, guess width and tier policy gives the same logits' bits; q3 (slower kernels on the CPU) over
    the ends of that range: the tightest cap with and without guesses, a small tier, resident."""
    runs = {}
    for slots, width, tier in cases:
        data, eng = run_logits(small_conv, slots, experts=experts, prefetch_width=width, tier=tier)
        misses = sum(ly.misses for s in eng.steps for ly in s.layers)
        runs[(slots, width, tier)] = (data, eng.plan.hot_slots, misses)
    assert runs[(0, 6, "freq")][1] == 0 and runs[(None, 6, "freq")][1] == 8 * 64  # barely fitting .. all resident
    assert runs[(0, 0, "lru")][2] > runs[(None, 6, "freq")][2]  # the caps really did stream differently
    first = runs[(0, 6, "freq")][0]
    for key, (data, _, _) in runs.items():
        assert data == first, f"logits differ at {key}"


def test_guesses_follow_the_waste_budget_and_never_change_the_logits(small_conv):
    """The precision a guess needs follows the waste budget (`--prefetch-waste`): no budget drives it to the
    ceiling (few guesses), a large one to the floor; at 5 % the recent waste settles near 5 %. Read-ahead hits and
    waste grow with the budget, and the logits are the same bits whatever was guessed."""
    from streamoe.runtime import experts as experts_mod

    runs = {}
    for budget in (0.0, 0.05, 0.3):
        data, eng = run_logits(small_conv, 128, steps=48, prefetch_waste=budget)
        lay = [ly for s in eng.steps if s.phase == "decode" for ly in s.layers]
        x = eng.experts
        runs[budget] = (data, x.precision, sum(ly.hits_prefetch for ly in lay), sum(ly.prefetch_wasted for ly in lay),
                        x.wrong_recent / x.reads_recent)
    lo, mid, hi = runs[0.0], runs[0.05], runs[0.3]
    assert lo[1] == experts_mod.PRECISION_RANGE[1] and hi[1] == experts_mod.PRECISION_RANGE[0]
    assert lo[1] > mid[1] > hi[1]
    assert lo[2] < mid[2] < hi[2] and lo[3] < mid[3] < hi[3]
    assert 0.03 < mid[4] < 0.08
    assert lo[0] == mid[0] == hi[0]


def prefill_bytes(eng: Engine) -> int:
    return sum(s.bytes_read for s in eng.steps if s.phase == "prefill")


class Streamed(NamedTuple):
    """`run_logits` at 24 hot slots with the default options (chunks of 16 tokens), 8 decode steps."""

    logits: bytes
    computed: list[tuple[int, ...]]  # the slots' shape of each call of the experts' kernels (`_compute`)
    queued: int  # mx.async_eval calls
    prefill_read: int  # bytes prefill read
    prompt_tokens: int

    def first(self, steps: int) -> bytes:
        """The logits of the prefill and the first `steps` decode steps (a run of `steps` steps gives these)."""
        return self.logits[: len(self.logits) // 9 * (steps + 1)]


@pytest.fixture(scope="module")
def at_24_slots(small_conv) -> Streamed:
    """The run three tests compare with, made once: with its hits computed before its misses land, its experts
    queued on their own, and prefill chunks of 16 tokens (the defaults), counting its kernels' calls as it goes."""
    from streamoe.runtime import experts as experts_mod

    computed, queued = [], []
    compute, async_eval = experts_mod.StreamingExperts._compute, mx.async_eval
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts_mod.StreamingExperts, "_compute", lambda self, x, s: (computed.append(s.shape), compute(self, x, s))[1])
        mp.setattr(mx, "async_eval", lambda *a: (queued.append(a), async_eval(*a))[1])
        data, eng = run_logits(small_conv, 24, steps=8)
    return Streamed(data, computed, len(queued), prefill_bytes(eng), len(eng.text.encode(PROMPTS[2])))


def test_hits_computed_while_misses_are_read_give_the_same_bits(small_conv, monkeypatch, at_24_slots):
    """A decode step's hits start computing before its misses land (two calls, rows put back in rank order):
    the logits equal one call's, and the early path really ran."""
    from streamoe.runtime import experts as experts_mod

    split = at_24_slots
    assert any(shape[-1] < 8 for shape in split.computed)  # some layers computed their hits apart
    calls = []
    real = experts_mod.StreamingExperts._compute
    monkeypatch.setattr(experts_mod.StreamingExperts, "_compute", lambda self, x, s: (calls.append(s.shape), real(self, x, s))[1])
    monkeypatch.setattr(experts_mod, "HITS_FIRST", False)
    whole, _ = run_logits(small_conv, 24, steps=8)
    assert all(shape[-1] == 8 for shape in calls) and split.logits == whole


def test_routed_experts_queued_with_the_next_mixer_give_the_same_bits(small_conv, monkeypatch, at_24_slots):
    """Without a launch of their own (`experts.QUEUE_OUTPUT` empty), a layer's routed experts are computed in the
    next layer's fence: the logits equal the queued run's, with at least one launch fewer per streamed decode layer."""
    from streamoe.runtime import experts as experts_mod

    alone = at_24_slots
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(a), real(*a))[1])
    monkeypatch.setattr(experts_mod, "QUEUE_OUTPUT", ())
    together, eng = run_logits(small_conv, 24, steps=8)
    streamed = sum(1 for s in eng.steps if s.phase == "decode" for _ in s.layers)
    assert together == alone.logits
    assert alone.queued - len(queued) >= streamed > 0


def test_prefill_chunk_changes_what_is_read_never_the_logits(small_conv, monkeypatch, at_24_slots):
    """`--prefill-chunk auto`: the plan's chunk (larger where the cap leaves room) reads each layer's experts once
    for all its tokens, and its kernels run over PREFILL_STEP tokens at a time whatever the chunk; so the logits
    equal chunks of PREFILL_STEP tokens bit for bit at every cap, with or without the next layer's reads in
    flight while a layer computes, and the larger chunks read less. (The chunks of 16: `at_24_slots`, whose
    chunks are 16 tokens whatever PREFILL_STEP is.)"""
    from streamoe.runtime import experts as experts_mod
    from streamoe.runtime import plan as plan_mod

    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 16)
    want, n = at_24_slots.first(3), at_24_slots.prompt_tokens
    runs = {slots: run_logits(small_conv, slots, steps=3, chunk="auto") for slots in (0, 2, 200, None)}
    monkeypatch.setattr(experts_mod, "PREFILL_AHEAD", False)
    runs["not ahead"] = run_logits(small_conv, 2, steps=3, chunk="auto")
    chunks = {key: eng.plan.prefill_chunk for key, (_, eng) in runs.items()}
    assert chunks[0] == 16 and chunks[None] == 16  # no room beside the fixed accounts; nothing to read
    assert 16 < chunks[2] < n <= chunks[200] and chunks[2] % 16 == 0  # several chunks; one
    for key, (data, _) in runs.items():
        assert data == want, f"logits differ at {key}"
    assert prefill_bytes(runs[2][1]) < at_24_slots.prefill_read and prefill_bytes(runs[200][1]) < prefill_bytes(runs[2][1])
    ahead = {key: sum(ly.hits_prefetch for s in eng.steps if s.phase == "prefill" for ly in s.layers)
             for key, (_, eng) in runs.items()}
    assert ahead[2] > 0 and ahead["not ahead"] == 0


@pytest.mark.parametrize("ahead", [False, True])
def test_prefill_reads_each_distinct_pick_once_per_chunk(small_conv, monkeypatch, ahead):
    """With a hot tier that holds nothing, a prefill chunk reads exactly its layers' distinct picks' records, less
    those still in a staging slot from the chunk before (a lent hit); read ahead, plus the guesses it wasted."""
    from streamoe.runtime import experts as experts_mod

    monkeypatch.setattr(experts_mod, "PREFILL_AHEAD", ahead)
    _, eng = run_logits(small_conv, 0, steps=1, chunk=16)
    assert eng.plan.hot_slots == 0
    stride, pre = eng.lay.stride, [s for s in eng.steps if s.phase == "prefill"]
    assert len(pre) > 2
    for s in pre:
        lay = s.layers
        assert all(ly.hits_hot == 0 and ly.hits_lent + ly.hits_prefetch + ly.misses == ly.picks for ly in lay)
        assert all(ly.prefetch_issued == ly.hits_prefetch + ly.prefetch_wasted for ly in lay)
        wasted = sum(ly.prefetch_wasted for ly in lay)
        assert s.bytes_read == stride * (sum(ly.picks - ly.hits_lent for ly in lay) + wasted)
        assert ahead or wasted == 0
    assert ahead == (sum(ly.hits_prefetch for s in pre for ly in s.layers) > 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("direct", [True, False])
def test_every_filled_slot_holds_the_file_bytes(tiny_conv, dtype, direct, monkeypatch):
    """The verification mode the GPU tests use, on the CPU: after every fill each slot's bytes (scales cast back
    from the compute dtype) equal the record in the file, written straight into the slot or through the upload
    ring (the GPUs' path) and its wrap-arounds; the logits equal the resident run's."""
    from streamoe.runtime import experts as experts_mod

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    monkeypatch.setattr(experts_mod, "DIRECT_WRITES", direct)
    capped, eng = run_logits(tiny_conv, 4, steps=6, dtype=dtype)
    misses = sum(ly.misses for s in eng.steps for ly in s.layers)
    pools = eng.experts.pools
    assert pools.direct == direct and misses > pools.n  # slots refilled
    assert direct or misses > 2 * pools.uploads  # the ring wrapped
    lay = [ly for s in eng.steps for ly in s.layers]
    assert sum(ly.landing_ms for ly in lay) > 0 and all(ly.copy_wait_ms + ly.sync_ms <= ly.landing_ms for ly in lay)
    waits = (sum(ly.copy_wait_ms for ly in lay), sum(ly.sync_ms for ly in lay))
    assert waits == (0, 0) if direct else min(waits) > 0  # only the ring waits for copy threads and the pools
    resident, _ = run_logits(tiny_conv, None, steps=6, dtype=dtype)
    assert capped == resident


def test_the_slot_check_catches_a_record_landed_wrong(tiny_conv, monkeypatch):
    """The verification mode (every filled slot against the file, batched per landing) names the slot and the
    expert when a record lands with one byte wrong, and passes the same run when nothing is wrong."""
    from streamoe.runtime import experts as experts_mod
    from streamoe.runtime.experts import SlotPools

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    run_logits(tiny_conv, 16, steps=2)  # every landing checked: no error
    real = SlotPools._copy

    def flip_one(self, row, raw, done):
        bad = raw.copy()
        bad[-1] ^= 1  # the last byte of the record: a bias of the down projection
        real(self, row, bad, done)

    monkeypatch.setattr(SlotPools, "_copy", flip_one)
    with pytest.raises(AssertionError, match=r"slot \d+ holds wrong bytes for layer \d+ expert \d+"):
        run_logits(tiny_conv, 16, steps=2)


def test_ring_updates_are_in_place_and_a_copied_pool_is_caught(tiny_conv, monkeypatch):
    """The upload ring's scatters update each pool in place (a copy would be a whole pool outside the plan); the
    verification mode catches a copy: with another holder of a pool, MLX cannot donate it to its update."""
    from streamoe.formats.manifest import load_manifest
    from streamoe.runtime import experts as experts_mod
    from streamoe.runtime.experts import SlotPools
    from streamoe.runtime.store import ExpertStore

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    m = load_manifest(tiny_conv)
    store = ExpertStore.open(tiny_conv, m, "q4", 2, ring=4)
    pools = SlotPools(16, store.lay, mx.float32, 4, direct=False)
    record = memoryview(bytearray(store.read_bytes(1, 3).ljust(store.lay.stride, b"\0")))
    try:
        pools.stage(5, record, lambda: None)
        pools.flush()  # in place: no error
        assert pools.bytes_at([5]) == [store.read_bytes(1, 3)]
        assert pools.bytes_at([0, 5])[1] == store.read_bytes(1, 3) != pools.bytes_at([0, 5])[0]
        held = pools.arrays[0][:1]  # a reader not yet evaluated holds the first pool: its next update must copy it
        pools.stage(6, record, lambda: None)
        with pytest.raises(AssertionError, match="pool 0 .* was copied"):
            pools.flush()
        del held
    finally:
        pools.close()
        store.close()


def test_telemetry_adds_up_and_validates(small_conv, tmp_path):
    _, eng = run_logits(small_conv, 16, steps=12, prefetch_width=6)
    cache = eng.plan.cache_limit
    assert mx.set_cache_limit(cache) == cache  # the buffers MLX keeps for reuse are the plan's account, no more
    assert cache - eng.plan.accounts["allocator cache"] < eng.plan.slot_bytes  # capped: the cap holds slots
    stride = eng.lay.stride
    for s in eng.steps:
        jsonschema.validate(s.to_json(), schema("telemetry.schema.json"))
        assert 0 < s.host_ms <= s.ms  # the host's part of the step: inside its wall time
        assert 0 <= s.disk_busy_ms <= s.ms + 1  # the disk's working time in the step: inside it too
        for ly in s.layers:
            assert ly.hits_hot + ly.hits_lent + ly.hits_prefetch + ly.misses == ly.picks
            assert ly.prefetch_wasted <= ly.prefetch_issued
        assert sum(ly.bytes_read for ly in s.layers) == stride * sum(
            ly.misses + (s.layers[ly.layer + 1].prefetch_issued if ly.layer + 1 < len(s.layers) else 0) for ly in s.layers)
    dec = [s for s in eng.steps if s.phase == "decode"]
    assert all(sum(ly.picks for ly in s.layers) == 8 * 8 for s in dec)  # top-8 x 8 layers
    assert sum(ly.hits_prefetch for s in dec for ly in s.layers) > 0
    assert sum(s.disk_busy_ms for s in dec) > 0  # misses were read during decode
    line = summary_line(summarize(eng.steps, eng.peak_rss, eng.plan.cap))
    assert re.search(r"disk busy \d+%", line)
    stats = tmp_path / "s.jsonl"
    p = cli("run", small_conv, "--cap", "1", "--ctx", "256", "-p", "hello", "-n", "6", "--stats", stats, "--raw", check=True)
    recs = [json.loads(ln) for ln in stats.read_text().splitlines()]
    assert recs[0]["phase"] == "prefill" and sum(r["phase"] == "decode" for r in recs) >= 1
    assert "tok/s" in p.stderr and "hit rate" in p.stderr
    assert "disk busy" not in p.stderr  # everything resident at this cap: nothing read in decode
    one = cli("run", small_conv, "--cap", "1", "--ctx", "256", "-p", "hello", "-n", "1", "--raw", check=True)
    assert "[1 token (a rate needs two); hit rate" in one.stderr and "0.00 tok/s" not in one.stderr, one.stderr


def test_cli_logits_out_equal_across_caps(small_conv, tmp_path):
    base = plan_for(small_conv, Options(cap_gib=8, ctx=256))
    outs = []
    for cap in (base.fixed / 2**30 + 0.12, 2.0):
        f = tmp_path / f"l{cap}.npz"
        cli("run", small_conv, "--cap", f"{cap:.3f}", "--ctx", "256", "-p", PROMPTS[1], "-n", "8", "--logits-out", f, "-q",
            "--seed", "3", check=True)
        outs.append(np.load(f)["logits"])
    assert outs[0].shape[0] >= 1 and outs[0].tobytes() == outs[1].tobytes()


# ---- the cap holds under a real cgroup-v1 memory limit

def test_run_inside_cgroup_limit_equal_to_cap(small_conv, tmp_path):
    plan = plan_for(small_conv, Options(cap_gib=8, ctx=512, runtime_bytes=160 << 20))
    cap_gib = round((plan.fixed + 120 * plan.slot_bytes) / 2**30, 3)  # about 120 of the 512 experts
    stats = tmp_path / "stats.jsonl"
    p, failcnt, peak = run_capped(["run", small_conv, "--cap", cap_gib, "--ctx", 512, "-p", "def main():", "-n", 24,
                                   "--raw", "--stats", stats], cap_gib)
    assert p.returncode == 0, p.stderr
    assert failcnt == 0 and peak <= cap_gib * 2**30
    decode = [json.loads(ln) for ln in stats.read_text().splitlines() if '"decode"' in ln]
    assert sum(ly["misses"] for r in decode for ly in r["layers"]) > 0, "the cap must hold only a fraction of the experts"


def test_long_prompt_at_a_quarter_cap_stays_inside_the_cgroup(small_conv, tmp_path):
    """A prompt longer than a step at a quarter cap, in one auto chunk (its layers run block by block): the cgroup
    whose limit is the cap is never reached. (16K tokens: `python -m bench.prefill --prompts 16384 --cgroup`.)"""
    plan = plan_for(small_conv, Options(cap_gib=8, ctx=1024, runtime_bytes=160 << 20, prefill_chunk=256))
    cap_gib = round((plan.fixed + 128 * plan.slot_bytes) / 2**30, 3)  # a quarter of the 512 experts at one step
    stats = tmp_path / "stats.jsonl"
    p, failcnt, peak = run_capped(["run", small_conv, "--cap", cap_gib, "--ctx", 1024, "-p", PROMPTS[2] * 7, "-n", 2,
                                   "--raw", "--stats", stats], cap_gib)
    assert p.returncode == 0, p.stderr
    assert failcnt == 0 and peak <= cap_gib * 2**30
    pre = [json.loads(ln) for ln in stats.read_text().splitlines() if '"prefill"' in ln]
    assert len(pre) == 1 and pre[0]["n_tokens"] > 512 and pre[0]["bytes_read"] > 0
    assert re.search(r"prefill \d+ tokens in [\d.]+ s \([\d.]+ tok/s, [\d.]+ MiB read/token\)", p.stderr)


def test_a_prompt_given_before_the_run_opens_has_its_tokenizing_planned(tiny_conv, tmp_path):
    """-f TEXT: what the tokenizer holds for it (TOKENIZE_BYTES a byte) is an account of the plan the run opens with (and
    `plan -f` prints), so a cap that holds the plan but not that is refused naming the need with it; a text longer than the context can
    hold at the tokenizer's longest token is charged only up to that (it is refused before it is tokenized)."""
    from streamoe.runtime.text import TOKENIZE_BYTES

    text = "Reading the tokens of a long prompt costs memory. " * 100  # 2,800 tokens
    (tmp_path / "p.txt").write_text(text)
    args = ["--ctx", "4096", "--runtime-mib", "64", "--raw", "-n", "1", "-f", tmp_path / "p.txt"]
    fixed = json.loads(cli("plan", tiny_conv, "--ctx", "4096", "--runtime-mib", "64", "--json", check=True).stdout)["fixed"]
    held = fixed + TOKENIZE_BYTES * len(text.encode())
    planned = json.loads(cli("plan", tiny_conv, *args[:4], "--json", "-f", tmp_path / "p.txt", check=True).stdout)
    assert planned["fixed"] == held and planned["accounts"]["prompt"] == TOKENIZE_BYTES * len(text.encode())
    line = one_error_line(cli("run", tiny_conv, "--cap", f"{(held - 2048) / 2**30:.9f}", *args), "too small")
    need = re.search(r"need (\d+\.(\d+)) GiB", line)
    assert need.group(1) == f"{held / 2**30:.{len(need.group(2))}f}"
    assert cli("run", tiny_conv, "--cap", f"{(held + 2**20) / 2**30:.9f}", *args).returncode == 0
    eng = Engine(tiny_conv, Options(cap_gib=1, ctx=4096, runtime_bytes=64 << 20))
    assert "bound" not in vars(eng.text)  # an engine given no prompt leaves the tokenizer's JSON unparsed
    eng.close()
    (tmp_path / "long.txt").write_text(text * 100)  # 2 MB: far past what 4,096 tokens cover
    line = one_error_line(cli("run", tiny_conv, "--cap", f"{(held + 2**20) / 2**30:.9f}", *args[:-1], tmp_path / "long.txt"),
                          "longer than the planned context")


def test_a_sampled_run_refused_for_its_prompts_length_says_only_that(tiny_conv):
    """A sampled run says how it draws before its answer, and not before a refusal: a prompt the context cannot
    hold (past the lower bound that refuses it unread) is one line."""
    p = cli("run", tiny_conv, "--cap", "1", "--ctx", "16", "--temp", "0.7", "--raw", "-p", "word " * 40)
    one_error_line(p, "prompt of", "longer than the planned context --ctx 16")


# ---- bad input to the runtime: one line naming the file, non-zero exit, no traceback

def test_missing_and_corrupt_manifest(tiny_conv, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(tiny_conv, out)
    (out / "manifest.json").write_text("[1, 2")
    one_error_line(cli("run", out, "-p", "hi"), "manifest.json", "does not parse")
    (out / "manifest.json").unlink()
    one_error_line(cli("run", out, "-p", "hi"), "manifest.json", "missing")
    one_error_line(cli("plan", tmp_path / "nowhere"), "nowhere", "missing")
    (tmp_path / "afile").write_text("x")
    one_error_line(cli("plan", tmp_path / "afile"), "afile", "is a regular file, not a directory")


def test_truncated_and_resized_layer_file(tiny_conv, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(tiny_conv, out)
    layer = out / "experts" / "q4" / "layer-02.bin"
    os.truncate(layer, layer.stat().st_size - 4096)
    one_error_line(cli("run", out, "--cap", "1", "-p", "hi"), str(layer), "truncated")


def test_checksum_mismatch_with_verify(tiny_conv, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(tiny_conv, out)
    blob = out / "nonexpert.bin"
    data = bytearray(blob.read_bytes())
    data[5000] ^= 1
    blob.write_bytes(bytes(data))
    one_error_line(cli("run", out, "--cap", "1", "-p", "hi", "--verify"), str(blob), "checksum mismatch")


def test_cap_too_small_names_smallest_cap(tiny_conv):
    p = cli("run", tiny_conv, "--cap", "0.01", "-p", "hi")
    line = one_error_line(p, "too small", "smallest cap that fits: --cap")
    need = float(line.rsplit("--cap", 1)[1])
    assert cli("run", tiny_conv, "--cap", str(need), "-p", "hi", "-n", "2").returncode == 0
    p = cli("plan", tiny_conv, "--cap", "0.01")
    assert p.returncode == 2 and "memory plan" in p.stdout


def test_run_fits_the_cap_plan_says_fits(tiny_conv):
    """`plan` measures the runtime account with what `run` has loaded when it opens (its modules, the tokenizer): a
    cap 2 MiB over what `plan` needs runs (a run's resident set is within a fraction of a MiB of the plan's)."""
    need = json.loads(cli("plan", tiny_conv, "--cap", "1", "--json", check=True).stdout)["fixed"]
    cli("run", tiny_conv, "--cap", f"{(need + (2 << 20)) / 2**30:.6f}", "-p", "hi", "-n", "1", "-q", check=True)


def test_a_prompt_from_stdin_or_a_file_is_the_prompt(tiny_conv, tmp_path):
    """`-p -` reads the prompt from stdin (mlx-lm's convention), `--prompt-file` from a file (llama.cpp's -f) or a pipe
    (`-f <(...)`, `-f /dev/stdin`): the same tokens as the text given with -p, newlines and all."""
    text = PROMPTS[1] + "\n\n# é\n"
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    run = ("run", tiny_conv, "--cap", "1", "--ctx", "256", "--raw", "--temp", "0", "-n", "6", "-q")
    want = cli(*run, "-p", text, check=True).stdout
    assert want.strip()
    assert cli(*run, "-p", "-", input=text, check=True).stdout == want
    assert cli(*run, "-f", tmp_path / "prompt.txt", check=True).stdout == want
    assert cli(*run, "-f", "/dev/stdin", input=text, check=True).stdout == want  # stdin a pipe: what <(...) gives
    one_error_line(cli(*run, "-p", "-", input="caf\udce9", errors="surrogateescape"), "stdin", "not UTF-8")
    one_error_line(cli(*run, "-p", "-", "--chat", input="hi"), "--chat reads its turns from stdin")


def test_stats_go_to_a_pipe_a_descriptor_or_through_a_link_and_a_session_only_to_a_file(tiny_conv, tmp_path):
    """`--stats` as a shell redirect writes it: into a pipe (`/dev/stdout` under a pipe, `>(jq .)`), appended to the
    file a descriptor points at (`/dev/fd/2` under `2> log`), or through a symlink to the file it names, the link kept
    (a rename over the link replaced it: as root, /dev/stderr itself); a FIFO nobody reads is one line, not a hang; a
    session is a file of its own."""
    run = ("run", tiny_conv, "--cap", "1", "--ctx", "256", "--raw", "--temp", "0", "-n", "4", "-q", "-p", "def f(x):")
    cli(*run, "--stats", tmp_path / "s.jsonl", check=True)
    want = (tmp_path / "s.jsonl").read_text().splitlines()
    assert len(want) == 5 and all(json.loads(ln)["step"] == i for i, ln in enumerate(want))
    answer = cli(*run, check=True).stdout

    def steps(lines: list[str]) -> list[int]:
        return [json.loads(ln)["step"] for ln in lines if ln.startswith("{")]

    piped = cli(*run, "--stats", "/dev/stdout", check=True).stdout
    assert piped.startswith(answer) and steps(piped.splitlines()) == list(range(5))
    with open(tmp_path / "log", "w") as log:
        log.write("before\n")
        log.flush()
        p = subprocess.run([sys.executable, "-m", "streamoe.cli", *map(str, run), "--stats", "/dev/fd/2"],
                           stdout=subprocess.PIPE, stderr=log, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout == answer
    logged = (tmp_path / "log").read_text().splitlines()
    assert logged[0] == "before" and steps(logged) == list(range(5))
    (tmp_path / "target.jsonl").write_text("old\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "target.jsonl")
    cli(*run, "--stats", tmp_path / "link.jsonl", check=True)
    assert (tmp_path / "link.jsonl").is_symlink() and steps((tmp_path / "target.jsonl").read_text().splitlines()) == list(range(5))
    os.mkfifo(tmp_path / "fifo")
    one_error_line(cli(*run, "--stats", tmp_path / "fifo", timeout=120), str(tmp_path / "fifo"), "a pipe no one reads")
    one_error_line(cli(*run, "--save-session", "/dev/fd/2"), "/dev/fd/2", "is a FIFO", "--save-session")
    with open(tmp_path / "log2", "w") as log:  # a descriptor of a file: still not a session file of its own
        p = subprocess.run([sys.executable, "-m", "streamoe.cli", *map(str, run), "--save-session", "/dev/fd/2"],
                           stdout=subprocess.PIPE, stderr=log, text=True, timeout=300)
    p.stderr = (tmp_path / "log2").read_text()
    one_error_line(p, "/dev/fd/2", "is an open descriptor of this process", "--save-session")


def test_a_chat_turn_of_several_lines_is_one_turn(tiny_conv):
    """Pasted lines between two lines of three double quotes (ollama's form), or lines ending in a backslash
    (llama.cpp's), are one turn: the answer is the one-shot prompt's."""
    run = ("run", tiny_conv, "--cap", "1", "--ctx", "256", "--raw", "--temp", "0", "-n", "6", "-q")
    want = cli(*run, "-p", "def f(x):\n    return x", check=True).stdout.strip()
    assert want
    for typed in ('"""\ndef f(x):\n    return x\n"""\n', "def f(x):\\\n    return x\n"):
        got = cli(*run, "--chat", input=typed, check=True).stdout
        assert got.strip() == want, got  # one answer; no prompt shown where no person types (stdin piped)


def test_chat_help_and_a_mistyped_command_are_not_sent(tiny_conv):
    """`/help` lists the commands; an unknown `/word` (a mistyped `/image`) is said, not sent as a turn; a turn
    that starts with '/' goes as text after a space, or where its first word is no command (a path)."""
    run = ("run", tiny_conv, "--cap", "1", "--ctx", "256", "--raw", "--temp", "0", "-n", "4", "--chat")
    p = cli(*run, input="/help\n/imgae x.png\n/bogus\n /bogus\n/usr/bin is where?\n", check=True)
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("(")]
    assert notes[0].startswith("(The commands: /image PATH"), p.stderr
    assert notes[1].startswith("(unknown command /imgae (not sent;") and notes[2].startswith("(unknown command /bogus"), notes
    assert p.stderr.count(" tokens, ") == 2  # " /bogus" and the path: two turns answered


def test_chat_clear_empties_the_conversation_and_p_is_its_first_turn(tiny_conv, tmp_path):
    """`/clear` starts the conversation anew (the next turn's logits are a fresh chat's first turn's, bit for bit);
    `-p` with `--chat` is the chat's first turn; an empty line is no turn; a turn the full context refuses says
    that `/clear` empties it."""
    run = ("run", tiny_conv, "--cap", "1", "--ctx", "256", "--temp", "0", "-n", "6", "-q", "--chat")

    def logits(name: str, *args: str, typed: str) -> bytes:
        cli(*run, *args, "--logits-out", tmp_path / f"{name}.npz", input=typed, check=True)
        return np.load(tmp_path / f"{name}.npz")["logits"].tobytes()

    fresh = logits("fresh", typed="What colour is it?\n")
    cleared = logits("cleared", typed="What shape is it?\n/clear\n\nWhat colour is it?\n")
    assert cleared.endswith(fresh) and len(cleared) == 2 * len(fresh)
    assert logits("first", "-p", "What shape is it?", typed="/clear\nWhat colour is it?\n") == cleared
    full = cli(*run[:4], "--ctx", "40", *run[6:], input="What shape is it?\nWhat colour is it?\n" * 2, check=True)
    assert "; /clear empties the conversation)" in full.stderr, full.stderr


def test_prompt_longer_than_ctx_names_the_ctx_it_needs(tiny_conv):
    run = ("run", tiny_conv, "--cap", "1", "-p", "a b c d e f g h i j k l m n o p", "--raw", "--temp", "0", "-n", "1")
    line = one_error_line(cli(*run, "--ctx", "8"), "longer than the planned context --ctx 8")
    need = int(re.search(r"it needs --ctx (\d+)", line).group(1))
    one_error_line(cli(*run, "--ctx", str(need - 1)), f"it needs --ctx {need}")
    cli(*run, "--ctx", str(need), check=True)  # and the one token it answers


def test_an_answer_cut_by_the_context_says_so(tiny_conv):
    """An answer that fills --ctx ends there with one line saying why; one that ends by itself or by -n says nothing."""
    run = ("run", tiny_conv, "--cap", "1", "--raw", "--temp", "0", "-p", "def f(x):")
    cut = cli(*run, "--ctx", "40", "-n", "100", check=True)
    assert "(the answer was cut by the context: --ctx 40 is full)" in cut.stderr.splitlines()
    prompt, answered = (int(re.search(pat, cut.stderr).group(1)) for pat in (r"prefill (\d+) tokens", r"\[(\d+) tokens"))
    assert prompt + answered - 1 == 40  # every answer token fed but the last, drawn from the last position's logits
    for more in (("--ctx", "40", "-n", "20"), ("--ctx", "4096", "-n", "100")):
        assert "cut by the context" not in cli(*run, *more, check=True).stderr


@pytest.mark.parametrize("args,needle", [(["--top-p", "0"], "--top-p"), (["--temp", "-1"], "--temp"),
                                         (["--top-k", "-2"], "--top-k"), (["--experts", "q2"], "--experts"),
                                         (["--prefill-chunk", "big"], "--prefill-chunk"),
                                         (["--prefill-chunk", "0"], "--prefill-chunk"),
                                         (["--raw", "--no-think"], "--no-think renders the chat template"),
                                         (["--prefetch-width", "0", "--prefetch-waste", "0.5"], "--prefetch-width 0 turns off")])
def test_bad_sampling_options(tiny_conv, args, needle):
    """A bad value, or an option that another makes meaningless: one line, exit 2 (never silently ignored)."""
    p = cli("run", tiny_conv, "-p", "hi", *args)
    assert p.returncode == 2
    one_error_line(p, needle)


def test_python_m_streamoe_is_the_command_and_its_hints_name_it(tiny_conv):
    """`python -m streamoe` runs the CLI; however started, a usage error's hint names `streamoe COMMAND --help`."""
    for module in ("streamoe", "streamoe.cli"):
        p = subprocess.run([sys.executable, "-m", module, "run", str(tiny_conv), "-n", "0", "-p", "hi"],
                           capture_output=True, text=True, timeout=120)
        assert one_error_line(p, "--max-tokens").endswith("(see streamoe run --help)"), p.stderr
    p = subprocess.run([sys.executable, "-m", "streamoe", "plan", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("Usage: streamoe plan [OPTIONS] MODEL"), p.stdout


def test_plan_prints_the_prefill_chunk(tiny_conv):
    p = cli("plan", tiny_conv, "--cap", "1", "--runtime-mib", "64", "--json", "--prefill-chunk", "96", check=True)
    assert (json.loads(p.stdout)["prefill_chunk"], json.loads(p.stdout)["prefill_step"]) == (96, 96)
    p = cli("plan", tiny_conv, "--cap", "1", "--runtime-mib", "64", check=True)
    assert re.search(r"prefill chunk +\d+ tokens", p.stdout)


def test_plan_from_bare_config_of_the_real_model(tmp_path):
    from streamoe.convert.synth import make_config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(make_config("full")))
    p = cli("plan", cfg, "--cap", "4", "--ctx", "4096", check=True)
    hot = next(ln for ln in p.stdout.splitlines() if "hot tier" in ln)
    assert float(hot.split()[2]) >= 0.5, p.stdout  # >= 0.5 GiB of hot tier at cap 4
    assert "1,769,472 B per expert" in p.stdout


def test_a_reset_takes_no_second_kv_cache_and_leaves_no_trace(tiny_conv):
    """An empty conversation reuses the caches (allocating new ones beside the old would hold two KV caches at once,
    outside the plan), and the next answer is the one a fresh engine gives."""
    opts = Options(cap_gib=64, ctx=4096, prefill_chunk=16, runtime_bytes=RUNTIME)
    fresh = Engine(tiny_conv, opts)
    want = np.array(fresh.prefill(fresh.text.encode(PROMPTS[0]))).tobytes()
    fresh.close()
    eng = Engine(tiny_conv, opts)
    mx.eval(eng.prefill(eng.text.encode(PROMPTS[1] * 3)))
    kv = eng.plan.accounts["kv cache"]
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    eng.reset()
    assert mx.get_peak_memory() - held < kv / 4, (mx.get_peak_memory() - held, kv)
    assert eng.offset == 0 and np.array(eng.prefill(eng.text.encode(PROMPTS[0]))).tobytes() == want
    eng.close()


def test_a_chunk_of_many_blocks_stays_inside_its_activation_account(small_conv, monkeypatch):
    """A capped prefill chunk runs its layers block by block (`kernels.run_layers`); MLX's peak over it, beyond
    what the engine held, stays within the plan's activation account, which holds one block's temporaries and the
    chunk's residual rows. A block is queued only once the one before it is settled: on a GPU, whose host queues
    blocks faster than the device runs them, a layer's blocks otherwise all held their temporaries at once (this
    CPU keeps pace with its host, so here the count of settled blocks shows it: two waits a block after the first,
    one before its routing and one before its experts, in every layer; 13 blocks show it as 38 do, which the GPU
    test runs to hold its memory to the account)."""
    chunk_of_many_blocks(small_conv, monkeypatch, 200)


def chunk_of_many_blocks(conv: Path, monkeypatch, tokens: int) -> None:
    """The check of the test above over a prompt of `tokens` tokens in blocks of 16, one chunk of a context 40
    tokens longer, at a cap 128 expert slots above the fixed accounts (it streams)."""
    from streamoe.runtime import plan as plan_mod
    from streamoe.runtime.models import kernels

    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 16)
    settled = []
    settle = kernels.settle
    monkeypatch.setattr(kernels, "settle", lambda x, *a: (settled.append(x.shape), settle(x, *a)))
    opts = dict(ctx=tokens + 40, prefill_chunk="auto", runtime_bytes=RUNTIME)
    base = plan_for(conv, Options(cap_gib=64, **opts))
    eng = Engine(conv, Options(cap_gib=(base.fixed + 128 * base.slot_bytes + 1) / 2**30, **opts))
    text = eng.text.encode(PROMPTS[1])
    ids = (text * (tokens // len(text) + 1))[:tokens]
    assert len(ids) == tokens
    assert not eng.experts.resident and eng.plan.prefill_step == 16 and eng.plan.prefill_chunk >= tokens
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(eng.prefill(ids))
    work = mx.get_peak_memory() - held
    assert 0 < work <= eng.plan.accounts["activations"], (work, eng.plan.accounts["activations"])
    blocks, layers = -(-len(ids) // 16), eng.args.num_hidden_layers
    attention = sum(1 for c in eng.conversation.caches if hasattr(c, "keys"))  # a KV write waits for its block too
    assert len(settled) == (2 * layers + attention) * (blocks - 1), (len(settled), blocks, layers, attention)
    eng.close()


def test_a_resident_prefill_queues_each_layer_once_the_one_before_is_settled(tiny_conv, monkeypatch):
    """Every expert resident, each prefill chunk is one step of one block, all its layers in one graph the host
    builds without waiting on the device (`kernels.run_layers`). MLX's peak over the prefill, beyond what the engine
    held, stays within the plan's activation account, which holds one step's temporaries: so each layer's experts
    are queued only once the layer before it (for the first, the chunk's input) is settled. Without that wait a GPU,
    whose host queues layers faster than the device runs them and whose backend holds every queued kernel's
    temporaries until its graph completes, held many layers' at once (H200, 32K-token prompt: 3,771 MiB against an
    account of 917 MiB). This CPU frees each kernel's temporaries as it runs and keeps pace with its host, so here
    the settled layers show it: one wait a layer, in every chunk, each counted as the device's time."""
    from streamoe.runtime import plan as plan_mod
    from streamoe.runtime.models import kernels

    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 64)
    settled = []
    settle = kernels.settle
    monkeypatch.setattr(kernels, "settle", lambda x, *a: (settled.append(x.shape), settle(x, *a)))
    eng = Engine(tiny_conv, Options(cap_gib=64, ctx=1024, prefill_chunk="auto", runtime_bytes=RUNTIME))
    ids = (eng.text.encode(PROMPTS[2]) * 40)[:960]
    step, layers, hidden = eng.plan.prefill_step, eng.args.num_hidden_layers, eng.args.hidden_size
    assert eng.experts.resident and eng.plan.prefill_chunk == step < len(ids)
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(eng.prefill(ids))
    work = mx.get_peak_memory() - held
    assert 0 < work <= eng.plan.accounts["activations"], (work, eng.plan.accounts["activations"])
    chunks = -(-len(ids) // step)
    assert settled == [(1, step, hidden)] * (layers * chunks), (len(settled), layers, chunks)
    pre = [s for s in eng.steps if s.phase == "prefill"]
    assert len(pre) == chunks and all(ly.compute_ms > 0 for s in pre for ly in s.layers)
    eng.close()


@pytest.mark.parametrize("max_tokens", [1, 5, 40])
def test_pipelined_resident_generate_equals_the_plain_loop(small_conv, max_tokens):
    """Everything resident, greedy: each step is queued before the previous token is read. The tokens, their
    logits, and the state left for the next turn (a step queued for a token that ended the answer is taken
    back) equal a capped run's, which decodes one token at a time."""
    from streamoe.runtime.sampling import Sampler

    results = []
    for slots in (None, 24):
        base = plan_for(small_conv, Options(cap_gib=64, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME))
        cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
        eng = Engine(small_conv, Options(cap_gib=cap, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME))
        assert eng.experts.resident == (slots is None)
        eng.text.stop_ids = {int(np.array(eng.prefill(eng.text.encode(PROMPTS[1]))).argsort()[-3])}  # a stop it may meet
        eng.reset()
        out = [(t, np.array(lg).tobytes()) for t, lg in eng.generate(eng.text.encode(PROMPTS[0]), max_tokens, Sampler())]
        after = np.array(eng.prefill(eng.text.encode(PROMPTS[1]))).tobytes()  # the next turn sees the same state
        results.append((out, eng.offset, after, [s.token_id for s in eng.steps if s.phase == "decode"]))
        eng.close()
    assert results[0] == results[1]
    assert len(results[0][0]) >= 1


def test_the_summarys_peak_holds_what_fell_between_two_steps(tiny_conv):
    """The summary's peak is the process's high-water mark, not only the samples taken at each step: a transient
    between two steps (an image decoded, a prompt tokenized) is in it. Here 256 MiB held and freed after the
    answer's steps."""
    from streamoe.runtime.plan import current_rss
    from streamoe.runtime.sampling import Sampler

    eng = Engine(tiny_conv, Options(cap_gib=1, ctx=128, runtime_bytes=RUNTIME))
    try:
        list(eng.generate(eng.text.encode("def f(x):"), 4, Sampler()))
        held = np.ones(256 << 20, dtype=np.uint8)  # touched: resident
        at = current_rss()
        del held
        assert eng.peak_rss < at  # no step sampled it
        assert eng.summary(eng.steps)["peak_gib"] * 2**30 >= at - (1 << 20)
    finally:
        eng.close()
