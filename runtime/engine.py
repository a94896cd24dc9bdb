"""The engine: opens a converted model inside a memory cap and runs it, streaming routed experts.

Per layer: the token mixer and the router run, the model's own top-k picks the experts, hits bind their
slot, misses are read in parallel, the next layer's experts are guessed from its router on the current
hidden state and read ahead, and the experts are combined in router-rank order. Which slot an expert
came from never enters the math, so logits are bit-identical at every cap and prefetch setting.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.config import ModelArgs
from ..formats.direct import RangeReader, file_checksum
from ..formats.errors import StreamoeError, fail
from ..formats.layout import record_layouts
from ..formats.manifest import load_manifest, safe_path
from . import model as model_mod
from .image import ImageConfig, load_image, preprocess
from .model import Model, combine, expert_mlp, text_positions
from .mrope import expand_image_tokens, image_positions
from .plan import Options, current_rss, default_dtype, plan_for
from .store import ExpertStore, SlotPool
from .telemetry import LayerStats, StepStats
from .text import TextIO
from .tier import HotTier
from .vision import VisionArgs, VisionEncoder
from .weights import load_tensors, mx_dtype, read_tensor


def fix_malloc_thresholds() -> None:
    """Make glibc return freed large blocks to the OS at once.

    glibc raises its mmap threshold dynamically (up to 32 MiB) after large frees, so later buffers of a few
    MiB (MLX CPU arrays, numpy temporaries) come from the heap and stay resident after they are freed:
    0.2 GiB of RSS on a full-size prefill, outside any plan. A fixed 128 KiB threshold ends that.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc (macOS): nothing to fix
        pass


class Engine:
    def __init__(self, root: str | Path, opts: Options | None = None):
        self.root, self.opts = Path(root), opts or Options()
        o = self.opts
        fix_malloc_thresholds()
        self.manifest = m = load_manifest(self.root)
        if o.verify:
            for f in m.all_files():
                p = safe_path(self.root, f["path"])
                if not p.is_file() or p.stat().st_size != f["size"]:
                    raise fail(p, f"missing or size differs from the manifest ({f['size']} bytes expected)")
                if file_checksum(p) != f["checksum"]:
                    raise fail(p, "checksum mismatch against the manifest")
        self.text = TextIO(self.root, m.config)
        self.plan = plan_for(self.root, o, m)
        self.plan.require_fit()
        mx.set_cache_limit(32 << 20)
        self.dtype = mx_dtype(o.dtype or default_dtype())
        on_cpu = mx.default_device() == mx.cpu
        model_mod.set_cpu_streams(o.cpu_streams if o.cpu_streams is not None else (min(4, os.cpu_count() or 1) if on_cpu else 1))
        self.args = ModelArgs.from_config(m.config, self.root / "manifest.json")
        fmt = m.expert_formats()[o.experts]
        self.lay = fmt.layout
        n_layers, self.n_exp, self.k = m.model["num_layers"], m.model["num_experts"], m.model["top_k"]
        layouts = record_layouts(self.lay.hidden, self.lay.intermediate, self.lay.group_size, self.lay.scale_dtype)
        self.store = ExpertStore([safe_path(self.root, f["path"]) for f in fmt.files], self.lay, self.n_exp, layouts,
                                 o.experts, o.io_threads)
        self.pool = SlotPool(self.plan.hot_slots + self.n_exp, self.lay)
        self.tier = HotTier(self.plan.hot_slots, self.n_exp, n_layers, self.n_exp,
                            scratch=2 * self.k + o.prefetch_width, policy=o.tier)
        file, table = m.blob("nonexpert")
        self.model = Model(self.args, load_tensors(safe_path(self.root, file["path"]), table, self.dtype), self.dtype)
        self.cache = self.model.make_cache(o.ctx, mx_dtype(o.kv))
        self.offset = 0
        self.rope_delta = 0  # position minus cache offset: images advance positions by less than their tokens
        self.inflight: dict[int, object] = {}  # slot -> Future of its read
        self.prefetched: dict[tuple[int, int], int] = {}
        self.issued: dict[int, int] = {}  # layer -> prefetch reads issued for it
        self.steps: list[StepStats] = []
        if self.plan.hot_slots >= n_layers * self.n_exp:
            self._preload_all()
        self.peak_rss = current_rss()

    def _preload_all(self) -> None:
        """When the cap holds every expert, read them all at open: the run is then fully resident."""
        for li in range(self.args.num_hidden_layers):
            for e in range(self.n_exp):
                slot = li * self.n_exp + e
                self.tier.assign(slot, (li, e))
                self._read((li, e), slot)
        for s in list(self.inflight):
            self._settle(s)
        self.store.bytes_read = 0

    # ---- expert I/O
    def _read(self, key: tuple[int, int], slot: int) -> None:
        self.inflight[slot] = self.store.read(key[0], key[1], self.pool.memory(slot))
        self.tier.busy.add(slot)

    def _settle(self, slot: int) -> float:
        """Wait for a slot's read, if any; returns the seconds waited."""
        fut = self.inflight.pop(slot, None)
        if fut is None:
            return 0.0
        t = time.perf_counter()
        fut.result()
        self.tier.busy.discard(slot)
        return time.perf_counter() - t

    def _reap(self) -> None:
        for s in [s for s, f in self.inflight.items() if f.done()]:
            self._settle(s)

    def prefetch(self, layer: int, logits: np.ndarray) -> None:
        """Read ahead the `width` experts layer `layer`'s router likes best for the current hidden state."""
        w = self.opts.prefetch_width
        if w <= 0 or layer >= self.args.num_hidden_layers:
            return
        self._reap()
        scores = logits.reshape(-1, logits.shape[-1]).max(axis=0)
        for e in np.argsort(-scores, kind="stable")[:w]:
            key = (layer, int(e))
            if self.tier.lookup(key) is not None:
                continue
            slot, _ = self.tier.place(key, optional=True)
            if slot is None:
                continue
            self._read(key, slot)
            self.prefetched[key] = slot
            self.issued[layer] = self.issued.get(layer, 0) + 1

    def routed(self, layer: int, x: mx.array, inds: np.ndarray, scores: mx.array, st: LayerStats) -> mx.array:
        """The routed experts' output for tokens x [T, H] picked as inds [T, k], combined in rank order."""
        experts = np.unique(inds)
        st.picks = len(experts)
        st.experts = experts.tolist()
        self._reap()
        self.tier.note_picks(layer, inds.reshape(-1))  # this pick counts toward the admission of a miss
        slots: dict[int, int] = {}
        for e in experts.tolist():  # pin every hit first, so placing a miss cannot evict one
            key = (layer, e)
            slot = self.tier.lookup(key)
            if slot is None:
                continue
            if self.prefetched.get(key) == slot:
                st.hits_prefetch += 1
            elif self.tier.is_staging(slot):
                st.hits_lent += 1
            else:
                st.hits_hot += 1
            self.tier.pinned.add(slot)
            slots[e] = slot
        for e in experts.tolist():
            if e not in slots:
                slot, _ = self.tier.place((layer, e))
                self._read((layer, e), slot)
                self.tier.pinned.add(slot)
                slots[e] = slot
                st.misses += 1
        st.prefetch_wasted = sum(1 for (ly, e) in self.prefetched if ly == layer and e not in slots)
        self.prefetched = {k: v for k, v in self.prefetched.items() if k[0] != layer}
        T, k = inds.shape
        streams = model_mod.STREAMS or [mx.default_stream(mx.default_device())]
        outs: dict[int, mx.array] = {}
        where = [None] * len(experts)

        def run(j: int, e: int) -> None:
            rows, ranks = np.nonzero(inds == e)
            with mx.stream(streams[j % len(streams)]):  # experts are independent: one core each
                xe = x if T == 1 else x[mx.array(rows)]
                outs[e] = expert_mlp(xe, self.pool.views[slots[e]], self.lay.bits, self.lay.group_size, self.dtype)
            where[j] = rows * k + ranks

        # experts already in memory start computing while the missing ones are still being read
        waiting = [(j, e) for j, e in enumerate(experts.tolist()) if slots[e] in self.inflight]
        for j, e in enumerate(experts.tolist()):
            if slots[e] not in self.inflight:
                run(j, e)
        if outs and waiting:
            mx.async_eval(list(outs.values()))
        st.io_wait_ms += 1000 * sum(self._settle(slots[e]) for _, e in waiting)
        for j, e in waiting:
            run(j, e)
        ys = [outs[e] for e in experts.tolist()]
        order = np.argsort(np.concatenate(where), kind="stable")
        out = mx.concatenate(ys, axis=0)[mx.array(order)].reshape(T, k, -1)
        return combine(out, scores.reshape(T, k))

    # ---- one forward step over a chunk of tokens
    def forward(self, tokens: list[int], phase: str, positions: mx.array | None = None,
                embeddings: mx.array | None = None) -> mx.array:
        t0 = time.perf_counter()
        T = len(tokens)
        step = StepStats(step=len(self.steps), phase=phase, n_tokens=T)
        if self.offset + T > self.opts.ctx:
            raise StreamoeError(f"prompt of {self.offset + T} tokens is longer than the planned context --ctx {self.opts.ctx}")
        h = embeddings if embeddings is not None else self.model.embed(mx.array([tokens]))
        pos = positions if positions is not None else text_positions(self.offset + self.rope_delta, T)
        pinned_prev: list[int] = []
        n_layers = self.args.num_hidden_layers
        for i in range(n_layers):
            st = LayerStats(layer=i, prefetch_issued=self.issued.pop(i, 0))
            read0 = self.store.bytes_read
            h, x = self.model.mix(i, h, self.cache[i], pos)
            logits = self.model.router_logits(i, x)
            guess = None
            if phase == "decode" and self.opts.prefetch_width > 0 and i + 1 < n_layers:
                guess = self.model.router_logits(i + 1, x)
            inds, scores = self.model.route(logits)
            tc = time.perf_counter()
            mx.eval(h, x, inds, scores, *([guess] if guess is not None else []))
            st.compute_ms = 1000 * (time.perf_counter() - tc)
            self.tier.pinned.difference_update(pinned_prev)
            inds_np = np.array(inds).reshape(T, -1).astype(np.int64)
            x2 = x.reshape(T, -1)
            y = self.routed(i, x2, inds_np, scores, st)
            pinned_prev = [self.tier.lookup((i, int(e))) for e in np.unique(inds_np)]
            if guess is not None:
                self.prefetch(i + 1, np.array(guess.astype(mx.float32)))
            h = h + (y.reshape(h.shape) + self.model.shared_expert(i, x))  # mlx-lm's order of the sums
            st.bytes_read = self.store.bytes_read - read0
            step.layers.append(st)
        logits = self.model.head(h[:, -1:, :])
        tc = time.perf_counter()
        mx.eval(logits)
        step.layers[-1].compute_ms += 1000 * (time.perf_counter() - tc)
        self.tier.pinned.difference_update(pinned_prev)
        self.offset += T
        step.ms = 1000 * (time.perf_counter() - t0)
        self.steps.append(step)
        self.peak_rss = max(self.peak_rss, current_rss())
        return logits.reshape(-1)

    def prefill(self, tokens: list[int]) -> mx.array:
        """A prompt, in chunks, expert-major through the staging slots (taken back from the tier first)."""
        if not tokens:
            raise StreamoeError("empty prompt")
        if self.offset + len(tokens) > self.opts.ctx:
            raise StreamoeError(f"prompt of {len(tokens)} tokens (+{self.offset} in context) is longer than the planned "
                                f"context --ctx {self.opts.ctx}")
        return self._prefill_chunks(tokens)

    def _prefill_chunks(self, ids: list[int], positions: mx.array | None = None, emb: mx.array | None = None) -> mx.array:
        """Take the staging slots back from the tier, run the prompt chunk by chunk, lend them again."""
        for s in list(self.inflight):
            self._settle(s)
        self.tier.reclaim_staging()
        self.prefetched.clear()
        self.issued.clear()
        c = self.opts.prefill_chunk
        for a in range(0, len(ids), c):
            b = min(len(ids), a + c)
            logits = self.forward(ids[a:b], "prefill", positions=None if positions is None else positions[:, :, a:b],
                                  embeddings=None if emb is None else emb[:, a:b])
        self.tier.lend_staging()
        return logits

    def generate(self, prompt: list[int], max_tokens: int, sampler, images: list | None = None):
        """Yield generated token ids (stop token excluded) with their logits."""
        logits = self.prefill_images(prompt, images) if images else self.prefill(prompt)
        for _ in range(max_tokens):
            lg = np.array(logits.astype(mx.float32))
            tok = sampler(lg)
            self.steps[-1].token_id = tok
            if tok in self.text.stop_ids:
                return
            yield tok, lg
            if self.offset >= self.opts.ctx:
                return
            logits = self.forward([tok], "decode")

    def reset(self) -> None:
        self.cache = self.model.make_cache(self.opts.ctx, mx_dtype(self.opts.kv))
        self.offset = 0
        self.rope_delta = 0

    # ---- images
    def encode_image(self, path) -> tuple[mx.array, tuple[int, int, int]]:
        """One image file -> (features [n_tokens, H], grid (t, h, w)); vision weights are read from vision.bin
        stage by stage and dropped after, so nothing of the encoder stays resident."""
        if not self.opts.images:
            raise StreamoeError("images were not planned for: open the engine with images enabled (--image/--chat)")
        m = self.manifest
        cfg = ImageConfig.from_config(m.config, self._preprocessor(), max_pixels=self.opts.max_pixels)
        img = load_image(path, max_decode_pixels=self.opts.max_decode_pixels)
        patches, grid = preprocess(img, cfg)
        del img
        file, table = m.blob("vision")
        by_name = {t.name: t for t in table}
        with RangeReader(safe_path(self.root, file["path"]), 16 << 20) as reader:
            enc = VisionEncoder(VisionArgs.from_config(m.config), lambda name: read_tensor(reader, by_name[name]), self.dtype)
            feats = enc.encode(patches, grid)
            mx.eval(feats)
        self.peak_rss = max(self.peak_rss, current_rss())
        return feats, grid

    def _preprocessor(self) -> dict | None:
        import json

        for name in ("preprocessor_config.json", "processor_config.json"):
            p = self.root / name
            if p.is_file():
                return json.loads(p.read_text())
        return None

    def prefill_images(self, tokens: list[int], images: list) -> mx.array:
        """A prompt whose `<|image_pad|>` placeholders take the given images: pads expanded to each image's
        token count, features substituted at their positions, 3-axis M-RoPE positions, then chunked prefill."""
        cfg = self.manifest.config
        pad, start = cfg["image_token_id"], cfg["vision_start_token_id"]
        merge = cfg["vision_config"]["spatial_merge_size"]
        feats = [self.encode_image(p) for p in images]
        grids = [g for _, g in feats]
        ids = expand_image_tokens(tokens, grids, pad, merge)
        if self.offset + len(ids) > self.opts.ctx:
            raise StreamoeError(f"prompt of {len(ids)} tokens with its images (+{self.offset} in context) is longer than "
                                f"the planned context --ctx {self.opts.ctx}")
        pos, nxt = image_positions(ids, grids, pad, start, merge)
        base = self.offset + self.rope_delta
        pos = mx.array(pos + base)[:, None, :]
        emb = self.model.embed(mx.array([ids]))
        where = mx.array(np.nonzero(np.array(ids) == pad)[0])
        emb[0, where] = mx.concatenate([f for f, _ in feats], axis=0).astype(emb.dtype)
        mx.eval(emb)
        logits = self._prefill_chunks(ids, pos, emb)
        self.rope_delta = base + nxt - self.offset
        return logits

    def close(self) -> None:
        for s in list(self.inflight):
            self._settle(s)
        self.store.close()
