"""Quantized KV cache (`--kv q8` / `--kv q4`): attention scored on the stored codes agrees with mlx-lm's
quantized SDPA, the plan bounds what that attention allocates, logits are bit-identical across caps, and
sessions and prompt-cache snapshots restore to bit-identical continuations."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache as PeerCache

from streamoe.formats.config import ModelArgs
from streamoe.formats.errors import StreamoeError
from streamoe.formats.manifest import load_manifest
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.models import kernels
from streamoe.runtime.models.cache import KVCache, QuantizedKVCache
from streamoe.runtime.plan import attention_elements, make_plan, plan_for, plan_with_limits, state_bytes
from streamoe.runtime.serve import prompt_cache
from streamoe.runtime.session import load_session, save_session

from .conftest import RUNTIME, cli

PROMPT = [5, 17, 300, 41, 9, 77, 120, 3, 64, 250, 11, 40, 41, 42, 500, 7, 99, 12, 13]


def filled(bits: int, n: int, new: int, dtype=mx.float32, B=1, nq=4, nkv=2, hd=64, seed=0):
    """Our cache and mlx-lm's, fed the same n - new keys/values then `new` more; returns (ours, peer, queries)."""
    mx.random.seed(seed)
    k, v = (mx.random.normal((B, nkv, n, hd)).astype(dtype) for _ in range(2))
    q = mx.random.normal((B, nq, new, hd)).astype(dtype)
    ours, peer = QuantizedKVCache(B, nkv, hd, n + 8, bits, dtype), PeerCache(group_size=64, bits=bits)
    out = []
    for c in (ours, peer):
        if n > new:
            c.update_and_fetch(k[:, :, : n - new], v[:, :, : n - new])
        out.append(c.update_and_fetch(k[:, :, n - new:], v[:, :, n - new:]))
    return out[0], out[1], q


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_scores_on_the_codes_match_mlx_lm_quantized_sdpa(monkeypatch, bits, dtype):
    """The same codes as mlx-lm's QuantizedKVCache stores, and the same attention output as its quantized SDPA
    over them, bit for bit on the CPU: decode, a prompt chunk in one block, and one split into blocks of rows."""
    for new, block_rows in ((1, None), (37, None), (37, 5)):
        if block_rows:
            monkeypatch.setattr(kernels, "ATTN_SCORES_BYTES", 4 * 300 * dtype.size * block_rows)
        (k, v), (pk, pv), q = filled(bits, 300, new, dtype)
        rows = kernels.score_rows(4, 300, dtype.size)
        assert rows == block_rows if block_rows else rows >= new  # split into blocks, or one
        for a, b in zip(k + v, pk + pv, strict=True):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()
        ours = kernels.quantized_attention(q, k, v, 0.125, bits)
        # and it is attention: the float attention over the dequantized keys and values, up to rounding
        deq = [mx.dequantize(*t, group_size=64, bits=bits) for t in (k, v)]
        exact = mx.fast.scaled_dot_product_attention(q, *deq, scale=0.125, mask="causal" if new > 1 else None)
        assert mx.abs(ours.astype(mx.float32) - exact.astype(mx.float32)).max().item() < (1e-6 if dtype == mx.float32 else 0.05)
        peer = quantized_scaled_dot_product_attention(q, pk, pv, scale=0.125, mask="causal" if new > 1 else None,
                                                      group_size=64, bits=bits)  # scales q in place: last
        assert ours.dtype == peer.dtype and mx.array_equal(ours, peer).item(), (new, block_rows)


def test_codes_are_the_documented_affine_layout():
    """docs/FORMAT.md: value = scale * q + bias, codes packed from the lowest bits of each uint32 up."""
    for bits in (8, 4):
        (k, _), _, _ = filled(bits, 8, 8, nkv=1)
        codes, scales, biases = (np.array(a) for a in k)
        per = 32 // bits
        q = (codes[..., :, None] >> (bits * np.arange(per, dtype=np.uint32))) & ((1 << bits) - 1)
        q = q.reshape(*codes.shape[:-1], -1).astype(np.float32)
        mine = (q.reshape(*q.shape[:-1], -1, 64) * scales[..., None] + biases[..., None]).reshape(q.shape)
        assert np.array_equal(mine, np.array(mx.dequantize(*k, group_size=64, bits=bits)))


def tiny_args(tiny_conv) -> ModelArgs:
    return ModelArgs.from_config(load_manifest(tiny_conv).config)


def test_kv_bytes_per_token_are_codes_scales_and_biases(tiny_conv):
    a = tiny_args(tiny_conv)  # 2 full-attention layers of 1 KV head of 64
    assert a.n_full_attention * a.num_key_value_heads * a.head_dim == 128
    assert state_bytes(a, 1, 4)[0] == 128 * 2 * 4
    assert state_bytes(a, 1, 4, 8)[0] == 2 * 2 * (64 + 2 * 4)  # 64 one-byte codes + a float32 scale and bias
    assert state_bytes(a, 1, 2, 4)[0] == 2 * 2 * (32 + 2 * 2)  # 32 bytes of 4-bit codes + bf16 scale and bias
    assert state_bytes(a, 1000, 2, 4)[0] == 1000 * state_bytes(a, 1, 2, 4)[0]
    eng = Engine(tiny_conv, Options(cap_gib=1, ctx=100, kv="q4", runtime_bytes=RUNTIME))
    held = sum(x.nbytes for c in eng.conversation.caches if isinstance(c, KVCache) for _, x in c.arrays())
    assert held == eng.plan.accounts["kv cache"] == 100 * 2 * 2 * (32 + 2 * 4)
    eng.close()


@pytest.mark.parametrize("n,block_bytes,cuda", [(1024, 1 << 20, False), (4096, 1 << 20, False), (8192, 1 << 20, False),
                                                (4096, 32 << 20, False), (8192, 1 << 20, True), (1024, 32 << 20, True)])
def test_plan_bounds_what_quantized_attention_allocates(tiny_conv, monkeypatch, n, block_bytes, cuda):
    """A 256-token prefill chunk against a context of n, its peak memory measured with mx.get_peak_memory:
    never more than the plan's attention term (scores of a block of rows, their masked copy and softmax). `cuda`:
    the scoring CUDA takes where a head is no wider than a group (the tiny model's, gpt-oss's), float32
    dequantized keys (`kernels.dequantizes_one_group`), run here on the CPU: the plan counts those copies."""
    monkeypatch.setattr(kernels, "ATTN_SCORES_BYTES", block_bytes)
    monkeypatch.setattr(kernels, "_on_cuda", lambda: cuda)
    a, L = tiny_args(tiny_conv), 256
    nq, hd = a.num_attention_heads, a.head_dim
    (k, v), _, q = filled(8, n, L, nq=nq, nkv=a.num_key_value_heads, hd=hd)
    mx.eval(k, v, q)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = kernels.quantized_attention(q, k, v, 0.125, 8)
    mx.eval(out)
    peak = mx.get_peak_memory() - base
    rows = min(L, kernels.score_rows(nq, n, 4))
    planned = int(1.5 * attention_elements(a, n, L, 4, kv_bits=8) * 4)  # as activation_bytes counts it
    assert rows * nq * n * 4 < peak <= planned, (peak, planned)  # at least one block's scores, within the plan


def engine(conv, kv: str, cap_slots: int | None = None, **kw) -> Engine:
    base = plan_for(conv, Options(cap_gib=64, ctx=64, prefill_chunk=8, kv=kv, runtime_bytes=RUNTIME))
    cap = 64.0 if cap_slots is None else (base.fixed + cap_slots * base.slot_bytes + 1) / 2**30
    return Engine(conv, Options(cap_gib=cap, ctx=64, prefill_chunk=8, kv=kv, runtime_bytes=RUNTIME, **kw))


def logits(eng: Engine, ids: list[int], steps: int) -> list[np.ndarray]:
    out = [np.array(eng.prefill(ids).astype(mx.float32))]
    for _ in range(steps):
        out.append(np.array(eng.decode(int(out[-1].argmax())).astype(mx.float32)))
    return out


@pytest.mark.parametrize("kv", ["q8", "q4"])
def test_logits_bit_identical_across_caps(tiny_conv, kv):
    runs = []
    for slots in (0, None):
        eng = engine(tiny_conv, kv, slots)
        runs.append((np.stack(logits(eng, PROMPT, 8)), eng.plan.hot_slots,
                     sum(ly.misses for s in eng.steps for ly in s.layers)))
        eng.close()
    (tight, hot0, miss0), (resident, hot1, miss1) = runs
    assert hot0 == 0 and hot1 == 8 * 8 and miss0 > miss1  # the two caps really streamed differently
    assert tight.tobytes() == resident.tobytes()
    eng = engine(tiny_conv, "float32")
    ref = np.stack(logits(eng, PROMPT, 0))  # the float cache's first logits: near, not equal
    eng.close()
    assert 0 < np.abs(ref[0] - tight[0]).max() < (0.05 if kv == "q8" else 0.5)


@pytest.mark.parametrize("kv", ["q8", "q4"])
def test_session_restores_a_quantized_cache_bit_identical(tiny_conv, tmp_path, kv):
    eng = engine(tiny_conv, kv)
    logits(eng, PROMPT, 3)
    save_session(eng, tmp_path / "a.zst", {"k": 1})
    expect = np.stack(logits(eng, [8, 9, 10], 4)).tobytes()
    eng.close()

    eng = engine(tiny_conv, kv, cap_slots=0, tier="lru")
    assert load_session(eng, tmp_path / "a.zst") == {"k": 1}
    assert eng.offset == len(PROMPT) + 3
    save_session(eng, tmp_path / "b.zst", {"k": 1})
    assert (tmp_path / "a.zst").read_bytes() == (tmp_path / "b.zst").read_bytes()
    assert np.stack(logits(eng, [8, 9, 10], 4)).tobytes() == expect
    eng.close()

    eng = engine(tiny_conv, "q8" if kv == "q4" else "q4")
    with pytest.raises(StreamoeError, match=f"KV cache format \\(--kv\\): the session's {kv}, this run's {'q8' if kv == 'q4' else 'q4'}"):
        load_session(eng, tmp_path / "a.zst")
    eng.close()


def test_session_file_holds_codes_scales_and_biases(tiny_conv, tmp_path):
    import zstandard
    from safetensors.numpy import load

    eng = engine(tiny_conv, "q4")
    logits(eng, PROMPT, 0)
    save_session(eng, tmp_path / "s.zst", {})
    tensors = load(zstandard.ZstdDecompressor().decompress((tmp_path / "s.zst").read_bytes()))
    i = next(i for i, c in enumerate(eng.conversation.caches) if isinstance(c, KVCache))
    n = len(PROMPT)
    assert tensors[f"layers.{i}.keys"].dtype == np.uint32 and tensors[f"layers.{i}.keys"].shape == (1, 1, n, 8)
    assert tensors[f"layers.{i}.value_biases"].dtype == np.float32 and tensors[f"layers.{i}.value_biases"].shape == (1, 1, n, 1)
    assert np.array_equal(tensors[f"layers.{i}.key_scales"], np.array(eng.conversation.caches[i].key_scales[:, :, :n]))
    eng.close()


@pytest.mark.parametrize("kv", ["q8", "q4"])
def test_prompt_cache_snapshot_restores_bit_identical(tiny_conv, kv):
    eng = engine(tiny_conv, kv)
    logits(eng, PROMPT, 0)
    snap = prompt_cache.capture(eng, tuple(PROMPT))
    assert snap.nbytes == prompt_cache.snapshot_nbytes(eng)
    expect = np.stack(logits(eng, [8, 9], 3)).tobytes()
    prompt_cache.clear(eng)
    logits(eng, [400, 401, 402, 403], 2)  # another conversation in between
    prompt_cache.restore(eng, snap)
    assert np.stack(logits(eng, [8, 9], 3)).tobytes() == expect
    eng.close()


def test_plan_prints_the_longest_context_of_each_kv_format(tiny_conv):
    p = cli("plan", tiny_conv, "--cap", "0.2", "--ctx", 1024, "--runtime-mib", 64, "--json", check=True)
    got = json.loads(p.stdout)["kv_formats"]
    assert list(got) == ["float32", "q8", "q4"]
    assert got["q4"]["longest_ctx"] > got["q8"]["longest_ctx"] > got["float32"]["longest_ctx"] > 1024
    a = tiny_args(tiny_conv)
    for fmt, k in got.items():
        assert plan_for(tiny_conv, Options(cap_gib=0.2, ctx=k["longest_ctx"], kv=fmt, runtime_bytes=64 << 20)).fits
        assert not plan_for(tiny_conv, Options(cap_gib=0.2, ctx=k["longest_ctx"] + 1, kv=fmt,
                                               runtime_bytes=64 << 20)).fits
    assert got["q8"]["token_bytes"] == state_bytes(a, 1, 4, 8)[0]
    text = cli("plan", tiny_conv, "--cap", "0.2", "--ctx", 1024, "--runtime-mib", 64, check=True).stdout
    assert f"    q4        {got['q4']['token_bytes']:>9,} B/token  {got['q4']['longest_ctx']:>11,} tokens" in text
    # a resident cap: bounded by the model's own context
    big = plan_with_limits(262144, args=a, cap=64 << 30, ctx=16, expert_format="q4", stride=1, nonexpert_resident=0,
                           runtime_bytes=0)
    assert big.kv_formats["q4"]["longest_ctx"] == 262144
    assert make_plan(args=a, cap=64 << 30, ctx=16, expert_format="q4", stride=1, nonexpert_resident=0,
                     runtime_bytes=0).kv_formats == {}


def test_cli_run_with_quantized_kv(tiny_conv):
    for kv in ("q8", "q4"):
        p = cli("run", tiny_conv, "--kv", kv, "--ctx", 64, "--raw", "-p", "hello", "-n", 4, "--temp", 0)
        assert p.returncode == 0, p.stderr
    p = cli("run", tiny_conv, "--kv", "q2", "--raw", "-p", "x")
    assert p.returncode == 2 and "--kv" in p.stderr


def test_long_context_bench_runs_each_format(tiny_conv, tmp_path):
    """bench/long_context.py (the H200 `--ctx 131072` comparison) on a tiny checkpoint and a small context."""
    import subprocess
    import sys

    from .conftest import REPO

    out = tmp_path / "lc.json"
    p = subprocess.run([sys.executable, "-m", "bench.long_context", str(tiny_conv), "--cap", "0.3", "--ctx", "300",
                        "--kv", "float32,q8,q4", "--tokens", "3", "--out", str(out)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = {r["kv"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["float32", "q8", "q4"] and all("error" not in r for r in rows.values())
    assert rows["float32"]["kv_bytes"] > rows["q8"]["kv_bytes"] > rows["q4"]["kv_bytes"]
    assert all(r["filled"] == 296 and r["decode_tokens"] == 3 and r["decode_tok_s"] > 0 for r in rows.values())


@pytest.mark.parametrize("kv", ["q8"])
def test_served_chat_with_a_quantized_cache_is_the_same_with_or_without_the_prompt_cache(trained_conv, kv):
    """`serve --kv q8`: turns answered from prompt-cache snapshots (codes, scales and biases restored) give
    every logit a fresh prefill gives."""
    from streamoe.runtime.plan import MiB
    from streamoe.runtime.serve.openai_api import Limits, parse_chat
    from streamoe.runtime.serve.worker import EngineWorker, ServeOptions, open_engine

    def chat(cache_bytes: int) -> tuple[list[bytes], list[int]]:
        opts = Options(cap_gib=8, ctx=256, kv=kv, runtime_bytes=RUNTIME)
        worker = EngineWorker(open_engine(trained_conv, opts, so := ServeOptions("t", prompt_cache_bytes=cache_bytes)), so)
        msgs, logits, cached = [], [], []
        for q in ("hello there", "and then?", "why"):
            msgs.append({"role": "user", "content": q})
            job = worker.prepare(parse_chat({"messages": msgs, "temperature": 0, "max_tokens": 5}, Limits()))
            job.logits, job.sink = [], []
            worker.run(job)
            done = [e for e in job.sink if e[0] == "done"]
            msgs.append({"role": "assistant", "content": "".join(v for e in job.sink if e[0] == "delta"
                                                                 for k, v in e[1] if k == "content")})
            logits.append(np.stack(job.logits).tobytes())
            cached.append(done[0][1]["usage"]["prompt_tokens_details"]["cached_tokens"])
        worker.eng.close()
        return logits, cached

    (with_cache, hits), (without, misses) = chat(4 * MiB), chat(0)
    assert with_cache == without and misses == [0, 0, 0] and hits[0] == 0 and all(h > 0 for h in hits[1:])


def test_a_head_dim_its_codes_cannot_group_has_no_quantized_kv_in_the_plan(tmp_path):
    """head_dim 96 (not a whole number of groups of 64): `plan` lists only float formats, and `--kv q4` is refused
    in the words the cache itself refuses it, as `run` would be."""
    from streamoe.convert.synth import make_config
    from streamoe.runtime.models.cache import quantized_kv_refusal

    c = make_config("tiny")
    tc = c["text_config"]
    tc.update(head_dim=96, partial_rotary_factor=1 / 3)
    tc["rope_parameters"].update(partial_rotary_factor=1 / 3, mrope_section=[6, 5, 5])
    (tmp_path / "config.json").write_text(json.dumps(c))
    p = cli("plan", tmp_path / "config.json", "--cap", "4", "--runtime-mib", "128", "--json")
    assert p.returncode == 0, p.stderr
    assert list(json.loads(p.stdout)["kv_formats"]) == ["float32"]
    p = cli("plan", tmp_path / "config.json", "--cap", "4", "--runtime-mib", "128", "--kv", "q4")
    assert p.returncode == 2 and p.stderr.strip() == f"streamoe: error: {tmp_path / 'config.json'}: {quantized_kv_refusal(96)}"
