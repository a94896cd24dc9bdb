"""The engine: opens a converted model inside a memory cap and runs it, streaming routed experts.

open (plan, non-expert weights, caches, the streaming-experts provider) / prefill (chunks through the
staging slots) / decode (one token) / generate / close. The layer loop is the model's own (`Model.layers_forward`
of the checkpoint's family, `runtime/models/`); where experts live, and how they get there, is
`runtime/experts.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from ..formats.checks import check_open
from ..formats.config import ModelArgs
from ..formats.errors import ContextFull, StreamoeError
from ..formats.manifest import load_manifest, safe_path
from . import ranks, session
from .constrain import Constraint
from .conversation import Conversation
from .copy_engine import open_copy_engine
from .experts import StreamingExperts
from .host_tier import HostTier
from .image import check_preprocessor
from .image_prompt import prefill_images
from .models import family
from .models.kernels import cpu_streams, expert_kernel
from .plan import (
    Options,
    current_rss,
    default_dtype,
    expert_format,
    high_water_rss,
    kv_bits,
    kv_dtype,
    plan_for,
    prefetch_width,
    share_of,
)
from .sampling import Sampler
from .store import ExpertStore
from .telemetry import LayerStats, StepStats, summarize
from .text import TextIO, too_long
from .weights import load_tensors, mx_dtype


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
    """open / prefill / decode / generate / close: a converted model inside its plan, experts streamed."""

    def __init__(self, root: str | Path, opts: Options | None = None, group: ranks.Group | None = None):
        """`group`: the ranks this engine is one of (`ranks.find_group`), each holding a share of the experts;
        None: this host holds them all."""
        self.root, self.opts, self.group = Path(root), opts or Options(), group
        if group is None:
            self._open()
            self.pipelined = self.experts.resident
            return
        self.opts = replace(self.opts, rank=group.rank(), ranks=group.size())
        self.watchdog = ranks.Watchdog(group)
        ranks.open_together(group, self._open, self.close)
        try:  # every rank computes the trunk: the same model, formats and context on each
            fp = session.fingerprint(self)
            ranks.same_work(group, {"the model": fp["model"], "--experts": fp["experts"], "--kv": fp["kv"],
                                    "--dtype": str(self.dtype).removeprefix("mlx.core."), "--ctx": self.opts.ctx,
                                    "images": self.opts.images, "--prefill-chunk": self.opts.prefill_chunk,
                                    "--max-pixels": self.opts.max_pixels if self.opts.images else None})
        except BaseException:
            self.close()
            raise
        self.pipelined = ranks.all_agree(group, self.experts.resident)  # every rank queues the same steps
        # every rank cuts a prompt into the same chunks (each chunk's layers exchange block by block): the
        # smallest any rank planned, whose activations fit every rank's account
        self.plan.prefill_chunk = ranks.smallest(group, self.plan.prefill_chunk)

    def _open(self) -> None:
        o = self.opts
        fix_malloc_thresholds()
        self.manifest = m = load_manifest(self.root)
        self.opts = o = replace(o, experts=expert_format(o, m))  # the format this run reads, named from here on
        check_open(self.root, o.experts, m, checksums=o.verify)  # as `validate` checks, before anything loads
        if o.images:
            check_preprocessor(self.root, m.config)  # read on the first image: a bad one must not fail mid-answer
        self.text = TextIO(self.root, m.config)
        self.plan = plan_for(self.root, o, m, self.text)
        self.plan.require_fit()
        mx.set_cache_limit(self.plan.cache_limit)  # a smaller cache frees and reallocates every step
        self.dtype = mx_dtype(o.dtype or default_dtype())
        on_cpu = mx.default_device() == mx.cpu
        self.args = a = ModelArgs.from_config(m.config, self.root / "manifest.json")
        model_family = family(a.model_type)
        k = a.num_experts_per_tok
        share = share_of(o.rank, o.ranks, a.num_experts) if self.group is not None else None
        n = a.num_experts if share is None else len(share)
        engine = open_copy_engine() if self.plan.split else None  # CUDA: records copied by the GPU's copy engine
        host = (HostTier(self.plan.host_slots, self.plan.stride, a.num_hidden_layers, n, o.tier, cap=self.plan.host_cap,
                         engine=engine) if self.plan.host_slots else None)
        store = ExpertStore.open(self.root, m, o.experts, o.io_threads, share=share, host=host,
                                 ring=self.plan.read_staging)
        if host is not None and self.plan.host_slots == a.num_hidden_layers * n:
            store.fill_host()  # the host holds every record: read them now, not a first token at the disk's speed
        self.lay = store.lay
        file, table = m.blob("nonexpert")
        streams = cpu_streams(o.cpu_streams if o.cpu_streams is not None else (min(4, os.cpu_count() or 1) if on_cpu else 1))
        weights = load_tensors(safe_path(self.root, file["path"]), table, self.dtype)
        self.model = model_family.Model(a, weights, self.dtype, streams=streams)
        n, guess = a.num_experts, self.model.router_logits
        if share is not None:  # this rank's experts are local experts 0..len(share)-1
            n, guess = len(share), ranks.local_router(guess, share)
        self.experts = StreamingExperts(store, self.lay, a.num_hidden_layers, n, min(k, n), self.plan.expert_slots,
                                        o.tier, prefetch_width(o, k, n), guess, self.dtype,
                                        waste_budget=o.prefetch_waste, streams=self.model.streams,
                                        kernel=expert_kernel(self.lay, a), uploads=self.plan.ring, engine=engine,
                                        host_pools=self.plan.host_reads)
        self.memory_limit = None  # MLX's limit before open, where open raised it
        if self.experts.pools.host_bytes:  # MLX counts the host's pools as its own: its limit is the device's + them
            self.memory_limit = mx.set_memory_limit(mx.get_memory_limit() + self.experts.pools.host_bytes)
        # what the model's MoE blocks call: across ranks, the exchange around this rank's share
        self.provider = (self.experts if share is None
                         else ranks.RankExperts(self.experts, self.group, a.num_experts, self.watchdog))
        self.conversation = self._new_conversation()
        self.steps: list[StepStats] = []
        # the last answer's final token where the context had no room to feed it: shown, not in the caches
        self.unfed: list[int] = []
        self.rss = self.peak_rss = current_rss()  # the last sample, and the peak of every sample
        # called with (model, hidden states [1, T, H], offset) by each prefill step while set: what reads every
        # position's prediction (a server's prompt logprobs, `serve.logprobs.PromptScores`), within the activations
        self.scorer: Callable[[object, mx.array, int], None] | None = None

    def device_memory(self) -> int:
        """MLX's memory in use now, less the pools where they are host memory (the plan's `host_reads`): on a GPU with
        memory of its own, the part of it under --cap."""
        return mx.get_active_memory() - self.experts.pools.host_bytes

    def summary(self, steps: list[StepStats]) -> dict:
        """`telemetry.summarize` of these steps against the plan: the process's peak against the cap, or, where the
        device has memory of its own, MLX's peak against --cap and the process's against --host-cap."""
        host_peak = max(self.peak_rss, high_water_rss())  # the samples at each step, and what fell between them
        if not self.plan.split:
            return summarize(steps, host_peak, self.plan.cap)
        device_peak = mx.get_peak_memory() - self.experts.pools.host_bytes  # pools in host memory: the host's
        return summarize(steps, device_peak, self.plan.cap, host=(host_peak, self.plan.host_cap))

    @property
    def offset(self) -> int:
        """Tokens in the conversation."""
        return self.conversation.offset

    def _new_conversation(self) -> Conversation:
        o = self.opts
        return Conversation(self.model.make_cache(o.ctx, mx_dtype(kv_dtype(o)), kv_bits=kv_bits(o)))

    # ---- one forward step over a chunk of tokens
    def forward(self, tokens: list[int], phase: str, positions: mx.array | None = None,
                embeddings: mx.array | None = None, on_layer: Callable[[int], None] | None = None) -> mx.array:
        """Logits of the last token after feeding `tokens` (a prefill chunk or one decoded token); `on_layer(i)`
        once a prefill's layer i is queued."""
        if self.offset + len(tokens) > self.opts.ctx:
            raise StreamoeError(f"prompt of {self.offset + len(tokens)} tokens is longer than the planned context "
                                f"--ctx {self.opts.ctx}")
        h = embeddings if embeddings is not None else self.model.embed(mx.array([tokens]))
        logits = self._step(h, phase, positions, on_layer)
        self._finish(logits)
        return logits

    def _step(self, h: mx.array, phase: str, positions: mx.array | None = None,
              on_layer: Callable[[int], None] | None = None) -> mx.array:
        """Queue one step over h [1, T, H]: the model's layer loop and head, lazily where every expert is
        resident (a capped run syncs once per layer for its picks). Advances the offset; returns logits [V]."""
        T = h.shape[1]
        step = StepStats(step=len(self.steps), phase=phase, n_tokens=T, rank=self.opts.rank,
                         layers=[LayerStats(layer=i) for i in range(self.args.num_hidden_layers)])
        step.t0 = time.perf_counter()
        step.busy0 = self.experts.store.busy_time()
        self.experts.stats = step.layers
        conv = self.conversation
        pos = positions if positions is not None else conv.offset + conv.rope_delta
        block = self.plan.prefill_step if phase == "prefill" else None  # prefill: layer by layer, in steps
        hs = self.model.layers_forward(h, conv.caches, pos, self.provider, block, on_layer)
        if self.scorer is not None and phase == "prefill":  # every position's prediction, not only the last
            self.scorer(self.model, hs, conv.offset)
        logits = self.model.head(hs[:, -1:, :])
        step.host_ms = 1000 * (time.perf_counter() - step.t0)
        conv.offset += T
        self.steps.append(step)
        return logits.reshape(-1)

    def _finish(self, logits: mx.array) -> None:
        step = self.steps[-1]
        tc = time.perf_counter()
        self.experts.fence(logits)  # the step's last kernels that read a slot are done: nothing of it is held
        step.layers[-1].compute_ms += 1000 * (time.perf_counter() - tc)
        step.ms = 1000 * (time.perf_counter() - step.t0)
        step.disk_busy_ms = 1000 * (self.experts.store.busy_time() - step.busy0)
        self.note_rss()

    def note_rss(self) -> None:
        """Sample the resident set (a /proc read: 0.01 ms on the H200 machine) and keep its peak."""
        self.rss = current_rss()
        self.peak_rss = max(self.peak_rss, self.rss)

    def prefill(self, tokens: list[int], progress: Callable[[int, int], None] | None = None) -> mx.array:
        """A prompt, in chunks, expert-major through the staging slots (taken back from the tier first).
        `progress(n, total)`: about n of the prompt's total tokens are through every layer, called as each chunk's
        layers are queued (a chunk's tokens go through its layers together, so n counts a chunk's tokens by its
        layers)."""
        if not tokens:
            raise StreamoeError("empty prompt")
        self.require_room(len(tokens))
        return self._prefill_chunks(tokens, progress=progress)

    def require_room(self, tokens: int) -> None:
        """A prompt of `tokens` fits beside what the context holds (its last may take the context's last place: the
        answer's first token is drawn from it, unfed), else it is refused."""
        if self.offset + tokens > self.opts.ctx:
            raise self.too_long(tokens)

    def too_long(self, tokens: int, at_least: bool = False, images: bool = False) -> ContextFull:
        """A prompt of `tokens` that the planned context cannot hold beside what it holds already (`text.too_long`)."""
        return too_long(tokens, self.opts.ctx, self.offset, at_least, images)

    def decode(self, token: int) -> mx.array:
        """Feed one generated token; returns the next logits."""
        return self.forward([token], "decode")

    def _prefill_chunks(self, ids: list[int], positions: mx.array | None = None, emb: mx.array | None = None,
                        progress: Callable[[int, int], None] | None = None) -> mx.array:
        """Take the staging slots back from the tier, run the prompt chunk by chunk, lend them again. A chunk is
        the plan's (`--prefill-chunk auto`: as many tokens as fit beside the fixed accounts): each of its layers
        reads its experts once, and its kernels run over `plan.prefill_step` tokens at a time, so the chunk
        changes what is read, never the logits."""
        self.experts.begin_prompt()
        c, n = self.plan.prefill_chunk, self.args.num_hidden_layers
        try:
            for a in range(0, len(ids), c):
                b = min(len(ids), a + c)
                on_layer = None if progress is None else (lambda i, a=a, b=b: progress(a + (b - a) * (i + 1) // n, len(ids)))
                logits = self.forward(ids[a:b], "prefill", positions=None if positions is None else positions[:, :, a:b],
                                      embeddings=None if emb is None else emb[:, a:b], on_layer=on_layer)
        finally:
            self.experts.end_prompt()
        return logits

    def generate(self, prompt: list[int], max_tokens: int, sampler: Sampler, images: list | None = None,
                 context: list[int] | None = None, constraint: Constraint | None = None,
                 progress: Callable[[int, int], None] | None = None, stops: Collection[int] | None = None):
        """Yield generated token ids (stop token excluded) with their float32 logits (lazy mx arrays [V]).

        One loop for every sampler and cap. The token is chosen on the device (`runtime/sampling.py`), so
        where every expert is resident the next step's graph is built from the token still being computed
        and queued before that token is read, as stock mlx-lm does, and the host never waits with the device
        idle; at a cap each layer syncs for its picks anyway, so the token is read first (one int) and no
        step is computed for a token that ends the answer. A step queued for a token that turns out to be a
        stop token (or that the caller never takes) is taken back (KV offsets rewound, Gated DeltaNet states
        restored, the sampler's draws and penalties too), so the state after an answer, and the tokens drawn,
        are exactly those of a run at any other cap. `context` is the whole prompt the repetition penalty
        counts (default `prompt`: a continued conversation passes what the cache holds too). Under a
        `constraint` the next token's mask needs this one, so a resident step is still queued ahead but its
        token is drawn once this one is read and fed to the grammar (the device computes the step meanwhile);
        while the grammar is off (a lazy one between calls, or the reasoning before a JSON answer) the token is
        drawn ahead unmasked as without one, and drawn again, masked and with the same key, where this token
        switches the grammar on. Across ranks a constrained token is always drawn once the previous one is read.
        `progress`: the prompt's prefill as it goes (`prefill`; with images, over the prompt they expand).
        `stops`: the tokens that end the answer (default the model's end-of-turn tokens; none: vLLM's
        `ignore_eos`, an end of turn yielded as any token and the answer run to `max_tokens`).

        Timing (`StepStats.t_token`, `ms`): a step that gives a token is stamped when the token reaches the
        caller, and a decode step's `ms` is the interval since the previous token did, so the summary's
        tok/s is the rate the caller sees, whatever was overlapped."""
        t_start = time.perf_counter()
        stops = self.text.stop_ids if stops is None else stops
        logits = prefill_images(self, prompt, images, progress) if images else self.prefill(prompt, progress)
        self.unfed = []  # a prompt refused before this (a full context) leaves the last answer's as it was
        pen = sampler.start(prompt if context is None else context, logits.shape[0])
        drawn = sampler.drawn

        def draw(lg, pen, n):
            y, pen = sampler(lg, pen, n, None if constraint is None else constraint.allowed())
            return (y if self.group is None else ranks.shared_token(y, self.group)), pen

        y, pen = draw(logits, pen, drawn)
        mx.async_eval(y)
        made_by, last = self.steps[-1], t_start  # the step computing y; when the previous token was handed over
        ahead = None  # (snapshot, logits, token, penalties, step) queued before its token is known
        try:
            for _ in range(max_tokens):
                if self.pipelined and self.offset < self.opts.ctx:  # the loop feeds every token it yields
                    snap = self._snapshot()
                    nxt = self._step(self.model.embed(y.reshape(1, 1)), "decode")
                    held = constraint is not None and (self.group is not None or constraint.active)
                    y_next, pen_next = (None, None) if held else draw(nxt, pen, drawn + 1)
                    tq = time.perf_counter()
                    mx.async_eval(nxt if y_next is None else y_next)
                    if self.experts.backend == "cpu" and made_by.phase == "decode":  # the CPU computes it in the call
                        made_by.layers[-1].compute_ms += 1000 * (time.perf_counter() - tq)
                    ahead = (snap, nxt, y_next, pen_next, self.steps[-1])
                tw = time.perf_counter()
                tok = int(y.item())  # waits for this token only; a resident run's next step is already queued
                now = time.perf_counter()
                drawn += 1
                if made_by.phase == "decode":
                    if made_by.ms == 0.0:  # a step queued ahead: the device's time the host did not hide
                        made_by.layers[-1].compute_ms += 1000 * (now - tw)
                    made_by.ms = 1000 * (now - last)
                made_by.token_id = tok
                self.note_rss()
                if tok in stops:
                    return
                made_by.t_token, last = now - t_start, now
                if constraint is not None:
                    constraint.advance(tok)
                yield tok, logits.astype(mx.float32)
                if ahead is not None:
                    _, logits, y, pen_ahead, made_by = ahead
                    ahead = None
                    if y is None or (constraint is not None and constraint.active):  # tok switched its grammar on
                        y, pen = draw(logits, pen, drawn)
                        mx.async_eval(y)
                    else:
                        pen = pen_ahead
                elif self.offset < self.opts.ctx:
                    logits = self.decode(tok)
                    y, pen = draw(logits, pen, drawn)
                    made_by = self.steps[-1]
                else:
                    self.unfed = [tok]
                    return
            mx.eval(logits)  # the last token's step, kept: the cache holds the whole answer
            if made_by.ms == 0.0:
                made_by.ms = 1000 * (time.perf_counter() - made_by.t0)
        finally:
            if ahead is not None:
                self._restore(ahead[0])
            sampler.drawn = drawn
            self.note_rss()

    def _snapshot(self) -> tuple:
        return self.conversation.mark(), len(self.steps)

    def _restore(self, snap: tuple) -> None:
        mark, n_steps = snap
        del self.steps[n_steps:]
        self.conversation.rewind(mark)

    def reset(self) -> None:
        """An empty conversation, in the same caches: new ones would be allocated beside the old before those are
        let go, a second KV cache (1.3 GiB at 131K positions in q8) the plan does not hold."""
        self.conversation.clear()
        self.unfed = []

    def prefill_embedded(self, ids: list[int], positions: mx.array, emb: mx.array, rope_next: int,
                         progress: Callable[[int, int], None] | None = None) -> mx.array:
        """A prompt given as embeddings [1, L, H] with its 3-axis positions [3, 1, L] (what `image_prompt` makes of
        a prompt with images); `rope_next`: the position the next token takes, kept as the conversation's
        M-RoPE delta; `progress` as `prefill`'s."""
        logits = self._prefill_chunks(ids, positions, emb, progress)
        self.conversation.rope_delta = rope_next - self.offset
        return logits

    def close(self) -> None:
        if getattr(self, "experts", None) is not None:
            self.experts.close()
        if getattr(self, "memory_limit", None) is not None:
            mx.set_memory_limit(self.memory_limit)
            self.memory_limit = None
        if self.group is not None:
            self.watchdog.close()
