"""The server's Prometheus metrics (vLLM's names, with a `kvstack:` prefix).

Cache and queue figures are read from the engine at scrape time (`memory_report()`, the
scheduler), so they are never stale; latencies and token counts are recorded as requests
finish.
"""

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM
    from kvstack.engine.sequence import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, llm: "LLM") -> None:
        self.registry = registry = CollectorRegistry()
        self.llm = llm

        def gauge(name: str, doc: str, read, labels: tuple[str, ...] = ()) -> Gauge:
            g = Gauge(f"kvstack:{name}", doc, labels, registry=registry)
            if not labels:
                g.set_function(read)
            return g

        report = self._report
        gauge("cache_bytes_per_token", "Cache bytes per token, measured from the allocated "
              "pools", lambda: report()["bytes_per_token"])
        gauge("cache_planned_bytes_per_token", "Cache bytes per token the layout plans",
              lambda: report()["planned_bytes_per_token"])
        gauge("device_blocks_used", "Device cache blocks in use",
              lambda: report()["blocks_in_use"])
        gauge("device_blocks_free", "Device cache blocks free",
              lambda: report()["blocks_total"] - report()["blocks_in_use"])
        gauge("host_tier_bytes", "Bytes of prefix blocks kept in the host tier",
              lambda: report()["host_tier"]["bytes"])
        gauge("disk_tier_bytes", "Bytes on the disk tier (sessions and prefix blocks)",
              lambda: llm.disk.used_bytes)
        gauge("num_requests_running", "Requests in the running batch",
              lambda: len(llm.scheduler.running))
        gauge("num_requests_waiting", "Requests waiting to be admitted",
              lambda: len(llm.scheduler.waiting))
        gauge("tokens_replayed", "Tokens re-run to rebuild window state (prefix hits, "
              "resumed sessions), since start", lambda: llm.runner.replayed_tokens)
        self.prefix_hits = Gauge("kvstack:prefix_cache_hit_tokens", "Prompt tokens found in "
                                 "the prefix cache, by the tier they came from", ("tier",),
                                 registry=registry)
        self.prefix_queries = gauge("prefix_cache_queried_tokens", "Prompt tokens looked up "
                                    "in the prefix cache", lambda: report()["prefix_cache"]
                                    ["queried_tokens"])
        self.preemptions = Counter("kvstack:num_preemptions", "Requests preempted",
                                   registry=registry)
        self.prompt_tokens = Counter("kvstack:prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=registry)
        self.generation_tokens = Counter("kvstack:generation_tokens", "Tokens generated",
                                         registry=registry)
        self.finished = Counter("kvstack:request_success", "Finished requests by reason",
                                ("finished_reason",), registry=registry)
        self.ttft = Histogram("kvstack:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("kvstack:inter_token_latency_seconds", "Time between tokens "
                             "of a request", buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("kvstack:e2e_request_latency_seconds", "Request latency, "
                             "arrival to final output", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.sessions_saved = Counter("kvstack:sessions_saved", "Sessions saved to disk",
                                      registry=registry)
        self.sessions_resumed = Counter("kvstack:sessions_resumed", "Sessions resumed from "
                                        "disk", registry=registry)

    def _report(self) -> dict:
        return self.llm.memory_report()

    def refresh(self) -> None:
        """Figures that have labels, read from the engine before a scrape."""
        prefix = self._report()["prefix_cache"]
        device = prefix["hit_tokens"] - prefix["host_hit_tokens"] - prefix["disk_hit_tokens"]
        for tier, value in (("device", device), ("host", prefix["host_hit_tokens"]),
                            ("disk", prefix["disk_hit_tokens"])):
            self.prefix_hits.labels(tier).set(value)

    def record(self, out: "RequestOutput", e2e_s: float) -> None:
        """A finished request."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.finished.labels(out.finish_reason or "unknown").inc()
        self.preemptions.inc(out.metrics.get("preemptions", 0))
        if "time_to_first_token_s" in out.metrics:
            self.ttft.observe(out.metrics["time_to_first_token_s"])
        self.e2e.observe(e2e_s)
