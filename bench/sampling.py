"""Sampled against greedy decode, by wall clock and as the summary line prints it.

Greedy is the peer: both run in one process, interleaved round by round (each mode leading a round in turn),
on the same engine. `sampled_vs_greedy_wall` is the ratio of the two modes' median rates,
`sampled_vs_greedy_paired` the median of each round's own ratio (the two runs of a round are minutes closer than
the rounds' medians, so a host drifting between rounds moves it less). Beside the medians, each mode's fastest
run: where a host's speed jumps between runs (the H200 machine's resident runs of one mode went 47 or 72 tok/s,
two levels), the fastest runs are the ones to compare. At a cap the
tokens drawn route to other experts than greedy's, so hit rate and bytes read per token are reported beside
the rates: resident runs show the sampler's own cost. `json` samples inside a JSON schema (constrained
decoding: llguidance's mask computed on the host and applied on the device every token). Sampled uses
the checkpoint's defaults (temperature 1.0, top-p 0.95, top-k 20), `tool` a call forced by `tool_choice` (its
arguments in Qwen3.6's XML call form, one long string parameter), `strict` a strict tool's lazy grammar that the
answer never triggers (random weights open no call: what holding it costs decode, tokens drawn ahead unmasked), and a penalised variant adds Qwen's
suggested presence penalty (1.5) and a repetition penalty. The vocabulary matters: choosing a token at the
real model's 248,320 rows is what the `small-vocab` synthetic checkpoint (the small model's layers with that
vocabulary) shows on the CPU; `--model` takes any converted directory (full size on a GPU). `--modes greedy,sampled`
runs those two alone, each round's pair back to back. Beside the rates, `draw_us_queued`: the draw's own cost per
token by mode, many draws queued then one wait, which the host's drift between runs does not hide.

    python -m bench.sampling                                    # synthesizes small-vocab in --scratch
    python -m bench.sampling --model /root/bench/full-conv --caps resident,4 --tokens 64 --rounds 5
    python -m bench.sampling --model /root/bench/full-conv --caps resident --modes greedy,sampled --rounds 31 --tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.common import scratch_dir, write_result

PROMPT = "import csv\nimport sys\n\n\ndef mean_of_columns(path):\n    "
MODES = {"greedy": {}, "sampled": dict(temp=1.0, top_p=0.95, top_k=20),
         "penalised": dict(temp=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, repetition_penalty=1.05),
         "json": dict(temp=1.0, top_p=0.95, top_k=20),  # sampled, inside a JSON schema (llguidance's mask per token)
         "tool": dict(temp=1.0, top_p=0.95, top_k=20),  # sampled, a forced call's arguments in the XML call form
         "strict": dict(temp=1.0, top_p=0.95, top_k=20)}  # sampled, a strict tool's lazy grammar waiting for a call
# a string long enough that every timed token is drawn under the grammar's mask
JSON_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4000}}, "required": ["text"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "write", "parameters": JSON_SCHEMA}}]


def quarter_cap(model: Path, ctx: int) -> float:
    from streamoe.runtime.plan import Options, plan_for

    p = plan_for(model, Options(cap_gib=1 << 10, ctx=ctx, runtime_bytes=64 << 20))
    return (p.fixed + p.n_layers * p.n_experts // 4 * p.slot_bytes + p.slot_bytes // 2) / 2**30


def one_answer(eng, sampler, tokens: int, constraint=None) -> dict:
    from streamoe.runtime.telemetry import summarize

    del eng.steps[:]
    eng.reset()
    got = []
    for _ in eng.generate(eng.text.encode(PROMPT), tokens, sampler, constraint=constraint):
        got.append(time.perf_counter())
    s = summarize(eng.steps, eng.peak_rss, eng.plan.cap)
    wall = (len(got) - 1) / (got[-1] - got[0]) if len(got) > 1 else 0.0
    return {"tokens": len(got), "wall_tok_s": wall, "summary_tok_s": s["tok_s"], "ttft_s": s["ttft_s"],
            "hit_rate": s["hit_rate"], "mib_read_token": s["mib_read_token"]}


def draw_kernels(vocab: int, dtype) -> dict:
    """The kernels and views one draw adds to a decode step's graph, by mode (no grammar), over logits [vocab] of the
    compute dtype: on a GPU each kernel is the host's to encode, every token."""
    import mlx.core as mx

    from bench.gpu_parts import graph_ops
    from streamoe.runtime.sampling import Sampler

    logits = mx.zeros((vocab,), dtype)
    mx.eval(logits)
    out = {}
    for m in ("greedy", "sampled", "penalised"):
        s = Sampler(**MODES[m])
        ops = graph_ops(s(logits, s.start([1, 2, 3], vocab), 0)[0])
        out[m] = {"kernels": ops["kernels"], "views": ops["views"]}
    return out


def draw_cost(vocab: int, dtype, n: int = 300, repeats: int = 3) -> dict:
    """Microseconds a draw adds per token, by mode (no grammar): `n` draws from logits [vocab] of the compute dtype
    queued, then one wait, so the host's encoding and the device's work overlap as in a pipelined decode; each
    repeat's figure (the host's speed drifts between them)."""
    import mlx.core as mx

    from streamoe.runtime.sampling import Sampler

    logits = (mx.random.normal((vocab,), key=mx.random.key(0)) * 3).astype(dtype)
    mx.eval(logits)
    out = {}
    for m in ("greedy", "sampled", "penalised"):
        s = Sampler(**MODES[m])
        pen = s.start([1, 2, 3], vocab)
        mx.eval([s(logits, pen, i)[0] for i in range(20)])
        out[m] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval([s(logits, pen, i)[0] for i in range(n)])
            out[m].append(round((time.perf_counter() - t0) / n * 1e6, 1))
    return out


def run_cap(model: Path, cap: str, tokens: int, rounds: int, ctx: int, modes: list[str]) -> dict:
    from streamoe.runtime.constrain import Constraint, guide_tokenizer, json_grammar, tool_call_grammar
    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.sampling import Sampler

    cap_gib = 1 << 10 if cap == "resident" else (quarter_cap(model, ctx) if cap == "quarter" else float(cap))
    eng = Engine(model, Options(cap_gib=cap_gib, ctx=ctx, runtime_bytes=64 << 20))
    guide = guide_tokenizer(eng.text.tokenizer, eng.args.vocab_size, eng.text.stop_ids)
    eng.text.stop_ids = set()  # every answer runs its full length: rates over the same number of tokens
    try:
        one_answer(eng, Sampler(), 4)  # first-call compiles out of the timed rounds
        tok = eng.text.tokenizer
        grammars = {"json": json_grammar(JSON_SCHEMA), "tool": tool_call_grammar("xml", TOOLS, "write", tok),
                    "strict": tool_call_grammar("xml", TOOLS, None, tok, opened=True)}
        trigger = {"strict": tok.token_to_id("<tool_call>")}
        runs = {m: [] for m in modes}
        for r in range(rounds):
            for m in modes[r % len(modes):] + modes[: r % len(modes)]:  # each mode leads a round in turn
                c = Constraint(guide, grammars[m], eng.args.vocab_size, trigger=trigger.get(m)) if m in grammars else None
                runs[m].append(one_answer(eng, Sampler(seed=r, **MODES[m]), tokens, c))
        keys = ("wall_tok_s", "summary_tok_s", "ttft_s", "hit_rate", "mib_read_token")
        med = {m: {k: statistics.median(x[k] for x in v) for k in keys} for m, v in runs.items()}
        best = {m: max(x["wall_tok_s"] for x in v) for m, v in runs.items()}
        pairs = [one["wall_tok_s"] / peer["wall_tok_s"] for peer, one in zip(runs["greedy"], runs["sampled"], strict=True)]
        paired = statistics.median(pairs)
        quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [paired] * 3
        ratios = {f"{m}_vs_{peer}_wall": round(med[m]["wall_tok_s"] / med[peer]["wall_tok_s"], 3)
                  for m, peer in (("penalised", "greedy"), ("json", "sampled"), ("tool", "sampled"), ("strict", "sampled"))
                  if m in med}
        return {"cap": cap, "cap_gib": round(cap_gib, 4), "resident": eng.experts.resident, "vocab": eng.args.vocab_size,
                "tokens": tokens, "rounds": rounds, "modes": modes,
                "draw_kernels": draw_kernels(eng.args.vocab_size, eng.dtype),
                "draw_us_queued": draw_cost(eng.args.vocab_size, eng.dtype), "median": med, "best_wall_tok_s": best,
                "best_vs_sampled_wall": {m: round(best[m] / best["sampled"], 3) for m in modes},
                "sampled_vs_greedy_wall": round(med["sampled"]["wall_tok_s"] / med["greedy"]["wall_tok_s"], 4),
                "sampled_vs_greedy_paired": round(paired, 4), "paired_quartiles": [round(q, 4) for q in quartiles],
                **ratios, "summary_vs_wall": {m: round(med[m]["summary_tok_s"] / med[m]["wall_tok_s"], 3) for m in modes},
                "runs": runs}
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a converted directory (default: synthesize small-vocab)")
    ap.add_argument("--scratch", type=Path, default=None)
    ap.add_argument("--caps", default="quarter,resident", help="comma list: quarter, resident or GiB")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma list of {', '.join(MODES)} (greedy and sampled always); fewer modes: each round's "
                         "greedy and sampled runs closer together")
    ap.add_argument("--name", default="sampling")
    a = ap.parse_args()
    modes = [m for m in MODES if m in {"greedy", "sampled", *a.modes.split(",")}]
    if unknown := set(a.modes.split(",")) - set(MODES):
        ap.error(f"--modes: unknown {', '.join(sorted(unknown))}")
    with scratch_dir(a.scratch) as scratch:
        model = a.model
        if model is None:
            from streamoe.convert.convert import convert
            from streamoe.convert.synth import synth

            ck, model = scratch / "small-vocab", scratch / "small-vocab-conv"
            if not model.exists():
                synth(ck, size="small-vocab", variant="qwen3.6", text_only=True, seed=3, shard_bytes=None, dry_run=False)
                convert(ck, model, formats=["q4"], progress=False)
        results = []
        for cap in a.caps.split(","):
            results.append(run_cap(model, cap, a.tokens, a.rounds, a.ctx, modes))
            r = results[-1]
            others = ", ".join(f"{k.removesuffix('_wall').replace('_vs_', '/')} {v}" for k, v in r.items()
                               if k != "sampled_vs_greedy_wall" and k.endswith(("_vs_greedy_wall", "_vs_sampled_wall")))
            print(f"{cap}: sampled/greedy {r['sampled_vs_greedy_wall']} (paired {r['sampled_vs_greedy_paired']}, "
                  f"quartiles {r['paired_quartiles']}), {others}, best runs against sampled's best "
                  f"{r['best_vs_sampled_wall']}, summary/wall {r['summary_vs_wall']}", flush=True)
        print(write_result(a.name, "sampling", results))


if __name__ == "__main__":
    main()
