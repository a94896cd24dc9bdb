"""Train the tiny Qwen3.5-MoE (text + vision) on the GPU machine (PyTorch + transformers).

    python examples/train_tiny/train.py --out $OUT [--smoke] [--seconds 300] [--experts grouped_mm]

Needs: torch with CUDA, transformers >= 5.17 (Qwen3_5MoeForConditionalGeneration), numpy,
tokenizers, pillow; and examples/train_tiny/data/ from build_data.py (token ids + tokenizer).

Each step mixes a batch of stdlib-source windows (LM loss on every token) with a batch
of freshly drawn coloured-shape images and a question about each (loss on the answer
tokens only), plus the router load-balancing loss.  fp32 master weights with TF32
matmuls; AdamW; linear warm-up then cosine decay, the number of steps fitted to the
time budget after the first steps.  At the end the weights are rounded to bf16, the
held-out metrics are measured on exactly those weights, and the checkpoint is written
in the HF layout as safetensors shards of at most 15 MB:

  OUT/model-0000k-of-0000N.safetensors, OUT/model.safetensors.index.json,
  OUT/train_log.json (config, timings, loss curve, held-out metrics, reference logits)

--smoke: a few steps of each experts implementation, the checks, timings, and the
same save path (with the untrained weights), in about a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402

T0 = time.time()
#: The GPU machine trains; a CPU run (same code, slow) is how the script is checked elsewhere.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


class Prompts:
    """Token ids of prompts and answers (cached; the set of strings is small)."""

    def __init__(self, tok):
        self.tok = tok
        self.cache: dict[str, list[int]] = {}

    def ids(self, s: str) -> list[int]:
        r = self.cache.get(s)
        if r is None:
            r = self.tok.encode(s, add_special_tokens=False).ids
            self.cache[s] = r
        return r


SYSTEM = "You are a helpful assistant."


def qa_example(rng: random.Random, prompts: Prompts, size, kind=None, think=None, scene_count=None,
               kind_weights=None):
    """One image + question; returns (uint8 HxWx3, prompt ids, answer ids, kind, answer, scene labels)."""
    img, scene = common.make_scene(rng, size[0], size[1], count=scene_count)
    kind, q, a = common.make_qa(rng, scene, kind, kind_weights)
    if think is None:
        think = rng.random() < 0.5
    system = SYSTEM if rng.random() < 0.1 else None
    p = prompts.ids(common.render_image_prompt(q, think, system))
    t = prompts.ids(common.render_answer(a, think))
    return np.asarray(img, dtype=np.uint8), p, t, kind, a, common.scene_labels(scene)


def build_image_batch(examples, grid_hw):
    """Expand the image pad, pad right; returns numpy ids, labels, positions, images, scene labels."""
    gh, gw = grid_hw
    n_img_tok = (gh // common.MERGE) * (gw // common.MERGE)
    rows, labels = [], []
    for _, p, t, _, _, _ in examples:
        k = p.index(common.IMAGE_PAD)
        pe = p[:k] + [common.IMAGE_PAD] * n_img_tok + p[k + 1:]
        ids = pe + t
        rows.append(ids)
        labels.append([-100] * len(pe) + t)
    L = max(len(r) for r in rows)
    ids_arr = np.full((len(rows), L), common.ENDOFTEXT, dtype=np.int64)
    lab_arr = np.full((len(rows), L), -100, dtype=np.int64)
    pos_arr = np.zeros((3, len(rows), L), dtype=np.int64)
    for i, (r, lab) in enumerate(zip(rows, labels, strict=True)):
        ids_arr[i, :len(r)] = r
        lab_arr[i, :len(lab)] = lab
        full = r + [common.ENDOFTEXT] * (L - len(r))
        pos_arr[:, i] = common.mrope_positions(full, [(1, gh, gw)])
    imgs = np.stack([e[0] for e in examples])
    return ids_arr, lab_arr, pos_arr, imgs, np.asarray([e[5] for e in examples], dtype=np.int64)


def patchify_torch(imgs: torch.Tensor) -> torch.Tensor:
    """uint8 [B,H,W,3] on GPU -> pixel rows [B*gh*gw, 1536], same layout as common.patchify."""
    B, H, W, _ = imgs.shape
    P, T, M = common.PATCH, common.TEMPORAL_PATCH, common.MERGE
    gh, gw = H // P, W // P
    x = imgs.permute(0, 3, 1, 2).float() / 255.0
    x = (x - 0.5) / 0.5  # B,C,H,W
    x = x[:, None].expand(B, T, 3, H, W)
    x = x.reshape(B, T, 3, gh // M, M, P, gw // M, M, P)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # B, gh/M, gw/M, M, M, C, T, P, P
    return x.reshape(B * gh * gw, 3 * T * P * P).contiguous()


def _scene_worker(q, batch: int, seed: int):
    """Images and their scene labels only (the vision warm-up phase)."""
    rng = random.Random(seed)
    while True:
        w, h = rng.choice(common.SIZES), rng.choice(common.SIZES)
        imgs, labels = [], []
        for _ in range(batch):
            img, scene = common.make_scene(rng, w, h)
            imgs.append(np.asarray(img, dtype=np.uint8))
            labels.append(common.scene_labels(scene))
        q.put((np.stack(imgs), np.asarray(labels, dtype=np.int64)))


def _image_worker(q, batch: int, seed: int, tok_path: str, kind_weights):
    from tokenizers import Tokenizer

    prompts = Prompts(Tokenizer.from_file(tok_path))
    rng = random.Random(seed)
    while True:
        w, h = rng.choice(common.SIZES), rng.choice(common.SIZES)
        ex = [qa_example(rng, prompts, (w, h), kind_weights=kind_weights) for _ in range(batch)]
        q.put(build_image_batch(ex, (h // common.PATCH, w // common.PATCH)))


class ImageBatches:
    """Worker processes drawing batches (one image size per batch) with ``worker(q, batch,
    seed, *args)``; read in a fixed round-robin order so a run is reproducible."""

    def __init__(self, worker, batch: int, seed: int, *args, workers: int = 3, depth: int = 4):
        import multiprocessing as mp

        ctx = mp.get_context("fork")  # forked before CUDA is initialised
        self.qs = [ctx.Queue(maxsize=depth) for _ in range(workers)]
        self.procs = [ctx.Process(target=worker, args=(q, batch, seed * 1000 + i, *args), daemon=True)
                      for i, q in enumerate(self.qs)]
        for p in self.procs:
            p.start()
        self.i = 0

    def get(self):
        b = self.qs[self.i % len(self.qs)].get()
        self.i += 1
        return b

    def close(self):
        for p in self.procs:
            p.terminate()


# ---------------------------------------------------------------------------
# Model helpers
# ---------------------------------------------------------------------------


def set_experts_impl(model, impl: str):
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation_internal"):
            cfg._experts_implementation_internal = impl
    for c in (model.config, model.config.text_config):
        c._experts_implementation_internal = impl


def aux_loss_of(out, cfg_text):
    aux = getattr(out, "aux_loss", None)
    if aux is not None and torch.is_tensor(aux):
        return aux
    rl = getattr(out, "router_logits", None)
    if not rl:
        return torch.zeros((), device=DEV)
    E, k = cfg_text.num_experts, cfg_text.num_experts_per_tok
    tot = 0.0
    for lg in rl:
        p = torch.softmax(lg.float(), dim=-1)
        sel = torch.topk(p, k, dim=-1).indices
        frac = torch.zeros(E, device=p.device).scatter_add_(0, sel.reshape(-1), torch.ones(sel.numel(), device=p.device))
        frac = frac / sel.shape[0]
        tot = tot + E * (frac * p.mean(0)).sum()
    return tot / len(rl)


def text_forward(model, x):
    out = model(input_ids=x, output_router_logits=True, use_cache=False)
    return out


class SceneProbe(torch.nn.Module):
    """Linear heads reading colour, shape, count and position from the mean of an image's
    merger outputs.  Training only (not saved): a direct loss that gets the vision tower
    to encode what the questions ask about; the language model then learns to read it."""

    def __init__(self, dim: int):
        super().__init__()
        self.sizes = [len(v) for v in common.SCENE_CLASSES.values()]
        self.head = torch.nn.Linear(dim, sum(self.sizes))

    def forward(self, pooled: torch.Tensor, labels: torch.Tensor):
        """Mean cross-entropy over the attributes and per-attribute accuracy."""
        logits = self.head(pooled.float()).split(self.sizes, dim=-1)
        loss, acc = 0.0, {}
        for i, (name, lg) in enumerate(zip(common.SCENE_CLASSES, logits, strict=True)):
            y = labels[:, i]
            m = y != -100
            n = m.sum().clamp(min=1)  # a batch may hold no single-shape image (no position)
            loss = loss + F.cross_entropy(lg, y, ignore_index=-100, reduction="sum") / n / len(logits)
            acc[name] = ((lg.argmax(-1) == y) & m).sum() / n
        return loss, acc


class MergerTap:
    """Keeps the last output of the vision merger (the LM's image embeddings)."""

    def __init__(self, model):
        self.out = None
        model.model.visual.merger.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        self.out = output[0] if isinstance(output, tuple) else output

    def pooled(self, n_images: int) -> torch.Tensor:
        """[n_images, dim]: every image of a batch has the same size, so the same token count."""
        return self.out.reshape(n_images, -1, self.out.shape[-1]).mean(1)


def vision_forward(model, imgs: torch.Tensor):
    """Run only the vision tower on uint8 [B,H,W,3] images (the merger tap sees the output)."""
    B, H, W, _ = imgs.shape
    thw = torch.tensor([[1, H // common.PATCH, W // common.PATCH]] * B, device=imgs.device, dtype=torch.long)
    model.model.visual(patchify_torch(imgs), grid_thw=thw)


def image_forward(model, batch):
    ids, lab, pos, imgs = batch[:4]
    B, H, W, _ = imgs.shape
    gh, gw = H // common.PATCH, W // common.PATCH
    dev = DEV
    ids_t = torch.from_numpy(ids).to(dev, non_blocking=True)
    lab_t = torch.from_numpy(lab).to(dev, non_blocking=True)
    pos_t = torch.from_numpy(pos).to(dev, non_blocking=True)
    pix = patchify_torch(torch.from_numpy(imgs).to(dev, non_blocking=True))
    thw = torch.tensor([[1, gh, gw]] * B, device=dev, dtype=torch.long)
    out = model(input_ids=ids_t, pixel_values=pix, image_grid_thw=thw, position_ids=pos_t,
                output_router_logits=True, use_cache=False)
    return out, lab_t


def ce(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


@torch.no_grad()
def eval_text(model, held: torch.Tensor, seq: int = 512, max_windows: int | None = None, bs: int = 64):
    model.eval()
    n = (len(held) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    tot_loss, tot_correct, tot = 0.0, 0, 0
    for s in range(0, n, bs):
        e = min(n, s + bs)
        idx = torch.arange(s, e, device=held.device)[:, None] * seq + torch.arange(seq + 1, device=held.device)
        w = held[idx]
        logits = model(input_ids=w[:, :-1], use_cache=False).logits.float()
        y = w[:, 1:]
        tot_loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        tot_correct += (logits.argmax(-1) == y).sum().item()
        tot += y.numel()
    model.train()
    return {"tokens": tot, "loss": tot_loss / tot, "ppl": math.exp(tot_loss / tot), "acc": tot_correct / tot}


@torch.no_grad()
def eval_images(model, prompts: Prompts, per_kind: int = 100, seed: int = 10_000_019):
    """Teacher-forced exact match of the whole answer (+ <|im_end|>) = greedy answer correct."""
    model.eval()
    rng = random.Random(seed)
    res = {}
    loss_sum, loss_n = 0.0, 0
    for think in (False, True):
        for kind in common.QUESTION_KINDS:
            correct = 0
            done = 0
            while done < per_kind:
                w, h = rng.choice(common.SIZES), rng.choice(common.SIZES)
                nb = min(50, per_kind - done)
                ex = [qa_example(rng, prompts, (w, h), kind=kind, think=think,
                                 scene_count=1 if kind == "position" else None) for _ in range(nb)]
                batch = build_image_batch(ex, (h // common.PATCH, w // common.PATCH))
                out, lab = image_forward(model, batch)
                logits = out.logits[:, :-1].float()
                y = lab[:, 1:]
                m = y != -100
                pred = logits.argmax(-1)
                ok = ((pred == y) | ~m).all(dim=1)
                correct += ok.sum().item()
                loss_sum += F.cross_entropy(logits[m], y[m], reduction="sum").item()
                loss_n += m.sum().item()
                done += nb
            res[f"{kind}{'_think' if think else ''}"] = correct / per_kind
    res["answer_loss"] = loss_sum / max(loss_n, 1)
    model.train()
    return res


@torch.no_grad()
def reference_logits(model, held: torch.Tensor, prompts: Prompts):
    """Numbers the MLX side compares with after conversion (same bf16 weights)."""
    model.eval()
    x = held[:64][None]
    lg = model(input_ids=x, use_cache=False).logits[0].float()
    text = {"ids": x[0].tolist(), "argmax": lg.argmax(-1).tolist(), "last_logits_first16": lg[-1, :16].tolist(),
            "last_logit_max": lg[-1].max().item()}
    rng = random.Random(7)
    ex = [qa_example(rng, prompts, (160, 128), kind="colour", think=False)]
    batch = build_image_batch(ex, (128 // common.PATCH, 160 // common.PATCH))
    out, lab = image_forward(model, batch)
    ilg = out.logits[0].float()
    n_prompt = int((lab[0] == -100).sum().item())
    image = {"seed": 7, "size": [160, 128], "ids": batch[0][0].tolist(), "n_prompt": n_prompt,
             "answer": ex[0][4], "prompt_last_logits_first16": ilg[n_prompt - 1, :16].tolist(),
             "prompt_last_argmax": int(ilg[n_prompt - 1].argmax().item()),
             "positions": batch[2][:, 0].tolist()}
    model.train()
    return {"text": text, "image": image}


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------


def save_hf(model, out: Path, max_shard: int = 15_000_000):
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    shards, cur, cur_size = [], {}, 0
    for k, v in sd.items():
        nb = v.numel() * v.element_size()
        if cur and cur_size + nb > max_shard:
            shards.append(cur)
            cur, cur_size = {}, 0
        cur[k] = v
        cur_size += nb
    if cur:
        shards.append(cur)
    weight_map, total = {}, 0
    names = []
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / name), metadata={"format": "pt"})
        names.append(name)
        for k, v in sh.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"shards": names, "total_size": total, "tensors": len(sd),
            "files": {n: (out / n).stat().st_size for n in names}}


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def train_vision(model, probe: SceneProbe, tap: MergerTap, scenes: ImageBatches, args) -> dict:
    """Warm-up phase: the vision tower and the probe alone, on scene labels, for
    ``args.vision_seconds`` (a few seconds with --smoke).  Batches of hundreds of images
    take milliseconds here, so the tower sees far more images than the joint phase allows."""
    seconds = 5.0 if args.smoke else args.vision_seconds
    params = list(model.model.visual.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=args.vision_lr, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    history, step, total, warmup = [], 0, None, 50
    t_start = time.time()
    while total is None or step < total:
        if total is None and step == 40:
            sync()
            per = (time.time() - t_start) / 40
            total = max(41, int(seconds / per))
            log(f"vision phase: {per * 1000:.1f} ms/step over the first 40 -> {total} steps")
        prog = 0.0 if total is None else min(1.0, step / total)
        lr = args.vision_lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))
        for g in opt.param_groups:
            g["lr"] = lr
        imgs, labels = scenes.get()
        vision_forward(model, torch.from_numpy(imgs).to(DEV, non_blocking=True))
        loss, acc = probe(tap.pooled(len(imgs)), torch.from_numpy(labels).to(DEV, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == total:
            rec = {"step": step, "time": round(time.time() - t_start, 2), "lr": lr, "loss": round(loss.item(), 4),
                   "acc": {k: round(v.item(), 3) for k, v in acc.items()}}
            history.append(rec)
            if step % 250 == 0 or step == total:
                log("vision", rec)
    model.zero_grad(set_to_none=True)
    return {"seconds": round(time.time() - t_start, 1), "steps": step, "images": step * args.vision_batch,
            "history": history}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seconds", type=float, default=300.0, help="training time budget")
    ap.add_argument("--experts", default="grouped_mm")
    ap.add_argument("--text-batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--image-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--aux", type=float, default=0.01)
    ap.add_argument("--image-weight", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None, help="start from the bf16 HF shards in this folder (continued training)")
    ap.add_argument("--vision-seconds", type=float, default=0.0,
                    help="first train the vision tower alone on the scene labels for this long")
    ap.add_argument("--vision-batch", type=int, default=256)
    ap.add_argument("--vision-lr", type=float, default=2e-3)
    ap.add_argument("--probe-weight", type=float, default=0.0,
                    help="weight of the scene-label loss on the question images during the joint phase")
    ap.add_argument("--kind-weights", default=None,
                    help="question mix colour,shape,count,position (default 0.3,0.3,0.25,0.3)")
    args = ap.parse_args()
    kind_weights = None
    if args.kind_weights:
        kind_weights = dict(zip(common.QUESTION_KINDS, map(float, args.kind_weights.split(",")), strict=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import transformers
    from tokenizers import Tokenizer
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data = Path(args.data)
    scenes = ImageBatches(_scene_worker, args.vision_batch, args.seed + 3, workers=6) \
        if (args.vision_seconds > 0 or args.smoke) else None
    images = ImageBatches(_image_worker, args.image_batch, args.seed + 1, str(data / "tokenizer.json"), kind_weights)

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version,
            "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "args": vars(args)}
    log(info)

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    checks = json.loads((data / "check_tokens.json").read_text())
    for s, ids in checks.items():
        assert tok.encode(s, add_special_tokens=False).ids == ids, f"tokenizer disagrees on {s!r}"
    prompts = Prompts(tok)
    train_ids = torch.from_numpy(np.load(data / "train_ids.npy").astype(np.int64)).to(DEV)
    held_ids = torch.from_numpy(np.load(data / "heldout_ids.npy").astype(np.int64)).to(DEV)
    log(f"tokens: train {len(train_ids)}, held-out {len(held_ids)}")

    cfg_dict = common.hf_config()
    cfg = Qwen3_5MoeConfig.from_dict(cfg_dict)
    model = Qwen3_5MoeForConditionalGeneration(cfg).to(DEV).float()
    set_experts_impl(model, args.experts)
    if args.init:
        from safetensors.torch import load_file

        init = Path(args.init)
        index = json.loads((init / "model.safetensors.index.json").read_text())
        sd = {}
        for shard in sorted(set(index["weight_map"].values())):
            sd.update({k: v.float() for k, v in load_file(str(init / shard)).items()})
        model.load_state_dict(sd, strict=True)
        info["init"] = {"from": str(init), "tensors": len(sd)}
        log(f"initialised from {init} ({len(sd)} tensors)")
    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in n)
    log(f"params {n_params / 1e6:.3f} M (vision {n_vision / 1e6:.3f} M), layer types {cfg.text_config.layer_types}")
    info["params"] = n_params
    info["params_vision"] = n_vision
    if args.smoke:
        keys = list(model.state_dict())
        log(len(keys), "tensors;", [k for k in keys if ".layers.0." in k or ".layers.3." in k or "visual.blocks" not in k][:60])

    # patchify check against the numpy reference (the MLX side uses mlx-vlm's, checked equal to it)
    rng = random.Random(1)
    img, _ = common.make_scene(rng, 160, 128)
    ref, grid = common.patchify(img)
    mine = patchify_torch(torch.from_numpy(np.asarray(img)[None].copy()).to(DEV)).cpu().numpy()
    assert grid == (1, 8, 10) and np.abs(ref - mine).max() < 1e-6, "patchify mismatch"

    probe = SceneProbe(cfg.vision_config.out_hidden_size).to(DEV)
    tap = MergerTap(model)
    if scenes is not None:
        info["vision_phase"] = train_vision(model, probe, tap, scenes, args)
        scenes.close()

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if (p.ndim < 2 or "norm" in n or "A_log" in n or "dt_bias" in n or "embed" in n) else decay).append(p)
    no_decay += list(probe.parameters()) if args.probe_weight > 0 else []
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    gen = torch.Generator(device=DEV)
    gen.manual_seed(args.seed + 2)
    N, L = len(train_ids), args.seq
    cfg_text = cfg.text_config

    def step_fn(lr):
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, N - L - 1, (args.text_batch,), device=DEV, generator=gen)
        w = train_ids[starts[:, None] + torch.arange(L + 1, device=DEV)]
        out_t = text_forward(model, w[:, :-1])
        lt = ce(out_t.logits, w[:, 1:])
        at = aux_loss_of(out_t, cfg_text)
        batch = images.get()
        out_i, lab = image_forward(model, batch)
        li = ce(out_i.logits[:, :-1], lab[:, 1:])
        ai = aux_loss_of(out_i, cfg_text)
        loss = lt + args.image_weight * li + args.aux * 0.5 * (at + ai)
        lp = torch.zeros((), device=DEV)
        if args.probe_weight > 0:
            lp, _ = probe(tap.pooled(len(batch[3])), torch.from_numpy(batch[4]).to(DEV))
            loss = loss + args.probe_weight * lp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return lt.detach(), li.detach(), (0.5 * (at + ai)).detach(), gn.detach(), lp.detach()

    if args.smoke:
        timings = {}
        for impl in ["grouped_mm", "eager", "batched_mm"]:
            try:
                set_experts_impl(model, impl)
                sync()
                for _ in range(2):
                    step_fn(1e-4)
                sync()
                t = time.time()
                for _ in range(5):
                    r = step_fn(1e-4)
                sync()
                timings[impl] = (time.time() - t) / 5
                log(f"experts={impl}: {timings[impl] * 1000:.1f} ms/step, losses {[round(x.item(), 3) for x in r]}")
            except Exception as e:  # report and go on
                log(f"experts={impl} failed: {type(e).__name__}: {e}")
        info["smoke_step_seconds"] = timings
        set_experts_impl(model, min(timings, key=timings.get))
        t = time.time()
        log("eval text (8 windows)", eval_text(model, held_ids, max_windows=8), f"{time.time() - t:.2f}s")
        t = time.time()
        log("eval images (4/kind)", eval_images(model, prompts, per_kind=4), f"{time.time() - t:.2f}s")
        log("peak mem GiB", torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else None)
        steps_total = None
        history = []
    else:
        history = []
        best = None
        t_start = time.time()
        steps_total = None
        step = 0

        def lr_at(step):
            total = steps_total or 10_000
            if step < args.warmup:
                return args.lr * (step + 1) / args.warmup
            prog = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
            return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

        try:
            while steps_total is None or step < steps_total:
                if time.time() - t_start > args.seconds * 1.25:
                    log("time budget exceeded, stopping")
                    break
                if steps_total is None and step == 30:
                    sync()
                    per = (time.time() - t_start) / 30
                    steps_total = int(args.seconds / per)
                    log(f"{per * 1000:.1f} ms/step over the first 30 -> {steps_total} steps")
                lr = lr_at(step)
                lt, li, a, gn, lp = step_fn(lr)
                step += 1
                if step % 10 == 0:
                    rec = {"step": step, "time": round(time.time() - t_start, 2), "lr": lr,
                           "text_loss": round(lt.item(), 4), "image_loss": round(li.item(), 4),
                           "aux": round(a.item(), 4), "grad_norm": round(gn.item(), 3),
                           "probe_loss": round(lp.item(), 4)}
                    history.append(rec)
                    if step % 50 == 0:
                        log(rec)
                    if not (math.isfinite(rec["text_loss"]) and math.isfinite(rec["image_loss"])):
                        log("non-finite loss, stopping")
                        info["error"] = f"non-finite loss at step {step}"
                        break
                if step % args.eval_every == 0 or step == steps_total:
                    et = eval_text(model, held_ids, max_windows=64)
                    ei = eval_images(model, prompts, per_kind=20, seed=5_000_011)
                    score = et["loss"] + ei["answer_loss"]
                    history.append({"step": step, "time": round(time.time() - t_start, 2), "heldout_text": et,
                                    "heldout_images": ei})
                    log(f"step {step}: held-out text {et}, images {ei}")
                    if math.isfinite(score) and (best is None or score < best[0]):
                        best = (score, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        except Exception as e:  # keep what was trained so far
            import traceback

            traceback.print_exc()
            info["error"] = f"{type(e).__name__}: {e}"
        sync()
        info["train_seconds"] = time.time() - t_start
        info["steps"] = step
        info["steps_planned"] = steps_total
        info["tokens_seen"] = {"text": step * args.text_batch * L}
        info["examples_seen"] = {"image_qa": step * args.image_batch}
        if best is not None and best[1] != step:
            log(f"restoring the best held-out checkpoint from step {best[1]} (score {best[0]:.4f})")
            model.load_state_dict(best[2])
        info["selected_step"] = best[1] if best is not None else step

    images.close()

    # round to bf16: the metrics below are those of the saved weights
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    t = time.time()
    final = {}
    if not args.smoke:
        final["heldout_text"] = eval_text(model, held_ids)
        final["heldout_text_first32"] = eval_text(model, held_ids, max_windows=32)
        final["heldout_images"] = eval_images(model, prompts, per_kind=100)
        log("final", final, f"{time.time() - t:.1f}s")
    final["reference"] = reference_logits(model, held_ids, prompts)
    info["final"] = final
    info["history"] = history
    info["save"] = save_hf(model, out)
    info["hf_config"] = cfg_dict
    info["wall_seconds"] = time.time() - T0
    (out / "train_log.json").write_text(json.dumps(info, indent=1) + "\n")
    log("saved", info["save"])
    os._exit(0)


if __name__ == "__main__":
    main()
