"""Prometheus metrics of the server, all named ``tgraph_*``.

Per-request observations (finish reasons, time to first token, inter-token latency, end-to-end
latency) are recorded by the server as requests run; the engine's state (running and waiting
requests, KV-cache use, prefix-cache queries and hits, preemptions) is read from
``EngineCore.stats()`` when the metrics are scraped, so it is never stale.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0)


class _EngineCollector:
    """The engine's gauges and counters, read at scrape time."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        for name, doc, value in (
                ("tgraph_requests_running", "requests in the running batch", s.running),
                ("tgraph_requests_waiting", "requests waiting to be scheduled", s.waiting),
                ("tgraph_kv_cache_blocks_used", "KV-cache blocks in use", s.kv_blocks_used),
                ("tgraph_kv_cache_usage_ratio", "fraction of KV-cache blocks in use",
                 s.kv_blocks_used / max(s.kv_blocks_total, 1))):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
                ("tgraph_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                 s.prefix_cache_queries),
                ("tgraph_prefix_cache_hits", "prompt tokens found in the prefix cache",
                 s.prefix_cache_hits),
                ("tgraph_preemptions", "requests preempted for lack of KV-cache blocks",
                 s.preemptions)):
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The server's metrics registry.

    Args:
        stats: returns the engine's :class:`~tgraph.runtime.engine_core.EngineStats`.
    """

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tgraph_requests", "finished requests by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "tgraph_time_to_first_token_seconds", "time from arrival to the first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "tgraph_inter_token_latency_seconds", "time between two tokens of a request",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "tgraph_request_latency_seconds", "time from arrival to the last token",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
