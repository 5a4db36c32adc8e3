"""Prometheus metrics of one daemon (``GET /metrics``): requests, latency, tokens, records, errors.

Every labelled metric's ``labels()`` is memoised: the serve path calls it several times per request, and
prometheus_client's own lookup (checks, a lock) costs a few µs each time. Label values are bounded sets (routes,
models, error kinds), so the memo stays small.
"""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

M = TypeVar("M", Counter, Histogram)


def _memo(metric: M) -> M:
    children: dict[tuple[str, ...], Any] = {}
    labels = metric.labels

    def memo_labels(*values: str, **named: str) -> Any:
        if named:
            return labels(*values, **named)
        child = children.get(values)
        if child is None:
            child = children[values] = labels(*values)
        return child

    metric.labels = memo_labels  # type: ignore[method-assign]
    return metric

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
        self.canary_reports = Gauge("reef_canary_reports", "Reports on a running canary's arms", ["scenario", "arm"],
                                    registry=r)
        self.canary_mean = Gauge("reef_canary_mean_score", "Mean score of a running canary's arms",
                                 ["scenario", "arm"], registry=r)
        self.canary_ends = Counter("reef_canary_ends", "Canaries ended, by verdict", ["verdict"], registry=r)
        self.heldout_checks = Counter("reef_heldout_checks", "Held-out checks of weights candidates, by outcome "
                                      "(passed, held, failed, unchecked)", ["outcome"], registry=r)
        self.conflicts = Counter("reef_release_conflicts", "Publishes refused: head moved", registry=r)
        self.loads = Counter("reef_engine_loads", "Releases loaded into an engine", ["model"], registry=r)
        self.upstream_latency = Histogram(
            "reef_upstream_seconds", "Upstream time to response headers", ["model"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter("reef_upstream_errors", "Upstream failures", ["model", "kind"], registry=r)

        for metric in vars(self).values():
            if isinstance(metric, Counter | Histogram) and metric._labelnames:
                _memo(metric)

    def render(self) -> bytes:
        return generate_latest(self.registry)
