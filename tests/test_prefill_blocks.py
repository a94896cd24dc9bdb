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


def test_prefill_progress_counts_each_chunks_tokens_by_its_layers(tiny_conv, monkeypatch):
    """`Engine.prefill(ids, progress)`: one call a layer of each chunk, never going back, the chunk's tokens counted
    by its layers, ending at the prompt's length, which each call gives as the total; the same logits as without
    it. Capped in the plan's chunks of many 16-token blocks, capped in chunks of one block, and resident (a chunk =
    a step)."""
    for chunk, slots in (("auto", 40), (16, 16), (16, 10**6)):
        runs = []
        for progress in (None, []):
            eng = _capped(tiny_conv, monkeypatch, ctx=512, chunk=chunk, slots=slots)
            ids = (eng.text.encode(TEXT) * 20)[:120]
            logits = eng.prefill(ids, None if progress is None else lambda done, total, p=progress: p.append((done, total)))
            runs.append(np.array(logits.astype(mx.float32)).tobytes())
            c, n = eng.plan.prefill_chunk, eng.args.num_hidden_layers
            eng.close()
        assert runs[0] == runs[1]
        assert c >= 64 if chunk == "auto" else c == 16
        chunks = [(a, min(120, a + c)) for a in range(0, 120, c)]
        assert progress == [(a + (b - a) * (i + 1) // n, 120) for a, b in chunks for i in range(n)], (chunk, progress)
        assert progress == sorted(progress) and progress[-1] == (120, 120)


def test_run_shows_a_long_prefill_on_a_terminal_and_nothing_otherwise(tiny_conv, monkeypatch, capsys):
    """`streamoe run`'s answer: on a terminal, a prefill that takes its time shows a bar on stderr (its delay set to
    0 here), cleared once the prompt is in, before the answer's first token; with --quiet, or stderr not a terminal,
    nothing. The answer is the same."""
    import io
    import sys

    from streamoe.runtime import cli_run
    from streamoe.runtime.sampling import Sampler

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    real_bar = cli_run.prefill_bar
    monkeypatch.setattr(cli_run, "prefill_bar", lambda tokens, show: real_bar(tokens, show, delay=0, mininterval=0))
    answers = []
    for show, err in ((True, Terminal()), (False, Terminal()), (True, io.StringIO())):
        eng = _capped(tiny_conv, monkeypatch, ctx=512, chunk="auto", slots=40)
        ids = (eng.text.encode(TEXT) * 20)[:120]
        monkeypatch.setattr(sys, "stderr", err)
        out = cli_run.answer(eng, ids, 4, Sampler(), None, progress=show)
        eng.close()
        answers.append((out, capsys.readouterr().out))
        text = err.getvalue()
        if show and isinstance(err, Terminal):
            assert "prefill:" in text and "120/120" in text and text.endswith("\r"), text  # the bar, then its line cleared
        else:
            assert text == "", text
    assert answers[0] == answers[1] == answers[2] and len(answers[0][0]) == 4
