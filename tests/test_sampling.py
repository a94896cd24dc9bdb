"""Sampling on the device: the filters against numpy, the draws against their distribution, penalties against
their formulas, and sampled decoding identical across caps, loops and runs for a seed."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from bench.sampling import draw_kernels
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.plan import plan_for
from streamoe.runtime.sampling import BLOCK, Sampler, top_k
from streamoe.runtime.telemetry import summarize
from streamoe.runtime.text import Detokenizer

from .conftest import RUNTIME, TINY_MODEL
from .test_runtime import PROMPTS

CHECKPOINT_DEFAULTS = dict(temp=1.0, top_p=0.95, top_k=20)  # what the real generation_config.json asks for


@pytest.mark.parametrize("V,k", [(248320, 20), (248320, 1), (1000, 20), (5000, 7), (BLOCK * 40 + 13, 20), (300, 300)])
def test_top_k_is_the_k_largest_in_order(V, k):
    x = np.random.default_rng(V + k).standard_normal(V).astype(np.float32)
    ids, vals = top_k(mx.array(x), k)
    want = np.argsort(-x, kind="stable")[:k]
    assert np.array(ids).tolist() == want.tolist()
    assert np.array(vals).tobytes() == x[want].tobytes()


def test_a_draw_adds_few_kernels_to_the_step():
    """On a GPU the host encodes each kernel of a decode step every token: greedy adds one (argmax of the logits as
    the model left them), a draw with the checkpoint's defaults one compiled function's 20 over the real vocabulary
    (it was 41 as separate operations: docs/performance.md, Sampling)."""
    got = draw_kernels(248320, mx.bfloat16)  # what bench.sampling records beside its rates
    assert got["greedy"]["kernels"] <= 1 and got["sampled"]["kernels"] <= 20, got


def _keep_set(x: np.ndarray, s: Sampler) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probabilities) the filters leave, in float64 on the host, in vLLM's order (temperature, min-p, top-k,
    then top-p over what those left, renormalised): the reference the draws must follow."""
    order = np.argsort(-x, kind="stable")
    z = (x[order] - x[order[0]]) / s.temp
    p = np.exp(z) / np.exp(z).sum()
    keep = np.ones(len(order), bool)
    if s.min_p:
        keep &= p >= s.min_p * p[0]
    if s.top_k:
        keep[s.top_k:] = False
    if s.top_p < 1:
        q = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        keep &= (np.cumsum(q) - q) < s.top_p
    q = np.where(keep, p, 0)
    return order, q / q.sum()


@pytest.mark.parametrize("kw", [dict(temp=0.7, top_k=5), dict(temp=1.0, top_p=0.6, top_k=20),
                                dict(temp=1.3, top_p=0.8), dict(temp=1.0, min_p=0.2, top_k=50), dict(temp=2.0),
                                dict(temp=1.5, top_p=0.6, min_p=0.1), dict(temp=1.5, top_p=0.6, min_p=0.1, top_k=30)])
def test_draws_follow_the_filtered_distribution(kw):
    V = 64
    x = np.random.default_rng(7).standard_normal(V).astype(np.float32) * 2
    s = Sampler(seed=11, **kw)
    pen = s.start([], V)
    n = 3000
    toks = np.array([s(mx.array(x), pen, i)[0].item() for i in range(n)])
    ids, p = _keep_set(x, s)
    assert set(toks) <= set(ids[p > 0].tolist())  # never a token a filter removed
    freq = np.array([(toks == t).mean() for t in ids])
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / n) + 1e-3, (freq, p)  # within ~4 standard deviations


def test_a_seed_draws_the_same_tokens_and_another_seed_other_ones():
    x = mx.array(np.random.default_rng(3).standard_normal(2048).astype(np.float32))

    def draws(seed):
        s = Sampler(seed=seed, **CHECKPOINT_DEFAULTS)
        return [s(x, s.start([], 2048), i)[0].item() for i in range(40)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_penalties_follow_their_formulas():
    V = 512
    x = np.random.default_rng(1).standard_normal(V).astype(np.float32) * 3
    prompt = [3, 3, 9, 40]
    s = Sampler(presence_penalty=0.75, frequency_penalty=0.5, repetition_penalty=1.3)  # greedy: the argmax shows them
    pen, seen, counts = s.start(prompt, V), set(prompt), np.zeros(V)
    for i in range(30):
        tok, pen = s(mx.array(x), pen, i)
        ref = x.astype(np.float64)
        for t in seen:
            ref[t] = ref[t] / 1.3 if ref[t] > 0 else ref[t] * 1.3
        ref -= 0.5 * counts + 0.75 * (counts > 0)
        assert tok.item() == int(np.argmax(ref)), i
        seen.add(tok.item())
        counts[tok.item()] += 1
    assert len(seen) > 20  # the penalties moved the argmax from token to token


def test_logit_bias_comes_before_the_penalties_as_in_vllm():
    """vLLM adds the bias, then applies the penalties: a multiplicative repetition penalty acts on the biased logit
    (the other order chose another token here)."""
    V = 512
    x = np.random.default_rng(5).standard_normal(V).astype(np.float32) * 3
    seen = int(np.argsort(x)[-2])  # the second likeliest, in the prompt
    s = Sampler(repetition_penalty=2.0, logit_bias={seen: 5.0})
    ref = x.astype(np.float64)
    ref[seen] += 5.0
    ref[seen] = ref[seen] / 2 if ref[seen] > 0 else ref[seen] * 2
    other = x.astype(np.float64)
    other[seen] = (other[seen] / 2 if other[seen] > 0 else other[seen] * 2) + 5.0
    assert int(np.argmax(ref)) != int(np.argmax(other))  # the two orders disagree here
    assert s(mx.array(x), s.start([seen], V), 0)[0].item() == int(np.argmax(ref))


def test_logit_bias_is_added_to_the_logits_before_the_draw():
    """OpenAI's `logit_bias`: greedy takes the argmax of the biased logits (-100 bans the likeliest token), a draw
    is the unbiased sampler's draw from the biased logits (same key), and the setting crosses to another rank."""
    import json

    V = 512
    x = np.random.default_rng(3).standard_normal(V).astype(np.float32) * 3
    bias = {int(np.argmax(x)): -100.0, 7: 5.0, 300: 2.5}
    dense = np.zeros(V, np.float32)
    for t, b in bias.items():
        dense[t] = b
    s = Sampler(logit_bias=bias)
    assert s(mx.array(x), s.start([], V), 0)[0].item() == int(np.argmax(x + dense)) != int(np.argmax(x))
    biased, plain = Sampler(temp=1.0, top_k=20, seed=5, logit_bias=bias), Sampler(temp=1.0, top_k=20, seed=5)
    got = [biased(mx.array(x), biased.start([], V), i)[0].item() for i in range(40)]
    assert got == [plain(mx.array(x + dense), plain.start([], V), i)[0].item() for i in range(40)]
    assert int(np.argmax(x)) not in got and len(set(got)) > 3  # banned; the draws still choose
    assert Sampler(**json.loads(json.dumps(biased.params()))).bias == biased.bias


def test_a_temperature_too_small_to_divide_by_is_greedy():
    x = mx.array(np.random.default_rng(2).standard_normal(1000).astype(np.float32))
    for t in (1e-308, 1e-45, 0.0):
        s = Sampler(temp=t, top_p=0.9, top_k=20)
        assert s(x, s.start([], 1000), 0)[0].item() == int(np.argmax(np.array(x)))
    s = Sampler(temp=1e-30, top_k=20)  # tiny but usable: the likeliest token has all the mass
    assert s(x, s.start([], 1000), 0)[0].item() == int(np.argmax(np.array(x)))


@pytest.mark.parametrize("bad", [dict(temp=-1), dict(top_p=0), dict(min_p=1.5), dict(presence_penalty=3),
                                 dict(repetition_penalty=0), dict(temp=float("nan")), dict(min_p=float("nan")),
                                 dict(frequency_penalty=float("inf"))])
def test_bad_sampler_settings_are_refused_naming_the_setting(bad):
    from streamoe.formats.errors import StreamoeError

    (key,) = bad
    with pytest.raises(StreamoeError, match="--" + key.replace("_", "-")):
        Sampler(**bad)


def _engine(conv, slots: int | None) -> Engine:
    base = plan_for(conv, Options(cap_gib=64, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME))
    cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
    eng = Engine(conv, Options(cap_gib=cap, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME))
    assert eng.experts.resident == (slots is None)
    return eng


@pytest.mark.parametrize("max_tokens", [3, 24])
def test_sampled_decode_is_identical_across_caps_and_leaves_the_same_state(small_conv, max_tokens):
    """Resident (steps queued from the sampled token) and capped (one step at a time): the same tokens, logits,
    draws counted and state for the next turn, with a stop token it may meet and the penalties on."""
    results = []
    for slots in (None, 24):
        eng = _engine(small_conv, slots)
        eng.text.stop_ids = {int(np.array(eng.prefill(eng.text.encode(PROMPTS[1]))).argsort()[-4])}
        eng.reset()
        s = Sampler(seed=9, presence_penalty=0.5, repetition_penalty=1.1, **CHECKPOINT_DEFAULTS)
        out = [(t, np.array(lg).tobytes()) for t, lg in eng.generate(eng.text.encode(PROMPTS[0]), max_tokens, s)]
        after = np.array(eng.prefill(eng.text.encode(PROMPTS[1]))).tobytes()
        results.append((out, s.drawn, eng.offset, after))
        eng.close()
    assert results[0] == results[1]
    assert len({t for t, _ in results[0][0]}) > 1


def test_a_caller_that_stops_early_leaves_the_state_of_the_tokens_taken(small_conv):
    eng = _engine(small_conv, None)
    ids = eng.text.encode(PROMPTS[0])
    s = Sampler(seed=4, **CHECKPOINT_DEFAULTS)
    gen = eng.generate(ids, 50, s)
    first = [next(gen)[0] for _ in range(5)]
    gen.close()  # a client went away after the fifth token: the step queued to feed it is taken back
    assert s.drawn == 5 and eng.offset == len(ids) + 4
    eng.reset()
    again = [t for t, _ in eng.generate(ids, 5, Sampler(seed=4, **CHECKPOINT_DEFAULTS))]
    assert again == first
    eng.close()


@pytest.mark.parametrize("slots,sampled", [(None, False), (None, True), (24, False), (24, True)])
def test_summary_tok_s_is_the_rate_tokens_reach_the_caller(small_conv, slots, sampled):
    """The caller's own clock between its first and last token against the summary's tok/s: within 5 %, with
    the caller doing work of its own between tokens (it is part of what a user waits for)."""
    eng = _engine(small_conv, slots)
    eng.text.stop_ids = set()  # all 24 tokens
    s = Sampler(seed=1, **CHECKPOINT_DEFAULTS) if sampled else Sampler()
    seen, t_call = [], time.perf_counter()
    for _ in eng.generate(eng.text.encode(PROMPTS[0]), 24, s):
        seen.append(time.perf_counter())
        time.sleep(0.002)
    st = summarize(eng.steps, eng.peak_rss, eng.plan.cap)
    wall = (len(seen) - 1) / (seen[-1] - seen[0])
    assert st["tokens"] == len(seen) == 24
    assert abs(st["tok_s"] / wall - 1) < 0.05, (st["tok_s"], wall)
    assert st["compute_ms"] > 0 and st["other_ms"] > 0  # measured, not left at zero
    if mx.default_device() == mx.cpu:  # the CPU computes a queued step inside `mx.async_eval`: that is compute too
        assert st["compute_ms"] > 0.25 * st["ms_token"], st
    assert 0 < st["ttft_s"] <= seen[0] - t_call and st["prefill_tok_s"] > 0
    eng.close()


def test_streamed_text_is_the_decoded_answer():
    import json

    from streamoe.runtime.text import TextIO

    text = TextIO(TINY_MODEL, json.loads((TINY_MODEL / "config.json").read_text()))
    for s in ("Hello, wörld! 日本語 🎉🎉 tabs\tand\n\nnewlines", " leading space", "<|im_end|> after"):
        ids = text.encode(s)
        d = Detokenizer(text)
        assert "".join(d.add(t) for t in ids) == text.decode(ids) == s
    ids = text.encode("🎉")
    assert len(ids) > 1  # a character split over tokens: held back until it completes
    d = Detokenizer(text)
    assert [d.add(t) for t in ids][:-1] == [""] * (len(ids) - 1)


def test_a_continued_text_streams_what_it_adds_to_its_prompt():
    """`Detokenizer(context=...)` (a completion, a continued message): at every cut of a text whose characters span
    several tokens, the pieces are the text after the prompt's whole characters, a character the prompt began
    completed by the answer; an answer ending inside a character ends in U+FFFD (`tail`), as decoding gives it."""
    import json

    from streamoe.runtime.text import TextIO

    text = TextIO(TINY_MODEL, json.loads((TINY_MODEL / "config.json").read_text()))
    s = "a 👩\u200d👩\u200d👧 b café 你好 x👩\u200d👩\u200d👧👩\u200d👩\u200d👧👩\u200d👩\u200d👧👩\u200d👩\u200d👧 y"
    ids = text.encode(s)
    for cut in range(1, len(ids)):
        d = Detokenizer(text, context=ids[:cut])
        assert "".join(d.add(t) for t in ids[cut:]) + d.tail() == s[len(text.decode(ids[:cut]).rstrip("\ufffd")):], cut
    part = text.encode("x🎉")[:-1]
    d = Detokenizer(text)
    assert "".join(d.add(t) for t in part) == "x" and d.tail() == "\ufffd" == text.decode(part)[1:]


def test_a_sampled_run_says_once_how_it_draws(tiny_conv):
    """`run` sampling says so once on stderr, as llama.cpp does: the settings in force and which came from the
    checkpoint's generation_config.json; a greedy run and `-q` say nothing of it."""
    from streamoe.cli import sampling_line

    from .conftest import cli

    line = sampling_line({"temp": 1.0, "top_p": 0.95, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0,
                          "presence_penalty": 1.5, "seed": 3}, {"top_k": 5, "presence_penalty": 1.5})
    assert line == ("sampling: temperature 1, top-p 0.95, top-k 5, presence penalty 1.5 (temperature, top-p from "
                    "generation_config.json); --temp 0 for greedy")
    run = ("run", tiny_conv, "--cap", 8, "--ctx", 128, "-n", 2, "--raw", "-p", "def")
    said = [ln for ln in cli(*run, "--top-k", 5, "--presence-penalty", 1.5, check=True).stderr.splitlines()
            if "sampling:" in ln]
    assert said == [f"streamoe: {line}"]
    for quiet in (("--temp", 0), ("-q",)):
        assert "sampling:" not in cli(*run, *quiet, check=True).stderr
