"""Measure the exported model with the MLX peers here, on the CPU.

    python examples/train_tiny/evaluate.py [--mlx models/tiny] [--bf16 /tmp/tiny-bf16]
                                           [--out examples/train_tiny/results/eval_4bit.json]

- reference: the bf16 and 4-bit exports against the logits the GPU run recorded for the
  same bf16 weights (text window + one image question), and the M-RoPE positions;
- text (mlx-lm): held-out perplexity and next-token accuracy of the 4-bit export over
  the first N windows of 512 tokens of the held-out stream, and the greedy continuation
  of a Python prompt;
- images (mlx-vlm): answer accuracy on freshly drawn images (a seed the training never
  used).  One batched teacher-forced forward per group: an answer counts as correct when
  the argmax at every answer position is the answer token and then <|im_end|>, which is
  exactly "greedy decoding writes the answer and stops".  A few questions also go
  through mlx_vlm.generate to show the text and confirm the verdicts agree;
- probe: a linear probe on the (frozen) vision tower's pooled output, to tell whether a
  failing question kind is missing from the image features or not read by the LM.

The CPU backend runs bf16 gather_mm only in float32 and is slow in bf16, so the models
are cast to float32 after loading (weights unchanged: bf16 values are exact in float32;
4-bit codes untouched) — the project's own rule for the CPU backend.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402

EVAL_SEED = 20261129
PYTHON_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    \"\"\""]


def log(*a):
    print(*a, flush=True)


def load_vlm(path):
    import mlx.core as mx
    from mlx_vlm import load

    model, proc = load(str(path))
    model.set_dtype(mx.float32)
    return model, proc


def text_vs_reference(model, ref) -> dict:
    import mlx.core as mx

    lg = model(mx.array([ref["text"]["ids"]]))[0]
    am = np.array(lg.argmax(-1))
    return {"text_argmax_agree": float((am == np.array(ref["text"]["argmax"])).mean()),
            "text_last_logits_maxabs_diff": float(np.abs(np.array(lg[-1, :16]) -
                                                         np.array(ref["text"]["last_logits_first16"])).max()),
            "text_logit_scale": ref["text"]["last_logit_max"]}


def exact_norms_check(bf16_path, hf_path, ref) -> dict:
    """The export stores each RMSNorm weight as bf16(1 + w), as mlx-community's does; near 2 that
    rounds by up to 2^-7.  With the exact 1 + w put back from the HF shards, what is left of the
    gap to the GPU reference is its TF32 arithmetic, so the conversion itself is checked."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(bf16_path))
    model.set_dtype(mx.float32)
    exact = []
    for shard in sorted(Path(hf_path).glob("model-*.safetensors")):
        for k, v in mx.load(str(shard)).items():
            if k.startswith("model.language_model.") and k.endswith("norm.weight") and ".linear_attn." not in k:
                exact.append(("language_model.model." + k[len("model.language_model."):], v.astype(mx.float32) + 1.0))
    model.load_weights(exact, strict=False)
    return {"norms_replaced": len(exact), **text_vs_reference(model, ref)}


def reference_check(path, ref) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    res = text_vs_reference(model, ref)
    vmodel, proc = load_vlm(path)
    r = ref["image"]
    img, _ = common.make_scene(random.Random(r["seed"]), *r["size"])
    inp = proc.image_processor([img])
    thw = mx.array(inp["image_grid_thw"])
    ids = mx.array([r["ids"]])
    lg = vmodel(ids, pixel_values=mx.array(inp["pixel_values"]), image_grid_thw=thw).logits[0]
    n = r["n_prompt"]
    pos, _ = vmodel.language_model.get_rope_index(ids, thw, None, None)
    res.update({"image_last_logits_maxabs_diff": float(np.abs(np.array(lg[n - 1, :16]) -
                                                               np.array(r["prompt_last_logits_first16"])).max()),
                "image_argmax_agree": int(lg[n - 1].argmax()) == r["prompt_last_argmax"],
                "mrope_positions_equal": bool(np.array_equal(np.array(pos[:, 0]), np.array(r["positions"])))})
    return res


def text_metrics(path, windows: int, seq: int = 512, bs: int = 8) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(path))
    model.set_dtype(mx.float32)
    held = np.load(HERE / "data" / "heldout_ids.npy").astype(np.int32)
    n = min(windows, (len(held) - 1) // seq)
    loss = correct = tot = 0
    t = time.time()
    for s in range(0, n, bs):
        e = min(n, s + bs)
        w = np.stack([held[i * seq:i * seq + seq + 1] for i in range(s, e)])
        lg = model(mx.array(w[:, :-1])).astype(mx.float32)
        y = mx.array(w[:, 1:])
        lse = mx.logsumexp(lg, axis=-1)
        picked = mx.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
        loss += float((lse - picked).sum())
        correct += int((lg.argmax(-1) == y).sum())
        tot += y.size
        log(f"  text windows {e}/{n}  ppl so far {math.exp(loss / tot):.3f}  ({time.time() - t:.0f}s)")
    return {"windows": n, "tokens": tot, "loss": loss / tot, "ppl": math.exp(loss / tot), "acc": correct / tot}


def continuations(path, max_tokens: int = 80) -> list:
    """Greedy continuations (mlx-lm's default sampler is argmax) of a few Python prompts."""
    from mlx_lm import generate, load

    model, tok = load(str(path))
    return [{"prompt": p, "continuation": generate(model, tok, p, max_tokens=max_tokens, verbose=False)}
            for p in PYTHON_PROMPTS]


def image_accuracy(path, per_kind: int, think_per_kind: int, n_generate: int) -> dict:
    import mlx.core as mx
    from mlx_vlm import apply_chat_template, generate

    model, proc = load_vlm(path)
    tok = proc.tokenizer
    rng = random.Random(EVAL_SEED)
    res: dict = {}
    samples = []
    # tokens before the answer in the target ("" or "\n</think>\n\n"), for the first-token tally
    n_prefix = {th: len(tok.encode(common.render_answer("", th), add_special_tokens=False)) - 1 for th in (False, True)}
    t = time.time()
    for think, n_per in ((False, per_kind), (True, think_per_kind)):
        for kind in common.QUESTION_KINDS:
            correct = 0
            done = 0
            answers: dict = {}
            while done < n_per:
                w, h = rng.choice(common.SIZES), rng.choice(common.SIZES)
                nb = min(25, n_per - done)
                rows, imgs, golds = [], [], []
                for _ in range(nb):
                    img, scene = common.make_scene(rng, w, h, count=1 if kind == "position" else None)
                    _, q, a = common.make_qa(rng, scene, kind)
                    prompt = apply_chat_template(proc, model.config, q, num_images=1, enable_thinking=think)
                    imgs.append(img)
                    golds.append(a)
                    rows.append((prompt, common.render_answer(a, think)))
                p_ids, pvs, thws = [], [], []
                for img, (prompt, _) in zip(imgs, rows, strict=True):
                    inp = proc(images=[img], text=[prompt])
                    p_ids.append(np.array(inp["input_ids"])[0].tolist())
                    pvs.append(inp["pixel_values"])
                    thws.append(inp["image_grid_thw"])
                t_ids = [tok.encode(tgt, add_special_tokens=False) for _, tgt in rows]
                L = max(len(p) + len(tt) for p, tt in zip(p_ids, t_ids, strict=True))
                ids = np.full((nb, L), common.ENDOFTEXT, dtype=np.int32)
                for i, (p, tt) in enumerate(zip(p_ids, t_ids, strict=True)):
                    ids[i, :len(p) + len(tt)] = p + tt
                lg = model(mx.array(ids), pixel_values=mx.concatenate(pvs), image_grid_thw=mx.concatenate(thws)).logits
                pred = np.array(lg.argmax(-1))
                for i, (p, tt) in enumerate(zip(p_ids, t_ids, strict=True)):
                    got = pred[i, len(p) - 1:len(p) - 1 + len(tt)].tolist()
                    ok = got == tt
                    correct += ok
                    k0 = n_prefix[think]
                    first = tok.decode([int(pred[i, len(p) - 1 + k0])])
                    answers[first] = answers.get(first, 0) + 1
                    if len(samples) < n_generate and not think and i == 0:
                        samples.append((imgs[i], rows[i][0], golds[i], ok))
                done += nb
            key = f"{kind}{'_think' if think else ''}"
            res[key] = correct / n_per
            res[f"{key}_n"] = n_per
            res[f"{key}_first_token_argmax"] = dict(sorted(answers.items(), key=lambda kv: -kv[1])[:6])
            log(f"  images {key}: {correct}/{n_per}  ({time.time() - t:.0f}s)")
    gen = []
    for img, prompt, gold, ok in samples:
        out = generate(model, proc, prompt, image=[img], max_tokens=12, temperature=0.0, verbose=False)
        text = out.text.strip()
        gen.append({"prompt": prompt, "gold": gold, "generated": out.text, "teacher_forced_correct": bool(ok),
                    "generate_correct": text == gold})
    res["generate_samples"] = gen
    res["generate_agrees_with_teacher_forced"] = all(g["teacher_forced_correct"] == g["generate_correct"] for g in gen)
    return res


def probe(path, n_train: int = 600, n_test: int = 300) -> dict:
    """Linear probes (softmax regression) on the mean-pooled vision-tower output."""
    import mlx.core as mx

    model, proc = load_vlm(path)
    rng = random.Random(EVAL_SEED + 1)

    def feats(n):
        X, labels = [], []
        for _ in range(n):
            img, scene = common.make_scene(rng, 128, 128)
            inp = proc.image_processor([img])
            h, _ = model.vision_tower(mx.array(inp["pixel_values"]), mx.array(inp["image_grid_thw"]))
            X.append(np.array(h.mean(axis=0)))
            labels.append(common.scene_labels(scene))
        return np.stack(X), dict(zip(common.SCENE_CLASSES, np.array(labels).T, strict=True))

    Xtr, Ytr = feats(n_train)
    Xte, Yte = feats(n_test)
    mu, sd = Xtr.mean(0), Xtr.std(0) + 1e-6
    Xtr, Xte = (Xtr - mu) / sd, (Xte - mu) / sd
    out = {}
    for k in ("colour", "shape", "count"):
        C = int(Ytr[k].max()) + 1
        W = np.zeros((Xtr.shape[1], C))
        b = np.zeros(C)
        onehot = np.eye(C)[Ytr[k]]
        for _ in range(500):
            z = Xtr @ W + b
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            g = (p - onehot) / len(Xtr)
            W -= 0.5 * (Xtr.T @ g + 1e-3 * W)
            b -= 0.5 * g.sum(0)
        out[k] = float(((Xte @ W + b).argmax(1) == Yte[k]).mean())
    out["chance"] = {"colour": 1 / len(common.COLOURS), "shape": 1 / len(common.SHAPES), "count": 0.25}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mlx", default=str(ROOT / "models" / "tiny"))
    ap.add_argument("--bf16", default=None, help="unquantized export for the reference check")
    ap.add_argument("--log", default=str(HERE / "results" / "train_log_stage4.json"))
    ap.add_argument("--hf", default=str(HERE / "hf_out"), help="the bf16 HF checkpoint (exact norm weights)")
    ap.add_argument("--out", default=str(HERE / "results" / "eval_4bit.json"))
    ap.add_argument("--text-windows", type=int, default=32)
    ap.add_argument("--per-kind", type=int, default=50)
    ap.add_argument("--think-per-kind", type=int, default=25)
    ap.add_argument("--generate", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: reference,text,continuation,images,probe")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out_path = Path(args.out)
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    ref = json.loads(Path(args.log).read_text())["final"]["reference"]
    t0 = time.time()
    if "reference" not in skip:
        res["reference"] = {"4bit": reference_check(args.mlx, ref)}
        if args.bf16:
            res["reference"]["bf16"] = reference_check(args.bf16, ref)
            if Path(args.hf).exists():
                res["reference"]["bf16_exact_norms"] = exact_norms_check(args.bf16, args.hf, ref)
        log("reference:", res["reference"])
    if "text" not in skip:
        res["text"] = text_metrics(args.mlx, args.text_windows)
        log("text:", res["text"])
    if "continuation" not in skip:
        res["continuations"] = continuations(args.mlx)
        for c in res["continuations"]:
            log("continuation:", repr(c["prompt"]), "->", repr(c["continuation"]))
    if "images" not in skip:
        res["images"] = image_accuracy(args.mlx, args.per_kind, args.think_per_kind, args.generate)
        log("images:", {k: v for k, v in res["images"].items() if k != "generate_samples"})
    if "probe" not in skip:
        res["probe"] = probe(args.mlx)
        log("probe:", res["probe"])
    res["eval_seed"] = EVAL_SEED
    res["seconds"] = time.time() - t0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    log("wrote", out_path)


if __name__ == "__main__":
    main()
