"""A capped prefill chunk of many blocks (`kernels.run_layers`) through the kernels a CUDA prefill takes (grouped
experts, quantized matmuls): the same logits whatever the chunk, each block's routing recomputed between the
layer's two passes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from streamoe.runtime.engine import Engine, Options, plan_for

from .conftest import RUNTIME

TEXT = "The quick brown fox jumps over the lazy dog while the river keeps running to the sea. "


def _capped(conv, monkeypatch, ctx: int, chunk: int | str = "auto", slots: int = 128) -> Engine:
    from streamoe.runtime import plan as plan_mod

    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 16)
    opts = dict(ctx=ctx, prefill_chunk=chunk, runtime_bytes=RUNTIME)
    base = plan_for(conv, Options(cap_gib=64, **{**opts, "prefill_chunk": 16}))
    return Engine(conv, Options(cap_gib=(base.fixed + slots * base.slot_bytes + 1) / 2**30, **opts))


def test_cuda_prefill_kernels_give_the_same_logits_at_every_chunk(tiny_conv, monkeypatch):
    """The kernels a CUDA prefill takes (`kernels._switch_glu_grouped`, no numpy BLAS), run on this CPU: a chunk of
    many blocks at a cap gives the bits of 16-token chunks, resident or not."""
    from streamoe.runtime.models import kernels

    monkeypatch.setattr(kernels, "_on_cuda", lambda: True)
    monkeypatch.setattr(kernels, "BLAS_TOKENS", 1 << 30)
    runs = {}
    for key, chunk, slots in (("step", 16, 16), ("chunk", "auto", 40), ("resident", 16, 10**6)):
        eng = _capped(tiny_conv, monkeypatch, ctx=512, chunk=chunk, slots=slots)
        ids = (eng.text.encode(TEXT) * 20)[:200]
        logits = np.array(eng.prefill(ids).astype(mx.float32))
        runs[key] = (logits.tobytes(), eng.plan.prefill_chunk, eng.experts.resident)
        eng.close()
        assert np.isfinite(logits).all()
    assert runs["chunk"][1] >= 64 and not runs["chunk"][2] and runs["resident"][2]
    assert runs["chunk"][0] == runs["step"][0] == runs["resident"][0]
