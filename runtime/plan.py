"""MemoryPlan: every byte the process will make resident, sized at open for the context asked for.

The hot tier gets exactly what is left. If the fixed accounts do not fit, open fails before anything is
loaded and says the smallest cap that would. The plan is the contract the cgroup test holds us to.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from ..formats.config import ModelArgs, text_config
from ..formats.dtypes import itemsize
from ..formats.errors import StreamoeError, fail
from ..formats.layout import derived_formats, source_layout
from ..formats.manifest import Manifest, load_manifest
from ..formats.record import RecordLayout
from . import nvml
from .models.cache import KV_GROUP, quantized_kv_refusal
from .models.kernels import (
    BLAS_BLOCK,
    BLAS_TOKENS,
    dequantizes_one_group,
    grouped_batches,
    groups_by_expert,
    score_rows,
)

GiB = 1 << 30
MiB = 1 << 20
# Prefill's kernels run over PREFILL_STEP tokens at a time whatever the chunk (`--prefill-chunk auto`): the chunk
# decides how often a layer's experts are read, never the call shapes, so logits do not depend on the cap.
PREFILL_STEP = 256
# An auto chunk may take at most half of the hot tier the smallest chunk leaves: decode keeps half of its tier
# at worst, while each doubling of the chunk halves the expert reads of a long prompt.
HOT_FLOOR = 0.5


@dataclass
class Options:
    cap_gib: float = 4.0
    ctx: int = 4096
    experts: str | None = None  # expert format; None: the one the converted directory has (q4 beside q3)
    tier: str = "freq"
    prefetch_width: int | None = None  # cross-layer guesses per layer; None = top-k
    prefetch_waste: float = 0.05  # the share of the records read in decode that wrong guesses may be
    dtype: str | None = None  # float32 on CPU, bfloat16 on GPU
    kv: str = "auto"  # KV cache format: a float dtype, q8 or q4 (KV_BITS); auto = the activation dtype, as mlx-lm keeps it
    prefill_chunk: int | str = "auto"  # tokens per prefill chunk, or "auto": the largest the plan allows
    io_threads: int = 8  # reads in flight: a fast SSD reaches its random-read speed only with several
    cpu_streams: int | None = None  # CPU streams for expert and large matmul work; None = one per core (CPU backend)
    verify: bool = False
    runtime_bytes: int | None = None  # the interpreter/runtime allowance; None = measured at open
    driver_bytes: int | None = None  # a CUDA device's memory outside MLX's allocations; None = measured at open
    images: bool = False  # plan (and allow) image inputs: the vision account
    max_pixels: int = 640 * 640  # largest image after resizing
    max_decode_pixels: int = 1 << 24  # largest image file accepted (16 Mpx), decoded before resizing
    # accounts a caller adds to the plan before the hot tier is sized from it: (name, bytes, what it holds);
    # `serve` adds its prompt cache and the requests in flight
    extra_accounts: tuple[tuple[str, int, str], ...] = ()
    # the prompt `run` was given before it opens (-p, -f): what tokenizing it holds is an account
    prompt: str | None = None
    # expert parallelism (runtime/ranks.py): this process is rank `rank` of `ranks`, holding experts e % ranks == rank
    rank: int = 0
    ranks: int = 1
    # a discrete GPU's second memory (`split_memory`): the host's cap in GiB, which holds the runtime, the read
    # staging, the upload ring and the host tier of expert records; None: host memory is planned, not capped
    host_cap_gib: float | None = None
    # a discrete GPU whose --host-cap holds every expert: the pools in host memory, read by the device over the bus
    # (`MemoryPlan.host_reads`); None: STREAMOE_HOST_READS (on unless 0)
    host_reads: bool | None = None


def host_reads_wanted(opts: Options) -> bool:
    """Whether the plan may put every expert in host memory for the device to read over the bus (`host_reads`)."""
    if opts.host_reads is not None:
        return opts.host_reads
    return os.environ.get("STREAMOE_HOST_READS", "1") not in ("", "0")


def split_memory() -> bool:
    """Whether the compute device has a memory of its own (CUDA): then `--cap` bounds the device's memory and
    `--host-cap` the process's host memory. On unified memory (Metal, the CPU backend) one cap bounds both.
    `STREAMOE_SPLIT_MEMORY=1` plans the CPU backend as if it were split (the tests run the host tier that way)."""
    return own_device_memory() or os.environ.get("STREAMOE_SPLIT_MEMORY", "") not in ("", "0")


# Kernel modules and library workspaces a CUDA process loads after open: its device memory outside MLX's rose by
# 0.19-0.33 GiB after the context on the H200 (`--cap 4`, bench/results/host-tier-h200-code-6fde6fc.json: the
# driver's count at the end less MLX's peak and the 0.51 GiB counted at start).
DRIVER_GROWTH = 384 * MiB


@functools.cache
def driver_context() -> int | None:
    """This process's GPU memory outside MLX's allocations now, as the driver counts it: the device's count less
    its count when streamoe was imported (`nvml.AT_IMPORT`, before MLX's context) and less MLX's own (in use and
    cached). Measured once a process, so every plan it makes agrees; None without NVML or that first reading."""
    now = nvml.device_memory_used()
    if now is None or nvml.AT_IMPORT is None:
        return None
    return max(0, now - nvml.AT_IMPORT - mx.get_active_memory() - mx.get_cache_memory())


def driver_bytes(opts: Options) -> tuple[int, str | None]:
    """The plan's `driver` account on a CUDA device, and its note: the context measured at open and what loads
    later (DRIVER_GROWTH); the caller's own figure where given; 0 elsewhere (nothing outside MLX's allocations)."""
    if opts.driver_bytes is not None:
        return opts.driver_bytes, "as given"
    if not own_device_memory():
        return 0, None
    mx.eval(mx.zeros(1))  # the context and MLX's libraries exist before the reading
    context = driver_context()
    if context is None:
        return 0, "not measured (no NVML reading from before MLX's context: import streamoe first)"
    return context + DRIVER_GROWTH, (f"the CUDA context and libraries, {context / MiB:.0f} MiB measured at open, "
                                     f"+ {DRIVER_GROWTH // MiB} MiB for kernel modules loaded on first use")


def memories(host_cap_gib: float | None) -> tuple[bool, int | None]:
    """(whether the device has its own memory, the host cap in bytes): `--host-cap` is refused on unified memory."""
    split = split_memory()
    if host_cap_gib is not None and not split:
        raise StreamoeError("--host-cap: this device shares its memory with the host (unified memory: Metal, the CPU "
                            "backend), so --cap bounds all of it; --host-cap is for a GPU with memory of its own (CUDA)")
    return split, None if host_cap_gib is None else int(host_cap_gib * GiB)


def own_device_memory() -> bool:
    """A CUDA GPU: its memory is not the host's."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def expert_format(opts: Options, m: Manifest) -> str:
    """The expert format a run uses: the one asked for, else the one the converted directory has (q4 where it has q4
    and q3: the source's own codes)."""
    if opts.experts is not None:
        return opts.experts
    fmts = list(m.expert_formats())
    return "q4" if "q4" in fmts else fmts[0]


def read_ring(opts: Options, top_k: int, n_experts: int) -> int:
    """Records of host staging the reads land in: a layer's misses and guesses, plus one per I/O thread. On a
    discrete GPU the upload ring holds as many; the read staging holds a layer's experts more (`prefill_ahead`)."""
    return 2 * top_k + prefetch_width(opts, top_k, n_experts) + opts.io_threads


def prefill_ahead(split: bool, n_experts: int) -> int:
    """Read-staging records added for prefill's reads ahead. A long chunk picks nearly every expert of the next
    layer, and a read ahead holds its entry until its layer lands: with the ring alone, a layer's reads covered
    ~23 of 256 experts ahead (H200, 8K prompt: the disk busy 6 s of a 15 s prefill, reads and compute taking
    turns). On a discrete GPU the staging is host memory, outside the device's cap, so it holds one whole layer
    more and the next layer's reads run under this layer's compute. On unified memory it would take the hot
    tier's room: none added."""
    return n_experts if split else 0


def prefill_step(chunk: int | str) -> int:
    """Tokens per prefill kernel call: PREFILL_STEP under an auto chunk, else the chunk asked for (as before)."""
    return PREFILL_STEP if chunk == "auto" else int(chunk)


def share_of(rank: int, ranks: int, n_experts: int) -> list[int]:
    """The experts of every layer that rank `rank` of `ranks` holds: e % ranks == rank (`runtime/ranks.py` says why)."""
    return list(range(rank, n_experts, ranks))


def prefetch_width(opts: Options, top_k: int, n_experts: int) -> int:
    """Guesses a layer reads ahead for the next: --prefetch-width (default the model's top-k), at most every expert
    there is (a wider one would plan staging for guesses that cannot be made)."""
    return min(top_k if opts.prefetch_width is None else opts.prefetch_width, n_experts)


KV_BITS = {"q8": 8, "q4": 4}  # quantized KV formats: affine codes in groups of KV_GROUP (runtime/models/cache.py)


def kv_format(opts: Options) -> str:
    """The KV cache's format: `auto` stores keys and values in the activation dtype, so attention runs in one
    dtype (a float32 cache under bfloat16 activations would make every step upcast queries and keys)."""
    return (opts.dtype or default_dtype()) if opts.kv == "auto" else opts.kv


def kv_dtype(opts: Options) -> str:
    """The float dtype of the KV cache: its keys and values, or a quantized cache's scales and biases (the
    compute dtype, which `mx.quantized_matmul` takes with activations of that dtype)."""
    f = kv_format(opts)
    return (opts.dtype or default_dtype()) if f in KV_BITS else f


def kv_bits(opts: Options) -> int | None:
    """Bits per code of a quantized KV cache; None for a float one."""
    return KV_BITS.get(kv_format(opts))


def default_dtype() -> str:
    """float32 on the CPU backend (its bf16 kernels are 8x slower and accumulate in bf16), bf16 on GPUs."""
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def current_rss() -> int:
    """Resident set of this process now (anonymous + file-backed), in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # macOS reports bytes


def high_water_rss() -> int:
    """The most this process has held resident since it started (the kernel's high-water mark, VmHWM): a peak
    between two samples (an image decoded, a prompt tokenized) included."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def host_rss() -> int:
    """This process's host memory now: its resident set, less MLX's own arrays where those are the device's
    memory planned under --cap (the CPU backend planned as split, `STREAMOE_SPLIT_MEMORY`); on CUDA they are in
    the device's memory already."""
    return current_rss() - (0 if own_device_memory() else mx.get_active_memory())


# the host cap's room for the process's growth between two of the host tier's measurements: wider on CUDA, which
# compiles kernels in the process (NVRTC): on an H100, --cap 4 --host-cap 8 peaked 0.09 GiB over its cap with 64 MiB
# left, kernels compiled while the tier stood full (VmHWM; bench/results/host-tier-h100-code-a99542c.json)
HOST_GROWTH, CUDA_HOST_GROWTH = 64 << 20, 256 << 20


def host_growth() -> int:
    return CUDA_HOST_GROWTH if own_device_memory() else HOST_GROWTH


def host_memory() -> tuple[int, int | None]:
    """`host_rss()`, and the most it has been (VmHWM) where the two compare: with MLX's arrays in the device's own
    memory (CUDA), not where they are subtracted (the CPU backend planned as split)."""
    return host_rss(), high_water_rss() if own_device_memory() else None


def size(n: int) -> str:
    return f"{n / GiB:8.3f} GiB" if n >= 0.1 * GiB else f"{n / MiB:8.2f} MiB"


@dataclass
class MemoryPlan:
    cap: int
    ctx: int
    expert_format: str
    stride: int  # bytes of one expert record on disk
    n_experts: int
    n_layers: int = 1
    slot: int = 0  # bytes one slot of the pools holds (scales and biases at the compute dtype); 0 = stride
    prefill_chunk: int = 0  # tokens per prefill chunk: its layers' experts are read once for all of them
    prefill_step: int = 0  # tokens per prefill kernel call (the chunk runs in steps of this many, layer by layer)
    accounts: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    # per KV format: {"token_bytes": KV bytes a token adds, "longest_ctx": the longest context that fits this cap}
    kv_formats: dict[str, dict[str, int]] = field(default_factory=dict)
    native_ctx: int | None = None  # the model's own context length (max_position_embeddings), if known
    fitting_chunk: int | None = None  # where the fixed accounts miss the cap: a shorter prefill step that fits it
    rank: int = 0  # expert parallelism: this plan is rank `rank`'s of `ranks`, for its share of each layer's
    ranks: int = 1  # experts (n_experts of them: e % ranks == rank)
    all_experts: int = 0  # experts per layer in the model (0: n_experts, one host)
    # a discrete GPU (`split_memory`): the host's accounts (runtime, read staging, upload ring) beside the device's,
    # and the host tier of records (stride bytes each, as on disk) in what `host_cap` leaves; empty on unified memory
    split: bool = False
    host_cap: int | None = None
    host_accounts: dict[str, int] = field(default_factory=dict)
    ring: int = 0  # records of read staging a decode step needs (`read_ring`); the upload ring's rows on a GPU
    # a discrete GPU whose host cap holds every expert and whose device does not: the slot pools are host memory
    # (an account of the host's), every expert in them, and the device's kernels read the picks' weights there,
    # over the bus. Decode then needs no round trip a layer (the run is resident: nothing is read or copied after
    # open), at the cost of each pick's bytes crossing the bus; a prefill chunk of several blocks copies each layer's
    # experts into device memory once (`StreamingExperts.prepare`). The device's hot tier is empty. On the H200 at
    # `--cap 4 --host-cap 24`: 47.5 tok/s against 12.7 with the host tier copying misses into device slots
    # (bench/results/host-tier-h200-code-efce39e.json).
    host_reads: bool = False

    @property
    def fixed(self) -> int:
        return sum(self.accounts.values())

    @property
    def hot_bytes(self) -> int:
        return max(0, self.cap - self.fixed)

    @property
    def hot_slots(self) -> int:
        if self.host_reads:
            return 0
        return min(self.hot_bytes // self.slot_bytes, self.n_layers * self.n_experts)  # more would hold nothing

    @property
    def expert_slots(self) -> int:
        """Slots of the pools: the device's hot tier, or every expert where the pools are host memory (`host_reads`)."""
        return self.n_layers * self.n_experts if self.host_reads else self.hot_slots

    @property
    def slot_bytes(self) -> int:
        return self.slot or self.stride

    @property
    def staging_slots(self) -> int:
        return self.n_experts

    @property
    def read_staging(self) -> int:
        """Records of host memory the disk reads into: the ring, and on a discrete GPU a layer more (`prefill_ahead`)."""
        return self.ring + prefill_ahead(self.split, self.n_experts)

    @property
    def runtime_bytes(self) -> int:
        return self.host_accounts["runtime"] if self.split else self.accounts["runtime"]

    @property
    def host_fixed(self) -> int:
        return sum(self.host_accounts.values())

    @property
    def host_slots(self) -> int:
        """Records the host tier holds: what `host_cap` leaves beside the host accounts, none where the device
        holds every expert (nothing would be read) or no host cap is set."""
        if self.host_cap is None or self.host_reads or self.hot_slots >= self.n_layers * self.n_experts:
            return 0
        return min(max(0, self.host_cap - self.host_fixed) // self.stride, self.n_layers * self.n_experts)

    @property
    def host_fits(self) -> bool:
        return self.host_cap is None or self.host_cap >= self.host_fixed

    @property
    def fits(self) -> bool:
        return self.cap >= self.fixed and self.host_fits

    @property
    def min_cap(self) -> int:
        return self.fixed

    @property
    def cache_limit(self) -> int:
        """What MLX may keep of freed buffers: the allocator account plus the part of the cap nothing else is
        planned for. A capped plan fills the cap with slots, so this is the account (+ under one slot); a
        resident plan may have gigabytes unused, and a larger cache spares a decode step its frees and
        re-allocations (6 % of a resident H200 step: bench/gpu_parts.py `cache_unlimited`). Every buffer
        counted still lives inside the cap."""
        unused = max(0, self.cap - self.fixed - self.hot_slots * self.slot_bytes)
        return self.accounts["allocator cache"] + unused

    @property
    def past_native(self) -> str | None:
        """A note where the planned context runs past the model's own (llama.cpp warns the same): allowed, as a
        context the positions never reach costs nothing, but positions past it are ones the model never saw."""
        if self.native_ctx is None or self.ctx <= self.native_ctx:
            return None
        return (f"--ctx {self.ctx:,} is past the model's own context of {self.native_ctx:,} tokens: positions beyond it "
                "were never trained, and answers there may degrade")

    def render(self) -> str:
        rows = [f"memory plan: cap {self.cap / GiB:.2f} GiB, ctx {self.ctx}, experts {self.expert_format} "
                f"({self.stride:,} B per expert, {self.slot_bytes:,} B per slot)"]
        if self.past_native:
            rows.append(f"  (note: {self.past_native})")
        if self.ranks > 1:
            rows.append(f"  rank {self.rank} of {self.ranks}: experts e % {self.ranks} == {self.rank} of every layer "
                        f"({self.n_experts} of {self.all_experts}); --cap is this host's")
        for name, n in self.accounts.items():
            note = f"  ({self.notes[name]})" if name in self.notes else ""
            rows.append(f"  {name:<16} {size(n)}{note}")
        if self.host_reads:
            rows.append(f"  {'hot tier':<16} {size(0)}  (none: every expert is in host memory, read by the device over the bus)")
        else:
            rows.append(f"  {'hot tier':<16} {size(self.hot_slots * self.slot_bytes)}  ({self.hot_slots} expert slots of "
                        f"{self.n_layers * self.n_experts}; +{self.staging_slots} lent staging slots during decode)")
        rows.append(f"  {'prefill chunk':<16} {self.prefill_chunk:>8} tokens  (experts read once per chunk; "
                    f"kernels over {self.prefill_step} tokens at a time)")
        total = self.fixed + self.hot_slots * self.slot_bytes
        cap = f"{self.cap / GiB:.3f} GiB" if total >= 0.1 * GiB else f"{self.cap / MiB:.2f} MiB"  # the total's unit
        rows.append(f"  {'total':<16} {size(total)} of {cap}"
                    + (" of the device's memory" if self.split else ""))
        if self.kv_formats:
            native = f", the model's own {self.native_ctx:,}" if self.native_ctx else ""
            rows.append(f"  longest context at this cap, by --kv (the hot tier empty{native}):")
            rows += [f"    {fmt:<9} {k['token_bytes']:>9,} B/token  {k['longest_ctx']:>11,} tokens"
                     for fmt, k in self.kv_formats.items()]
        if self.split:
            capped = f"cap {self.host_cap / GiB:.2f} GiB" if self.host_cap is not None else "not capped (--host-cap)"
            rows.append(f"host memory: {capped}")
            for name, n in self.host_accounts.items():
                note = f"  ({self.notes[name]})" if name in self.notes else ""
                rows.append(f"  {name:<16} {size(n)}{note}")
            if not self.host_reads:
                rows.append(f"  {'host tier':<16} {size(self.host_slots * self.stride)}  ({self.host_slots} expert records "
                            f"of {self.n_layers * self.n_experts}, as on disk; a device miss found here is copied, not read)")
            total = self.host_fixed + self.host_slots * self.stride
            rows.append(f"  {'total':<16} {size(total)}" + (f" of {self.host_cap / GiB:.2f} GiB" if self.host_cap is not None else ""))
        return "\n".join(rows)

    def to_json(self) -> dict:
        out = {"cap": self.cap, "ctx": self.ctx, "expert_format": self.expert_format, "stride": self.stride, "slot": self.slot_bytes,
               "accounts": dict(self.accounts), "fixed": self.fixed, "hot_slots": self.hot_slots,
               "staging_slots": self.staging_slots, "n_layers": self.n_layers, "n_experts": self.n_experts, "fits": self.fits,
               "prefill_chunk": self.prefill_chunk, "prefill_step": self.prefill_step}
        if self.ranks > 1:
            out.update(rank=self.rank, ranks=self.ranks, all_experts=self.all_experts)
        if self.split:
            out["host"] = {"cap": self.host_cap, "accounts": dict(self.host_accounts), "fixed": self.host_fixed,
                           "tier_slots": self.host_slots, "fits": self.host_fits, "host_reads": self.host_reads}
        if self.kv_formats:  # planned with `plan_with_limits`
            out.update(kv_formats={f: dict(k) for f, k in self.kv_formats.items()}, native_ctx=self.native_ctx)
        return out

    def require_fit(self) -> None:
        """The fixed accounts fit the cap, and what the plan allocates fits the machine (see `require_machine`)."""
        require_machine(self)
        if not self.host_fits:
            big = max(self.host_accounts, key=self.host_accounts.get)
            raise StreamoeError(f"--host-cap {self.host_cap / GiB:.2f} GiB is too small: the host accounts need "
                                f"{self.host_fixed / GiB:.2f} GiB (largest: {big}, {self.host_accounts[big] / GiB:.2f} GiB); "
                                f"smallest that fits: --host-cap {(self.host_fixed + 0.01 * GiB) / GiB:.2f}")
        if self.cap < self.fixed:  # as many decimals as tell the cap from the need (0.26 GiB too small for 0.26 says nothing)
            d = next((d for d in range(2, 6) if f"{self.cap / GiB:.{d}f}" != f"{self.fixed / GiB:.{d}f}"), 6)
            shorter = (f", or --prefill-chunk {self.fitting_chunk} at this cap (a prefill step of fewer tokens: "
                       "slower prompts)" if self.fitting_chunk else "")
            raise StreamoeError(f"cap {self.cap / GiB:.{d}f} GiB is too small for this model at ctx {self.ctx}: "
                                f"the fixed accounts need {self.fixed / GiB:.{d}f} GiB; smallest cap that fits: "
                                f"--cap {(self.min_cap + 0.01 * GiB) / GiB:.2f}{shorter}")


def activation_bytes(a: ModelArgs, ctx: int, chunk: int, item: int, blas: bool = True, kv_bits: int | None = None,
                     grouped: bool = False, expert_mode: str = "affine") -> int:
    """Working memory of one prefill chunk (the decode step is a chunk of one): a conservative sum of the
    largest live temporaries — attention scores over the whole context dominate for long contexts. `blas`:
    the CPU backend's prefill through numpy's BLAS (`QLinear._blas`), which only the CPU backend takes.
    `kv_bits`: a quantized KV cache (see `attention_elements`). `grouped`: CUDA's prefill experts grouped by
    expert (`kernels._switch_glu_grouped`), where their codes (`expert_mode`) and the step's pairs take it."""
    H, nq, nkv, hd = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
    inter = max(a.moe_intermediate_size, a.shared_expert_intermediate_size)
    hidden = 8 * chunk * H
    attn = attention_elements(a, ctx, chunk, item, kv_bits)
    # the recurrence is evaluated every 8 tokens: up to 8 steps x ~6 state-sized temporaries alive at once
    gdn = 3 * chunk * (a.conv_dim + a.value_dim) + 48 * a.value_dim * a.linear_key_head_dim
    moe = 3 * chunk * a.num_experts_per_tok * H + 4 * chunk * inter
    logits = 2 * a.vocab_size
    # a chunk of BLAS_TOKENS+ tokens on the CPU: one dequantized block of rows, the input and output in float32
    # (a projection's, or the routed experts': each (token, pick) row's input and its gate and up outputs)
    widest_in = max(H, a.value_dim, nq * hd)
    widest_out = max(a.conv_dim + a.value_dim + 2 * a.linear_num_value_heads, 2 * nq * hd + 2 * nkv * hd,
                     a.num_experts + 2 * a.shared_expert_intermediate_size + 1)
    rows = max(widest_in + 2 * widest_out, a.num_experts_per_tok * (H + 2 * a.moe_intermediate_size))
    dequant = 4 * (BLAS_BLOCK * widest_in + chunk * rows) if blas and chunk >= BLAS_TOKENS else 0
    # CUDA's prefill step grouped by expert (`kernels._switch_glu_grouped`), the padding rows too: every batch row's
    # input and output alive with its gate and up outputs, 2 (H + I) a row (the path's peak on the CPU backend, 64
    # tokens of 64 experts of 2048 x 512, float32: 35.7 MB = these 31.5 + the [T, k, H] output counted in `moe`)
    pairs = chunk * a.num_experts_per_tok
    batch_rows = 0
    if grouped and groups_by_expert(pairs, a.num_experts, expert_mode):
        rows, batches = grouped_batches(pairs, a.num_experts)
        batch_rows = rows * batches * 2 * (H + a.moe_intermediate_size)
    return int(1.5 * (hidden + max(attn, gdn) + moe + batch_rows + logits) * item) + dequant


def attention_elements(a: ModelArgs, ctx: int, chunk: int, item: int, kv_bits: int | None = None) -> int:
    """Values of `item` bytes one chunk's attention holds at once, before `activation_bytes`' 1.5 margin: the
    chunk's q/k/v rows, and its scores against the whole context. MLX's attention
    (`mx.fast.scaled_dot_product_attention`, which on the CPU and in a CUDA prefill step multiplies, masks and
    takes the softmax as separate ops) holds one score array: the mask and the softmax write over it (measured
    with mx.get_peak_memory: 1.01-1.27 score arrays on the CPU at 2K-4K contexts; 8.3 KiB per context token on
    an H100 at a 256-token bf16 step, one array's 8), three where a sink logit joins each head's softmax
    (gpt-oss: the scores with the sinks' column joined, and their softmax; 3.02-3.04 measured). tests/test_plan.py
    holds both as upper bounds.
    A quantized KV cache's attention (`kernels.quantized_attention`) scores a block of `score_rows` query
    positions at a time, and its block's scores, their masked copy and their softmax exist at once (measured at
    1K-8K contexts: tests/test_kv_quant.py holds this as an upper bound). Where the keys' scoring multiplies
    dequantized keys (`kernels.dequantizes_one_group`: CUDA, a head no wider than a group, as gpt-oss's 64),
    every KV head's keys as float32 and a block's scores as float32 count too."""
    nq, nkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    rows = chunk if kv_bits is None else min(chunk, score_rows(nq, max(ctx, 1), item))
    scores = (3 if a.attention_sinks else 1) if kv_bits is None else 2
    n = chunk * (2 * nq * hd + 2 * nkv * hd) + scores * nq * rows * ctx
    if kv_bits is not None and dequantizes_one_group(hd, KV_GROUP):
        n += (nkv * ctx * hd + nq * rows * ctx) * 4 // item
    return n


def chunk_token_bytes(a: ModelArgs, item: int) -> int:
    """What each token of a prefill chunk keeps alive while its layers run block by block (beyond one step's
    working memory): its residual stream twice (a layer's input and output blocks) and its picks. A block's MoE
    input and routing are recomputed when its experts run (`kernels.run_layers`), not kept."""
    return int(1.5 * (2 * a.hidden_size * item + 4 * a.num_experts_per_tok))


def exchange_bytes(a: ModelArgs, tokens: int, item: int, ranks: int) -> int:
    """A MoE block's exchange across `ranks` (`runtime/ranks.py`): this rank's [tokens, k, H] outputs, the
    gathered [ranks, tokens, k, H], and the [tokens, k, H] selected from them, alive at once."""
    return (ranks + 2) * tokens * a.num_experts_per_tok * a.hidden_size * item


def state_bytes(a: ModelArgs, ctx: int, kv_item: int, kv_bits: int | None = None) -> tuple[int, int]:
    """(KV cache for ctx tokens, linear-attention state), both preallocated at open. `kv_item`: bytes per
    float of the cache (a quantized one's scales and biases); `kv_bits`: bits per code of a quantized cache,
    which keeps per head and position head_dim codes plus a scale and a bias per KV_GROUP of them."""
    n_full, hd = a.n_kv_layers, a.head_dim
    row = hd * kv_item if kv_bits is None else hd * kv_bits // 8 + 2 * (hd // KV_GROUP) * kv_item
    kv = n_full * 2 * a.num_key_value_heads * row * ctx
    rec = a.value_dim * a.linear_key_head_dim
    # a Gated DeltaNet window's K-1 rows are each a view of its token's whole input projection row (`GDNCache.rows`)
    window = (a.linear_conv_kernel_dim - 1) * (a.conv_dim + a.value_dim + 2 * a.linear_num_value_heads)
    lin = (a.num_hidden_layers - n_full) * (window + rec) * 4
    return kv, lin


def slot_bytes(lay: RecordLayout, dtype: str) -> int:
    """What one slot of the pools holds: the packed weights as stored, scales and biases at the compute dtype
    (kernels take them in the activations' dtype; kept as stored, every call would cast the whole pool)."""
    return sum(s.nbytes // itemsize(s.dtype) * itemsize(dtype) if s.is_float else s.nbytes for s in lay.segments)


def make_plan(*, args: ModelArgs, cap: int, ctx: int, expert_format: str, stride: int, nonexpert_resident: int,
              vision_bytes: int = 0, runtime_bytes: int | None = None, dtype: str = "float32", kv_dtype: str = "float32",
              prefill_chunk: int | str = "auto", ring: int = 0, slot: int = 0, blas: bool | None = None,
              grouped: bool | None = None, expert_mode: str = "affine",
              extra: tuple[tuple[str, int, str], ...] = (), rank: int = 0, ranks: int = 1,
              split: bool = False, host_cap: int | None = None, driver: tuple[int, str | None] = (0, None),
              host_reads: bool = False) -> MemoryPlan:
    """`kv_dtype`: the KV format (a float dtype, or q8/q4 with scales and biases in `dtype`). `blas`: whether
    prefill goes through numpy's BLAS (None: where this process computes, the CPU backend). `prefill_chunk`: tokens,
    or "auto" (`choose_chunk`). `extra`: the caller's own accounts (name, bytes, note), fixed like the others.
    `grouped`: whether prefill experts of `expert_mode` codes go grouped by expert where enough pairs an expert
    (None: where this process computes, CUDA). `rank` of `ranks`: the plan of one rank of an expert-parallel group, for its share of every layer's experts
    (`share_of`), plus the buffers the picks' outputs are gathered in. `split`: the device has its own memory
    (`split_memory`): `cap` is the device's, and the runtime, the read staging and the upload ring (host memory,
    mapped for the device) are host accounts, with the host tier in what `host_cap` leaves; `driver` (bytes, note)
    is the device's memory outside MLX's allocations (`driver_bytes`), a device account where it is not 0.
    `host_reads`: where the host cap holds every expert and the device does not, plan the pools in host memory
    (`MemoryPlan.host_reads`)."""
    bits = KV_BITS.get(kv_dtype)
    if bits and args.head_dim % KV_GROUP:
        raise StreamoeError(quantized_kv_refusal(args.head_dim))
    item, kv_item = itemsize(dtype), itemsize(dtype if bits else kv_dtype)
    blas = mx.default_device() == mx.cpu if blas is None else blas
    grouped = mx.default_device() == mx.gpu and mx.cuda.is_available() if grouped is None else grouped
    kv, lin = state_bytes(args, ctx, kv_item, bits)
    if ranks > args.num_experts:
        raise StreamoeError(f"{ranks} ranks for {args.num_experts} experts a layer: ranks {args.num_experts} and on "
                            f"would hold none; give at most {args.num_experts} ranks")
    n_exp = len(share_of(rank, ranks, args.num_experts))
    step = min(prefill_step(prefill_chunk), ctx)
    plan = MemoryPlan(cap=cap, ctx=ctx, expert_format=expert_format, stride=stride, n_experts=n_exp,
                      n_layers=args.num_hidden_layers, slot=slot, prefill_step=step,
                      prefill_chunk=step if prefill_chunk == "auto" else min(int(prefill_chunk), ctx),
                      rank=rank, ranks=ranks, all_experts=args.num_experts, ring=ring, split=split)
    if runtime_bytes is None:
        runtime_bytes = current_rss() + 64 * MiB
        plan.notes["runtime"] = "measured RSS at open + 64 MiB for allocator cache and Python heap"
    plan.accounts = {
        "non-expert": nonexpert_resident,
        "kv cache": kv,
        "linear state": lin,
        "activations": activation_bytes(args, ctx, step, item, blas, bits, grouped, expert_mode),
        "allocator cache": lin + 32 * MiB,
        "prefill staging": n_exp * plan.slot_bytes,
        "read staging": 2 * ring * stride,
        "vision": vision_bytes,
        **({"rank exchange": exchange_bytes(args, step, item, ranks)} if ranks > 1 else {}),
        **{name: n for name, n, _ in extra},
        "runtime": runtime_bytes,
    }
    if split:
        plan.host_cap = host_cap
        plan.accounts.pop("read staging")
        plan.host_accounts = {"runtime": plan.accounts.pop("runtime"),
                              "read staging": plan.read_staging * stride, "upload ring": ring * stride,
                              "growth": host_growth()}
        plan.notes["growth"] = ("what grows between two measurements of the host tier (kernels compiled in the process, "
                                "on CUDA); it widens to the largest transient seen")
        plan.accounts["upload ring"] = ring * stride  # an MLX allocation, so MLX counts it too, though it lives on the host
        plan.notes["upload ring"] = f"{ring} records the device copies from: host memory mapped for it"
        if driver[0]:
            plan.accounts["driver"], plan.notes["driver"] = driver[0], driver[1]
        every = plan.n_layers * n_exp
        if host_reads and host_cap is not None and plan.hot_slots < every:
            pools = every * plan.slot_bytes
            # the host holds them all, and the device a prefill chunk's layer twice (the hot tier would hold no more)
            if host_cap - plan.host_fixed >= pools and plan.cap - plan.fixed >= plan.accounts["prefill staging"]:
                plan.host_reads = True
                plan.host_accounts["expert pools"] = pools
                for accounts in (plan.accounts, plan.host_accounts):  # records are written straight into the pools
                    accounts.pop("upload ring")
                plan.notes["expert pools"] = (f"all {every} experts as computed, host memory the device reads over "
                                              "the bus (nothing read from disk after open)")
                # a prefill chunk's layer copied into device memory, and the one before it while its kernels finish
                plan.accounts["prefill staging"] *= 2
    plan.notes.update({name: note for name, _, note in extra})
    plan.notes["non-expert"] = f"weights as computed ({dtype} floats, packed codes)"
    plan.notes["kv cache"] = f"{ctx} tokens, {kv_dtype}" + (f" codes, {dtype} scales and biases per {KV_GROUP}" if bits else "")
    plan.notes["allocator cache"] = "freed buffers MLX keeps for reuse: a decode step's new linear state + 32 MiB"
    plan.notes["prefill staging"] = (f"{n_exp} slots, one per expert of a layer" if not plan.host_reads else
                                     f"2 x {n_exp} slots: a layer's experts copied from host memory for a prefill chunk, "
                                     "and the layer's before it")
    plan.notes["read staging"] = (f"{ring} records the disk reads into, + {n_exp}: a layer's experts read ahead in "
                                  f"prefill" if split else
                                  f"{ring} records of host staging + their copies in flight")
    if ranks > 1:
        plan.notes["rank exchange"] = (f"a block's picks' outputs, this rank's and all {ranks} gathered, "
                                       f"{step} tokens x top-{args.num_experts_per_tok}")
    if prefill_chunk == "auto":
        choose_chunk(plan, chunk_token_bytes(args, item))
    plan.notes["activations"] = (f"a prefill step of {step} tokens at ctx {ctx}"
                                 + (f", + {plan.prefill_chunk} tokens of chunk" if plan.prefill_chunk > step else ""))
    return plan


def plan_with_limits(native_ctx: int | None = None, **kw) -> MemoryPlan:
    """`make_plan(**kw)`, with every KV format's bytes per token and the longest context it fits at this cap
    (every account planned for that context, the runtime allowance as measured for this one): the compute
    dtype, the asked-for format if another float, q8 and q4. Searched up to the model's own context."""
    plan = make_plan(**kw)
    kw["runtime_bytes"] = plan.runtime_bytes
    if plan.cap < plan.fixed:  # the prefill step's activations may be what does not fit: the longest step that does
        plan.fitting_chunk = next((n for n in (128, 64, 32, 16) if n < plan.prefill_step and (
            (p := make_plan(**{**kw, "prefill_chunk": n})).cap >= p.fixed)), None)
    dtype = kw.get("dtype", "float32")
    asked = kw.get("kv_dtype", "float32")
    quantized = [] if kw["args"].head_dim % KV_GROUP else list(KV_BITS)  # none where the codes cannot group
    formats = dict.fromkeys([dtype, dtype if asked in KV_BITS else asked, *quantized])
    limit = native_ctx or 1 << 31
    for fmt in formats:
        def fits(n: int, fmt: str = fmt) -> bool:
            p = make_plan(**{**kw, "ctx": n, "kv_dtype": fmt})
            return p.cap >= p.fixed  # the context lives in the device's accounts

        lo, hi = 0, limit  # fits(lo) (0: nothing fits), not fits(hi + 1); accounts grow with the context
        if fits(hi):
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        bits = KV_BITS.get(fmt)
        plan.kv_formats[fmt] = {"token_bytes": state_bytes(kw["args"], 1, itemsize(dtype if bits else fmt), bits)[0],
                                "longest_ctx": lo}
    plan.native_ctx = native_ctx
    return plan


def native_context(config: dict) -> int | None:
    """The model's own context length, from its config (max_position_embeddings)."""
    n = text_config(config).get("max_position_embeddings")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def choose_chunk(plan: MemoryPlan, per_token: int) -> None:
    """The largest prefill chunk (whole steps, at most the context) whose tokens fit beside the fixed accounts
    while the hot tier keeps HOT_FLOOR of what it has at one step; one step where every expert is resident
    (nothing is read, so a longer chunk would buy nothing). The chunk's tokens join the activation account."""
    step, hot = plan.prefill_step, plan.hot_bytes
    if plan.hot_slots >= plan.n_layers * plan.n_experts:
        return
    steps = 1 + int((1 - HOT_FLOOR) * hot // max(1, per_token * step))
    plan.prefill_chunk = min(plan.ctx, steps * step)
    plan.accounts["activations"] += (plan.prefill_chunk - step) * per_token


def plan_for(root: Path, opts: Options, manifest: Manifest | None = None, text=None) -> MemoryPlan:
    """The plan for a converted directory (from its manifest). The runtime allowance is measured with the
    tokenizer loaded, as `Engine` does, so `streamoe plan` and `streamoe run` agree. `text`: the model's `TextIO`
    where the caller has it (made here where the allowance or `opts.prompt` needs it)."""
    from .image import read_preprocessor
    from .text import TextIO, prompt_account
    from .vision import resized_pixels, vision_account
    from .weights import resident_bytes

    m = manifest or load_manifest(root)
    split, host_cap = memories(opts.host_cap_gib)
    if text is None and (opts.runtime_bytes is None or opts.prompt):
        text = TextIO(Path(root), m.config)
    if opts.prompt:  # its bound parses the tokenizer's JSON: only where there is a prompt to bound
        account = prompt_account(opts.prompt, text.bound, opts.ctx)
        opts = replace(opts, extra_accounts=(*opts.extra_accounts, account))
    if opts.runtime_bytes is None and split:
        mx.eval(mx.zeros(1))  # the device's context and libraries are loaded before the runtime is measured
    fmts = m.expert_formats()
    experts = expert_format(opts, m)
    if experts not in fmts:
        made = derived_formats(source_layout(ModelArgs.from_config(m.config, m.root / "manifest.json")))
        hint = (f"convert with --experts {experts}" if experts in made else
                f"{experts} is not made from this model's experts, only {' or '.join(made)}")
        raise fail(root / "manifest.json", f"has no {experts} experts (has {', '.join(fmts)}); {hint}")
    dtype = opts.dtype or default_dtype()
    _, table = m.blob("nonexpert")
    vision = 0
    if opts.images:
        if m.blob("vision") is None:
            raise fail(m.root / "manifest.json", "the model has no vision tower (text-only export); images are not supported")
        pre = read_preprocessor(m.root)
        vision = vision_account(m.config, opts.max_pixels, opts.max_decode_pixels, pre)
    args = ModelArgs.from_config(m.config, m.root / "manifest.json")
    plan = plan_with_limits(native_context(m.config), args=args, cap=int(opts.cap_gib * GiB),
                     ctx=opts.ctx, expert_format=experts, stride=fmts[experts].layout.stride,
                     expert_mode=fmts[experts].layout.mode,
                     slot=slot_bytes(fmts[experts].layout, dtype),
                     nonexpert_resident=resident_bytes(((t.name, t.dtype, t.nbytes) for t in table), itemsize(dtype)),
                     dtype=dtype, kv_dtype=kv_format(opts), prefill_chunk=opts.prefill_chunk, runtime_bytes=opts.runtime_bytes,
                     vision_bytes=vision, ring=read_ring(opts, int(m.model["top_k"]), args.num_experts), extra=opts.extra_accounts,
                     rank=opts.rank, ranks=opts.ranks, split=split, host_cap=host_cap,
                     driver=driver_bytes(opts) if split else (0, None), host_reads=host_reads_wanted(opts))
    if opts.images:
        plan.notes["vision"] = (f"images up to {resized_pixels(m.config, opts.max_pixels, pre):,} px after resizing "
                                f"(the preprocessor's rule at --max-pixels {opts.max_pixels:,}), files up to "
                                f"{opts.max_decode_pixels / 1e6:.0f} Mpx; encoder weights streamed block by block")
    return plan


def machine_bytes() -> tuple[int, str]:
    """The most memory this process can have: physical memory, or less under an address-space limit."""
    import resource

    limits = []
    try:
        limits.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of physical memory"))
    except (ValueError, OSError, AttributeError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "of address space (ulimit -v)"))
    return min(limits) if limits else (1 << 62, "")


def require_machine(plan: MemoryPlan) -> None:
    """A plan that would allocate more than the machine has fails here, with one line, instead of crashing in
    the allocator (MLX segfaults on a KV cache larger than memory: `--cap 1e6 --ctx 100000000`)."""
    total = min(plan.fixed, plan.cap) + plan.hot_slots * plan.slot_bytes
    if plan.split:  # the host's own accounts; a CUDA device's are in its own memory
        total = (0 if own_device_memory() else total) + plan.host_fixed + plan.host_slots * plan.stride
    have, what = machine_bytes()
    if total > have:
        big = max(plan.accounts, key=plan.accounts.get)
        # fixed accounts beyond the cap fit at no cap this machine holds: only a shorter context helps
        beyond = not plan.split and plan.fixed > plan.cap
        need, advice = (plan.fixed, "lower --ctx") if beyond else (total, "lower --ctx or --cap")
        raise StreamoeError(f"the plan needs {need / GiB:.2f} GiB but this machine has {have / GiB:.2f} GiB {what} "
                            f"(largest account: {big}, {plan.accounts[big] / GiB:.2f} GiB at ctx {plan.ctx}); {advice}")
