"""Telemetry: one JSON line per forward step (a prefill chunk or a decoded token), with per-layer
counters, in the shape schemas/telemetry.schema.json states (the tests check it, not each run); and the one-line
summary after each answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MiB = 1 << 20


@dataclass
class LayerStats:
    layer: int
    picks: int = 0
    hits_hot: int = 0  # resident in a tier slot of its own
    hits_lent: int = 0  # resident in a staging slot lent to the tier
    hits_prefetch: int = 0  # read ahead by the cross-layer guess
    hits_host: int = 0  # not in the device's memory, copied from the host tier (a discrete GPU's): no disk read
    misses: int = 0  # read from disk
    prefetch_issued: int = 0
    prefetch_wasted: int = 0  # issued for this layer, not picked
    bytes_read: int = 0
    bytes_host: int = 0  # copied from the host tier into device slots
    io_wait_ms: float = 0.0
    compute_ms: float = 0.0
    landing_ms: float = 0.0  # landing records in their slots beyond the disk wait (copies, the ring's sync, scatters)
    copy_wait_ms: float = 0.0  # of which: waiting for the copy threads (the upload ring)
    sync_ms: float = 0.0  # of which: waiting for MLX to let go of the pools before the ring's scatters
    ran_ahead: int = 0  # times run ahead of its picks on the hot tier's slots (`StreamingExperts.layers_ahead`)
    thrown: int = 0  # of those, thrown away and run again: it or a layer before it in the run missed a pick
    experts: list[int] = field(default_factory=list)  # distinct experts picked: the routing trace


@dataclass
class StepStats:
    step: int
    phase: str  # prefill | decode
    n_tokens: int
    token_id: int | None = None
    ms: float = 0.0  # a step that gave a token: since the previous token reached the caller; else the step's own time
    t_token: float | None = None  # seconds from the start of the answer to when this step's token reached the caller
    host_ms: float = 0.0  # the host's time in the step's layer loop: the graph built (and, capped, every layer's sync)
    disk_busy_ms: float = 0.0  # the time in this step with at least one expert read in progress
    layers: list[LayerStats] = field(default_factory=list)
    rank: int = 0  # across ranks (runtime/ranks.py): the rank whose share these layers' reads are

    @property
    def bytes_read(self) -> int:
        """Expert bytes the step read (its layers' reads and the guesses they issued)."""
        return sum(ly.bytes_read for ly in self.layers)

    def to_json(self) -> dict:
        return {**asdict(self), "bytes_read": self.bytes_read}


def summarize(steps: list[StepStats], peak_bytes: int, cap: int, host: tuple[int, int | None] | None = None) -> dict:
    """One answer's figures. tok/s is the rate tokens reached the caller (the decode steps that gave one, each
    timed from the previous token to its own); hit rate and bytes read count every decode step's work. `host`:
    (the host's peak, its cap or None) where the device has memory of its own, whose peak `peak_bytes` is."""
    work = [s for s in steps if s.phase == "decode"]
    timed = [s for s in work if s.t_token is not None]
    pre = [s for s in steps if s.phase == "prefill"]
    first = next((s.t_token for s in pre if s.t_token is not None), None)
    n = max(1, len(timed))
    tot_ms = sum(s.ms for s in timed)
    io = sum(ly.io_wait_ms for s in timed for ly in s.layers)
    comp = sum(ly.compute_ms for s in timed for ly in s.layers)
    picks = sum(ly.picks for s in work for ly in s.layers)
    hits = sum(ly.hits_hot + ly.hits_lent for s in work for ly in s.layers)  # already in memory when picked
    ahead = sum(ly.hits_prefetch for s in work for ly in s.layers)  # read for this step by a guess: not a hit
    read = sum(ly.bytes_read for s in work for ly in s.layers)
    from_host = sum(ly.hits_host for s in work for ly in s.layers)
    busy, work_ms = sum(s.disk_busy_ms for s in work), sum(s.ms for s in work)
    pre_tokens, pre_ms = sum(s.n_tokens for s in pre), sum(s.ms for s in pre)
    layer_steps = max(1, sum(len(s.layers) for s in work))  # the layers decode ran, once each a token
    return {
        "tokens": len(timed) + (first is not None), "tok_s": len(timed) / (tot_ms / 1000) if tot_ms else 0.0,
        "ms_token": tot_ms / n, "compute_ms": comp / n, "io_wait_ms": io / n, "other_ms": (tot_ms - comp - io) / n,
        **{f"{k}_ms": sum(getattr(ly, f"{k}_ms") for s in timed for ly in s.layers) / n  # parts of "other"
           for k in ("landing", "copy_wait", "sync")},
        "hit_rate": hits / picks if picks else (1.0 if work and not read else 0.0),
        "read_ahead_rate": ahead / picks if picks else 0.0, "mib_read_token": read / MiB / max(1, len(work)),
        "host_hit_rate": from_host / picks if picks else 0.0,
        # decode layers run ahead of their picks, and thrown away and run again, per layer a token needs
        "ran_ahead": sum(ly.ran_ahead for s in work for ly in s.layers) / layer_steps,
        "thrown": sum(ly.thrown for s in work for ly in s.layers) / layer_steps,
        "mib_host_token": sum(ly.bytes_host for s in work for ly in s.layers) / MiB / max(1, len(work)),
        "disk_busy": busy / work_ms if work_ms else 0.0,  # near 1: the disk is what bounds decode
        "peak_gib": peak_bytes / (1 << 30), "cap_gib": cap / (1 << 30),
        "prefill_tokens": pre_tokens, "prefill_ms": pre_ms,
        "prefill_tok_s": pre_tokens / (pre_ms / 1000) if pre_ms else 0.0, "ttft_s": first or 0.0,
        "prefill_mib_token": prefill_mib_token(steps),
        **({"host_peak_gib": host[0] / (1 << 30), "host_cap_gib": host[1] and host[1] / (1 << 30)} if host else {}),
    }


def prefill_mib_token(steps: list[StepStats]) -> float:
    """Expert MiB read per prompt token: about one read of each needed expert per chunk, over the chunk's tokens."""
    pre = [s for s in steps if s.phase == "prefill"]
    n = sum(s.n_tokens for s in pre)
    return sum(s.bytes_read for s in pre) / MiB / n if n else 0.0


def summary_line(s: dict) -> str:
    rate = (f"{s['tokens']} tokens, {s['tok_s']:.2f} tok/s, {s['ms_token']:.1f} ms/token = compute {s['compute_ms']:.1f} + "
            f"I/O wait {s['io_wait_ms']:.1f} + other {s['other_ms']:.1f}" if s["tokens"] > 1 else
            f"{s['tokens']} token{'' if s['tokens'] == 1 else 's'} (a rate needs two)")  # tok/s: the gaps between tokens
    return (f"[{rate}; hit rate {100 * s['hit_rate']:.1f}% "
            f"(+{100 * s['read_ahead_rate']:.1f}% read ahead"
            + (f", +{100 * s['host_hit_rate']:.1f}% from the host tier, {s['mib_host_token']:.2f} MiB/token"
               if s.get("mib_host_token") else "") + "), "
            f"{s['mib_read_token']:.2f} MiB read/token" + (f", disk busy {100 * s['disk_busy']:.0f}%" if s["mib_read_token"] else "")
            + (f", layers run ahead {100 * s['ran_ahead']:.0f}% ({100 * s['thrown']:.0f}% thrown)" if s.get("ran_ahead") else "")
            + f"; peak {s['peak_gib']:.2f} of {s['cap_gib']:.2f} GiB"
            + (f" on the device, host {s['host_peak_gib']:.2f}" + (f" of {s['host_cap_gib']:.2f} GiB" if s["host_cap_gib"] else " GiB")
               if "host_peak_gib" in s else "") + "; "
            f"prefill {s['prefill_tokens']} tokens in {s['prefill_ms'] / 1000:.2f} s ({s['prefill_tok_s']:.1f} tok/s"
            + (f", {s['prefill_mib_token']:.3f} MiB read/token" if s.get("prefill_mib_token") else "")
            + f"), first token {s['ttft_s']:.2f} s]")
