"""`GET /metrics`: the server's counters, its requests' latencies as histograms and the last answer's telemetry in
Prometheus' text exposition format (version 0.0.4): one `# HELP` and one `# TYPE` line per metric, names prefixed
`streamoe_`, counters ending in `_total`; and the same figures under vLLM's names (`vllm:`, labelled with the
model's name), so dashboards and autoscalers made for vLLM read this server. Read from the worker's own state;
nothing here is computed twice."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from ..plan import current_rss


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: dict, value: float) -> str:
    tag = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return f"{name}{'{' + tag + '}' if tag else ''} {float(value)!r}"


def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[dict, float]],
           prefix: str = "streamoe_") -> list[str]:
    """One metric's lines: HELP, TYPE, then a sample per label set."""
    return ([f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}"]
            + [_sample(prefix + name, labels, value) for labels, value in samples])


# bucket bounds in seconds, vLLM's for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Observations counted into fixed buckets (a value in the first bucket whose bound it does not pass; past the
    last, only in `+Inf`), as Prometheus exposes them: cumulative."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * (len(bounds) + 1), 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, help_text: str, labels: dict | None = None) -> list[str]:
        """HELP, TYPE, each bucket's cumulative count, the sum and the count."""
        labels, out, seen = labels or {}, [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"], 0
        for bound, n in zip([*map(repr, map(float, self.bounds)), "+Inf"], self.counts, strict=True):
            seen += n
            out.append(_sample(f"{name}_bucket", {**labels, "le": bound}, seen))
        return out + [_sample(f"{name}_sum", labels, self.sum), _sample(f"{name}_count", labels, self.count)]


LATENCIES = {  # the worker's histograms: name -> (help, buckets)
    "time_to_first_token_seconds": ("Seconds from a request's arrival to its first token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Seconds between two tokens of an answer.", TOKEN_BUCKETS),
    "request_time_per_output_token_seconds": ("Seconds between an answer's tokens after its first, averaged per "
                                              "answer.", TOKEN_BUCKETS),
    "e2e_request_latency_seconds": ("Seconds from a request's arrival to its end.", REQUEST_BUCKETS),
    "request_queue_time_seconds": ("Seconds a request waited for the engine.", REQUEST_BUCKETS),
}


def exposition(worker, queued: int, requests: dict, store=None) -> str:
    """The whole page, from an `EngineWorker`, the queue's depth, the requests queued by API and the Responses API's
    `ResponseStore` (None: stateless)."""
    last = (worker.live.get("last") or {})
    tot, cap = worker.totals, worker.eng.plan.cap
    live_rss = worker.live.get("rss") if worker.live.get("state") != "idle" else None
    out: list[str] = []
    out += family("requests_total", "counter", "Requests queued for the engine, by API.",
                  [({"api": api}, n) for api, n in sorted(requests.items())] or [({"api": "chat"}, 0)])
    out += family("answers_total", "counter", "Answers the engine finished.", [({}, worker.served)])
    out += family("prompt_tokens_total", "counter", "Prompt tokens of the finished answers, cached ones included.",
                  [({}, tot["prompt_tokens"])])
    out += family("cached_prompt_tokens_total", "counter", "Prompt tokens of the finished answers restored from the "
                  "prompt cache, not prefilled.", [({}, tot["cached_tokens"])])
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
    if store is not None:
        out += family("response_store_bytes", "gauge", "What the stored responses hold (within --response-store-mib).",
                      [({}, store.used)])
        out += family("response_store_responses", "gauge", "Responses stored.", [({}, len(store.entries))])
    out += family("queue_depth", "gauge", "Requests waiting for the engine.", [({}, queued)])
    busy = 0 if worker.live.get("state", "idle") == "idle" else 1
    out += family("busy", "gauge", "1 while the engine answers a request, else 0.", [({}, busy)])
    for name, (help_text, _) in LATENCIES.items():
        out += worker.latency[name].lines(f"streamoe_{name}", help_text)
    model = {"model_name": worker.so.model_name}
    vllm = [("num_requests_running", "gauge", "Requests the engine is answering.", busy),
            ("num_requests_waiting", "gauge", "Requests waiting for the engine.", queued),
            ("prompt_tokens_total", "counter", "Prompt tokens of the finished answers.", tot["prompt_tokens"]),
            ("generation_tokens_total", "counter", "Tokens generated in the finished answers.", tot["generated_tokens"]),
            # vLLM's prefix cache counters: prompt tokens looked up, and those found (the prompt cache's snapshots)
            ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prompt cache.", tot["prompt_tokens"]),
            ("prefix_cache_hits_total", "counter", "Prompt tokens the prompt cache held.", tot["cached_tokens"])]
    for name, kind, help_text, value in vllm:
        out += family(name, kind, help_text, [(model, value)], prefix="vllm:")
    out += family("request_success_total", "counter", "Finished answers, by why they ended.",
                  [({**model, "finished_reason": r}, n) for r, n in sorted(worker.finished.items())] or
                  [({**model, "finished_reason": "stop"}, 0)], prefix="vllm:")
    for name, (help_text, _) in LATENCIES.items():
        out += worker.latency[name].lines(f"vllm:{name}", help_text, model)
    return "\n".join(out) + "\n"
