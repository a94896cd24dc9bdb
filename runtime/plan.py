"""MemoryPlan: every byte the process will make resident, sized at open for the context asked for.

The hot tier gets exactly what is left. If the fixed accounts do not fit, open fails before anything is
loaded and says the smallest cap that would. The plan is the contract the cgroup test holds us to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..formats.errors import StreamoeError

GiB = 1 << 30
MiB = 1 << 20
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def current_rss() -> int:
    """Resident set of this process now (anonymous + file-backed), in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # macOS reports bytes


def size(n: int) -> str:
    return f"{n / GiB:8.3f} GiB" if n >= 0.1 * GiB else f"{n / MiB:8.2f} MiB"


@dataclass
class MemoryPlan:
    cap: int
    ctx: int
    expert_format: str
    stride: int
    n_experts: int
    n_layers: int = 1
    accounts: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def fixed(self) -> int:
        return sum(self.accounts.values())

    @property
    def hot_bytes(self) -> int:
        return max(0, self.cap - self.fixed)

    @property
    def hot_slots(self) -> int:
        return min(self.hot_bytes // self.stride, self.n_layers * self.n_experts)  # more would hold nothing

    @property
    def staging_slots(self) -> int:
        return self.n_experts

    @property
    def fits(self) -> bool:
        return self.cap >= self.fixed

    @property
    def min_cap(self) -> int:
        return self.fixed

    def render(self) -> str:
        rows = [f"memory plan: cap {self.cap / GiB:.2f} GiB, ctx {self.ctx}, experts {self.expert_format} "
                f"({self.stride:,} B per expert)"]
        for name, n in self.accounts.items():
            note = f"  ({self.notes[name]})" if name in self.notes else ""
            rows.append(f"  {name:<16} {size(n)}{note}")
        rows.append(f"  {'hot tier':<16} {size(self.hot_slots * self.stride)}  ({self.hot_slots} expert slots of "
                    f"{self.n_layers * self.n_experts}; +{self.staging_slots} lent staging slots during decode)")
        rows.append(f"  {'total':<16} {size(self.fixed + self.hot_slots * self.stride)} of {self.cap / GiB:.2f} GiB")
        return "\n".join(rows)

    def to_json(self) -> dict:
        return {"cap": self.cap, "ctx": self.ctx, "expert_format": self.expert_format, "stride": self.stride,
                "accounts": dict(self.accounts), "fixed": self.fixed, "hot_slots": self.hot_slots,
                "staging_slots": self.staging_slots, "n_layers": self.n_layers, "n_experts": self.n_experts, "fits": self.fits}

    def require_fit(self) -> None:
        """The fixed accounts fit the cap, and what the plan allocates fits the machine (see `require_machine`)."""
        require_machine(self)
        if not self.fits:
            raise StreamoeError(f"cap {self.cap / GiB:.2f} GiB is too small for this model at ctx {self.ctx}: "
                                f"the fixed accounts need {self.fixed / GiB:.2f} GiB; smallest cap that fits: "
                                f"--cap {(self.min_cap + 0.01 * GiB) / GiB:.2f}")


def activation_bytes(tc: dict, ctx: int, chunk: int, item: int) -> int:
    """Working memory of one prefill chunk (the decode step is a chunk of one): a conservative sum of the
    largest live temporaries — attention scores over the whole context dominate for long contexts."""
    H, E_k = tc["hidden_size"], tc["num_experts_per_tok"]
    nq, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc.get("head_dim", H // tc["num_attention_heads"])
    conv = 2 * tc["linear_num_key_heads"] * tc["linear_key_head_dim"] + tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    vdim = tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    inter = max(tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"])
    hidden = 8 * chunk * H
    attn = chunk * (2 * nq * hd + 2 * nkv * hd) + 2 * nq * chunk * ctx
    # the recurrence is evaluated every 8 tokens: up to 8 steps x ~6 state-sized temporaries alive at once
    gdn = 3 * chunk * (conv + vdim) + 48 * tc["linear_num_value_heads"] * tc["linear_value_head_dim"] * tc["linear_key_head_dim"]
    moe = 3 * chunk * E_k * H + 4 * chunk * inter
    logits = 2 * tc["vocab_size"]
    return int(1.5 * (hidden + max(attn, gdn) + moe + logits) * item)


def state_bytes(tc: dict, ctx: int, kv_item: int) -> tuple[int, int]:
    """(KV cache for ctx tokens, linear-attention state), both preallocated at open."""
    n = tc["num_hidden_layers"]
    interval = tc.get("full_attention_interval", 4)
    n_full = sum(1 for i in range(n) if (i + 1) % interval == 0)
    hd = tc.get("head_dim", tc["hidden_size"] // tc["num_attention_heads"])
    kv = n_full * 2 * tc["num_key_value_heads"] * hd * ctx * kv_item
    conv = 2 * tc["linear_num_key_heads"] * tc["linear_key_head_dim"] + tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    rec = tc["linear_num_value_heads"] * tc["linear_value_head_dim"] * tc["linear_key_head_dim"]
    lin = (n - n_full) * ((tc.get("linear_conv_kernel_dim", 4) - 1) * conv + rec) * 4
    return kv, lin


def make_plan(*, tc: dict, cap: int, ctx: int, expert_format: str, stride: int, nonexpert_resident: int,
              vision_bytes: int = 0, runtime_bytes: int | None = None, dtype: str = "float32", kv_dtype: str = "float32",
              prefill_chunk: int = 256) -> MemoryPlan:
    item, kv_item = ITEMSIZE[dtype], ITEMSIZE[kv_dtype]
    kv, lin = state_bytes(tc, ctx, kv_item)
    n_exp = tc["num_experts"]
    plan = MemoryPlan(cap=cap, ctx=ctx, expert_format=expert_format, stride=stride, n_experts=n_exp,
                      n_layers=tc["num_hidden_layers"])
    if runtime_bytes is None:
        runtime_bytes = current_rss() + 64 * MiB
        plan.notes["runtime"] = "measured RSS at open + 64 MiB for allocator cache and Python heap"
    plan.accounts = {
        "non-expert": nonexpert_resident,
        "kv cache": kv,
        "linear state": lin,
        "activations": activation_bytes(tc, ctx, min(prefill_chunk, ctx), item),
        "prefill staging": n_exp * stride,
        "vision": vision_bytes,
        "runtime": runtime_bytes,
    }
    plan.notes["non-expert"] = f"weights as computed ({dtype} floats, packed codes)"
    plan.notes["kv cache"] = f"{ctx} tokens, {kv_dtype}"
    plan.notes["prefill staging"] = f"{n_exp} slots, one per expert of a layer"
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
    total = min(plan.fixed, plan.cap) + plan.hot_slots * plan.stride
    have, what = machine_bytes()
    if total > have:
        big = max(plan.accounts, key=plan.accounts.get)
        raise StreamoeError(f"the plan needs {total / GiB:.2f} GiB but this machine has {have / GiB:.2f} GiB {what} "
                            f"(largest account: {big}, {plan.accounts[big] / GiB:.2f} GiB at ctx {plan.ctx}); "
                            "lower --ctx or --cap")
