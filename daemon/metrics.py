"""Prometheus metrics of one daemon (``GET /metrics``): requests, latency, tokens, records, errors."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("reef_requests", "HTTP requests served", ["route", "status"], registry=r)
        self.latency = Histogram(
            "reef_request_seconds", "Time to the full answer", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "reef_time_to_first_token_seconds", "Time to the first token", ["model"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("reef_tokens", "Tokens processed", ["model", "direction"], registry=r)
        self.records = Counter("reef_records", "Records stored", ["kind"], registry=r)
        self.errors = Counter("reef_errors", "Requests answered with an error", ["route", "type"], registry=r)
        self.publishes = Counter("reef_release_publishes", "Releases published", ["operation"], registry=r)
        self.conflicts = Counter("reef_release_conflicts", "Publishes refused: head moved", registry=r)
        self.loads = Counter("reef_engine_loads", "Releases loaded into an engine", ["model"], registry=r)
        self.upstream_latency = Histogram(
            "reef_upstream_seconds", "Upstream time to response headers", ["model"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter("reef_upstream_errors", "Upstream failures", ["model", "kind"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
