"""The server's Prometheus metrics (vLLM's names, with a `kvstack:` prefix).

Every series carries a `model_name` label, as vLLM's do. Cache and queue figures, and the
engine's own running totals (prefix-cache hits and lookups, replayed tokens, DSpark's
drafts and accepted tokens), are read from the engine at scrape time in one report
(`ServeOps.stats`, set on `EngineCollector.stats` before each scrape), so they are never
stale: levels as gauges,
totals as counters (`_total`, so `rate()` on them is right). Latencies and token counts
are recorded as requests finish; aborted and failed requests are counted by their reason.
No `_created` series: prometheus_client's timestamps would double every counter family.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstack.engine.sequence import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineCollector(Collector):
    """What the engine reports, read once per scrape (`stats`: the engine's
    `ServeOps.stats`, read by the scrape's handler)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:  # registered, not scraped yet
            return
        report, running, waiting = (self.stats[k] for k in ("report", "running", "waiting"))
        replayed, drafting = self.stats["replayed"], self.stats["drafting"]
        disk_bytes = self.stats["disk_bytes"]
        prefix = report["prefix_cache"]
        label = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(f"kvstack:{name}", doc, labels=label)
            family.add_metric([self.model_name], value)
            return family

        yield gauge("cache_bytes_per_token", "Cache bytes per token, measured from the "
                    "allocated pools", report["bytes_per_token"])
        yield gauge("cache_planned_bytes_per_token", "Cache bytes per token the layout plans",
                    report["planned_bytes_per_token"])
        if "positions" in report:  # a model with a vision tower: image positions apart
            positions = GaugeMetricFamily("kvstack:cache_positions", "Cache positions the "
                                          "requests hold, by kind (text, image, all)",
                                          labels=["model_name", "kind"])
            held = GaugeMetricFamily("kvstack:cache_position_bytes", "Cache bytes those "
                                     "positions take, by kind (measured bytes per token)",
                                     labels=["model_name", "kind"])
            for kind, figures in report["positions"].items():
                positions.add_metric([self.model_name, kind], figures["positions"])
                held.add_metric([self.model_name, kind], figures["bytes"])
            yield positions
            yield held
        yield gauge("device_blocks_used", "Device cache blocks in use", report["blocks_in_use"])
        yield gauge("device_blocks_free", "Device cache blocks free",
                    report["blocks_total"] - report["blocks_in_use"])
        yield gauge("host_tier_bytes", "Bytes of prefix blocks kept in the host tier",
                    report["host_tier"]["bytes"])
        yield gauge("disk_tier_bytes", "Bytes on the disk tier (sessions and prefix blocks)",
                    disk_bytes)
        yield gauge("num_requests_running", "Requests in the running batch", running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted", waiting)
        replay = CounterMetricFamily("kvstack:tokens_replayed", "Tokens re-run to rebuild "
                                     "window state (prefix hits, resumed sessions)",
                                     labels=label)
        replay.add_metric([self.model_name], replayed)
        yield replay
        restores = CounterMetricFamily("kvstack:window_checkpoint_restores", "Prefix hits "
                                       "whose window state was copied from a window "
                                       "checkpoint instead of replayed", labels=label)
        restores.add_metric([self.model_name], report["window_checkpoints"]["restored"])
        yield restores
        hits = CounterMetricFamily("kvstack:prefix_cache_hit_tokens", "Prompt tokens found "
                                   "in the prefix cache, by the tier they came from",
                                   labels=["model_name", "tier"])
        device = prefix["hit_tokens"] - prefix["host_hit_tokens"] - prefix["disk_hit_tokens"]
        for tier, value in (("device", device), ("host", prefix["host_hit_tokens"]),
                            ("disk", prefix["disk_hit_tokens"])):
            hits.add_metric([self.model_name, tier], value)
        yield hits
        verifies, drafted, accepted = drafting
        for name, doc, value in (
                ("spec_decode_num_drafts", "DSpark verify calls (one per drafting request "
                 "and step)", verifies),
                ("spec_decode_num_draft_tokens", "Draft tokens verified", drafted),
                ("spec_decode_num_accepted_tokens", "Draft tokens the target accepted",
                 accepted)):
            family = CounterMetricFamily(f"kvstack:{name}", doc, labels=label)
            family.add_metric([self.model_name], value)
            yield family
        yield gauge("spec_decode_mean_acceptance_length", "Tokens a DSpark verify yields on "
                    "average (accepted drafts + the target's own), since start; 0 before "
                    "the first", (accepted + verifies) / verifies if verifies else 0.0)
        queried = CounterMetricFamily("kvstack:prefix_cache_queried_tokens", "Prompt tokens "
                                      "looked up in the prefix cache", labels=label)
        queried.add_metric([self.model_name], prefix["queried_tokens"])
        yield queried


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        self.engine = EngineCollector(model_name)
        registry.register(self.engine)
        label = ("model_name",)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvstack:{name}", doc, label, registry=registry).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"kvstack:{name}", doc, label, buckets=LATENCY_BUCKETS,
                             registry=registry).labels(model_name)

        self.preemptions = counter("num_preemptions", "Requests preempted")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.finished = Counter("kvstack:request_success", "Finished requests by reason "
                                "(stop, length, abort, error)", (*label, "finished_reason"),
                                registry=registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a "
                             "request")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to "
                             "final output")
        self.sessions_saved = counter("sessions_saved", "Sessions saved to disk")
        self.sessions_resumed = counter("sessions_resumed", "Sessions resumed from disk")
        # Tokens prefilled and generated so far, counted as outputs arrive (for the stats
        # line: a long request shows its pace while it runs).
        self.totals = {"prompt": 0, "generation": 0}

    def record(self, out: "RequestOutput", e2e_s: float) -> None:
        """A finished request."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.finished.labels(self.model_name, out.finish_reason or "unknown").inc()
        self.preemptions.inc(out.metrics.get("preemptions", 0))
        if "time_to_first_token_s" in out.metrics:
            self.ttft.observe(out.metrics["time_to_first_token_s"])
        self.e2e.observe(e2e_s)
