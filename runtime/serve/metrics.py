"""`GET /metrics`: the server's counters and the last answer's telemetry in Prometheus' text exposition
format (version 0.0.4): one `# HELP` and one `# TYPE` line per metric, names prefixed `streamoe_`, counters
ending in `_total`. Read from the worker's own state; nothing here is computed twice."""

from __future__ import annotations

from collections.abc import Iterable

from ..plan import current_rss


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[dict, float]]) -> list[str]:
    """One metric's lines: HELP, TYPE, then a sample per label set."""
    lines = [f"# HELP streamoe_{name} {help_text}", f"# TYPE streamoe_{name} {kind}"]
    for labels, value in samples:
        tag = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        lines.append(f"streamoe_{name}{'{' + tag + '}' if tag else ''} {float(value)!r}")
    return lines


def exposition(worker, queued: int, requests: dict) -> str:
    """The whole page, from an `EngineWorker`, the queue's depth and the requests queued by API."""
    last = (worker.live.get("last") or {})
    tot, cap = worker.totals, worker.eng.plan.cap
    live_rss = worker.live.get("rss") if worker.live.get("state") != "idle" else None
    out: list[str] = []
    out += family("requests_total", "counter", "Requests queued for the engine, by API.",
                  [({"api": api}, n) for api, n in sorted(requests.items())] or [({"api": "chat"}, 0)])
    out += family("answers_total", "counter", "Answers the engine finished.", [({}, worker.served)])
    out += family("prompt_tokens_total", "counter", "Prompt tokens of the finished answers, cached ones included.",
                  [({}, tot["prompt_tokens"])])
    out += family("generated_tokens_total", "counter", "Tokens generated in the finished answers.",
                  [({}, tot["generated_tokens"])])
    out += family("expert_bytes_read_total", "counter", "Expert bytes read from the SSD by the finished answers.",
                  [({}, tot["bytes_read"])])
    if "rank_bytes_read" in tot:  # across ranks: each rank reads its own share of the experts
        out += family("rank_expert_bytes_read_total", "counter", "Expert bytes each rank read from its SSD in the "
                      "finished answers.", [({"rank": r}, n) for r, n in enumerate(tot["rank_bytes_read"])])
    out += family("last_tokens_per_second", "gauge", "Decode speed of the last answer (tokens per second).",
                  [({}, last.get("tok_s", 0.0))])
    out += family("last_hit_rate", "gauge", "Share of the last answer's expert picks already in memory (0-1).",
                  [({}, last.get("hit_rate", 0.0))])
    out += family("last_mib_read_per_token", "gauge", "MiB of experts read per token in the last answer.",
                  [({}, last.get("mib_read_token", 0.0))])
    out += family("memory_bytes", "gauge", "Resident memory of the server process now.",
                  [({}, live_rss if live_rss is not None else current_rss())])
    out += family("memory_cap_bytes", "gauge", "The memory cap the plan keeps the process under.", [({}, cap)])
    plan = worker.eng.plan
    if plan.split:  # a GPU with memory of its own: memory_bytes is the host's, --cap the device's
        out += family("device_memory_bytes", "gauge", "MLX's memory on the device now (under memory_cap_bytes).",
                      [({}, worker.eng.device_memory())])
        if plan.host_cap is not None:
            out += family("host_memory_cap_bytes", "gauge", "The host cap (--host-cap) the process is kept under.",
                          [({}, plan.host_cap)])
        out += family("host_tier_hits_total", "counter", "Expert picks copied from the host tier instead of read, "
                      "in the finished answers.", [({}, tot["host_hits"])])
    out += family("queue_depth", "gauge", "Requests waiting for the engine.", [({}, queued)])
    out += family("busy", "gauge", "1 while the engine answers a request, else 0.",
                  [({}, 0 if worker.live.get("state", "idle") == "idle" else 1)])
    return "\n".join(out) + "\n"
