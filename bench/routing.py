"""How a synthetic checkpoint routes while it decodes: whether its generation and its picks spread as a trained
model's do, or fall into a loop that keeps every pick in a few experts (then a capped run of it measures a model
that never streams, whatever the cap).

Writes a synthetic checkpoint of FAMILY at SIZE (`--layers N`: as deep as N layers, the rest of SIZE's shapes),
decodes TOKENS greedy tokens (the end of turn drawn as any other) after a chat prompt with stock mlx-lm
(`stream_generate`, the peer reading the same files), and records each layer's picks of every decoded token.
`--forced`: the decode steps are fed a held-out text's tokens instead (teacher forcing), so the picks follow varied
tokens whatever the model would write. Per layer: the experts picked at all, the share of picks that fall in the
quarter of experts picked most (what a hot tier of a quarter holds at best), and the share of a token's picks the
token before also picked; over the decode: the distinct tokens; and the first layer's attention output over the prompt
as a multiple of the embedding (how far one write outweighs the tokens). `--residual-scale F`: the projections into the
residual stream scaled by F once loaded (how the checkpoint would route drawn with them F times as large).

    python -m bench.routing --family qwen3_moe --size small --layers 48 --name routing-qwen3_moe-small-48-layers
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .common import scratch_dir, write_result
from .q3_quality import heldout_text

PROMPT = "Write a long story about a dragon and a knight."


def checkpoint(out: Path, family: str, size: str, layers: int | None) -> dict:
    """A synthetic checkpoint in `out` (SIZE's shapes, `layers` deep where given); its config."""
    from streamoe.convert.synth import make_config, token_base, write_checkpoint

    config = make_config(size, text_only=True, family=family)
    text = config.get("text_config", config)
    if layers is not None:
        per_layer = [k for k in (config.get("quantization") or {}) if ".layers." in k] or text.get("layer_types")
        if per_layer:
            raise SystemExit(f"--layers: the {family} config lists its layers one by one; give its size's depth")
        text["num_hidden_layers"] = layers
        if "max_window_layers" in text:
            text["max_window_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, config, seed=0, exact=size != "full", token_base=token_base(size, family))  # as `synth`
    return text


def router(layer):
    """(the module holding the router, its attribute name) of an mlx-lm decoder layer."""
    for holder in ("mlp", "block_sparse_moe"):
        mod = getattr(layer, holder, None)
        for name in ("gate", "router"):
            if mod is not None and hasattr(mod, name):
                return mod, name
    return None, None


def first_write(model, inner, prompt: list[int]) -> float | None:
    """The first layer's attention output over the prompt as a multiple of the embedding (root mean squares): how far
    one write into the residual stream outweighs the tokens it starts from. None where that layer has no softmax
    attention (Qwen3.6's first is a Gated DeltaNet)."""
    import mlx.core as mx

    layer = inner.layers[0]
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return None
    seen = []

    def recorded(*args, **kw):
        seen.append(attn(*args, **kw))
        return seen[-1]

    layer.self_attn = recorded
    mx.eval(model(mx.array([prompt])))
    layer.self_attn = attn
    rms = [float(mx.sqrt(mx.mean(a.astype(mx.float32) ** 2))) for a in (seen[0], inner.embed_tokens(mx.array(prompt)))]
    return round(rms[0] / rms[1], 3)


def measure(ckpt: Path, text: dict, tokens: int, forced: bool, residual_scale: float = 1.0) -> dict:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tok = load(str(ckpt))
    inner = model.language_model.model if hasattr(model, "language_model") else model.model
    if residual_scale != 1:  # every projection into the residual stream scaled: its scales (and affine biases)
        for layer in inner.layers:
            for path, mod in layer.named_modules():
                if path.endswith(("o_proj", "down_proj")) and getattr(mod, "mode", "affine") == "affine":
                    mod.scales, mod.biases = mod.scales * residual_scale, mod.biases * residual_scale
                elif path.endswith(("o_proj", "down_proj")):
                    raise SystemExit(f"--residual-scale: {path} is {mod.mode}, not affine codes")
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    write = first_write(model, inner, prompt)
    k = text.get("num_experts_per_tok") or text["experts_per_token"]
    n_experts = text.get("num_experts") or text.get("num_local_experts")
    picks: dict[int, list[np.ndarray]] = {}
    for i, layer in enumerate(inner.layers):
        mod, name = router(layer)
        if mod is None:
            continue
        gate = getattr(mod, name)

        def recorded(x, gate=gate, i=i):
            logits = gate(x)
            if x.shape[1] == 1:  # a decode step's token
                picks.setdefault(i, []).append(np.array(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]).ravel())
            return logits

        setattr(mod, name, recorded)
    if forced:  # decode steps fed a held-out text's tokens, one a step, whatever the model would write
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=cache))
        ids = tok.encode(heldout_text(tokens * 16))[:tokens]
        for t in ids:
            mx.eval(model(mx.array([[t]]), cache=cache))
    else:
        tok.eos_token_ids = []  # every decode TOKENS long: the end of turn drawn as any token (vLLM's ignore_eos)
        ids = [r.token for r in stream_generate(model, tok, prompt, max_tokens=tokens)]
    layers = []
    for i, got in sorted(picks.items()):
        a = np.stack(got)
        counts = np.sort(np.bincount(a.ravel(), minlength=n_experts))[::-1]
        layers.append({"layer": i, "experts_picked": int(np.count_nonzero(counts)),
                       "top_quarter_share": round(float(counts[:max(1, n_experts // 4)].sum() / counts.sum()), 3),
                       "repeat_share": round(float(np.mean([len(set(a[t]) & set(a[t - 1])) / k
                                                            for t in range(1, len(a))])), 3)})
    return {"first_attention_vs_embedding": write, "decoded": len(ids), "distinct_tokens": len(set(ids)), "experts": n_experts, "top_k": k,
            "top_quarter_share_mean": round(float(np.mean([ly["top_quarter_share"] for ly in layers])), 3),
            "repeat_share_mean": round(float(np.mean([ly["repeat_share"] for ly in layers])), 3), "per_layer": layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "full"],
                    help="full: the real shapes, drawn as `synth` draws them (random codes)")
    ap.add_argument("--layers", type=int, default=None, help="the checkpoint this many layers deep")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--forced", action="store_true", help="decode a held-out text's tokens (teacher forcing), not the "
                    "model's own greedy tokens")
    ap.add_argument("--residual-scale", type=float, default=1.0, help="scale every layer's projections into the "
                    "residual stream (o_proj, down_proj) by this once loaded: how the picks would spread in a "
                    "checkpoint drawn so")
    ap.add_argument("--name", default=None, help="bench/results/NAME.json (default: routing-FAMILY-SIZE[-N-layers])")
    ap.add_argument("--scratch", type=Path, default=None, help="work directory, kept (default: a fresh temporary directory, removed at the end)")
    a = ap.parse_args()
    with scratch_dir(a.scratch) as scratch:
        ckpt = scratch / f"{a.family}-{a.size}-{a.layers or 'own'}"
        text = checkpoint(ckpt, a.family, a.size, a.layers)
        res = {"family": a.family, "size": a.size, "layers": text["num_hidden_layers"],
               "tokens_decoded": "held-out text" if a.forced else "greedy", "residual_scale": a.residual_scale,
               **measure(ckpt, text, a.tokens, a.forced, a.residual_scale)}
    name = a.name or (f"routing-{a.family}-{a.size}" + (f"-{a.layers}-layers" if a.layers else "")
                      + ("-forced" if a.forced else "")
                      + (f"-residual-x{a.residual_scale:g}" if a.residual_scale != 1 else ""))
    write_result(name, "routing", [res])


if __name__ == "__main__":
    main()
