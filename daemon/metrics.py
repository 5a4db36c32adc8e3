"""Prometheus metrics of one daemon (``GET /metrics``): requests, latency, tokens, records, errors.

Every labelled metric's ``labels()`` is memoised: the serve path calls it several times per request, and
prometheus_client's own lookup (checks, a lock) costs a few µs each time. Label values are bounded sets (routes,
models, error kinds), so the memo stays small.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)


def _memo(metric: M) -> M:
    children: dict[tuple[object, ...], M] = {}
    labels = metric.labels

    def memo_labels(*values: object, **named: object) -> M:
        if named:
            return labels(*values, **named)
        child = children.get(values)
        if child is None:
            child = children[values] = labels(*values)
        return child

    metric.labels = memo_labels  # type: ignore[method-assign]  # on purpose: the instance's method, memoized
    return metric

LOOP_LAG_TICK_S = 0.02  # the loop-lag watch's timer: a stall is seen to within this much
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
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
        self.scenario_warning = Gauge("reef_scenario_warning", "1 while a scenario's early warning stands: the reward "
                                      "rises while its answers collapse; learning paused until the user acts",
                                      ["scenario"], registry=r)
        self.conflicts = Counter("reef_release_conflicts", "Publishes refused: head moved", registry=r)
        self.loads = Counter("reef_engine_loads", "Releases loaded into an engine", ["model"], registry=r)
        self.upstream_latency = Histogram(
            "reef_upstream_seconds", "Upstream time to response headers", ["model"], buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter("reef_upstream_errors", "Upstream failures", ["model", "kind"], registry=r)
        self.loop_lag = Histogram(
            "reef_event_loop_lag_seconds", f"How late the event loop ran a {LOOP_LAG_TICK_S * 1e3:.0f} ms timer (a"
            " request arriving then waited as long)", buckets=_LAG_BUCKETS, registry=r,
        )
        self.loop_held = Histogram(
            "reef_event_loop_held_seconds", "The part of each loop lag that the daemon's own work explains: less"
            " the time its thread waited for a CPU, at most the CPU time the process used", buckets=_LAG_BUCKETS,
            registry=r,
        )
        # read at each scrape: a big body's parse holds the collector off until the route discards it
        # (daemon/bodies.py); one never discarded would leave it off for the daemon's life
        self.gc_off = Gauge("reef_gc_off", "1 while Python's cyclic garbage collector is off (held while a big "
                            "request body's parse lives, at most a minute at a time)", registry=r)
        self.gc_off.set_function(lambda: 0.0 if gc.isenabled() else 1.0)

        for metric in vars(self).values():
            if isinstance(metric, Counter | Histogram) and metric._labelnames:
                _memo(metric)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def watch_loop_lag(lag: Histogram, held: Histogram, tick: float = LOOP_LAG_TICK_S) -> None:
    """Observe, every ``tick`` seconds, how late the loop ran a timer that was due (``lag``: what a callback holding
    the loop, or a thread holding the GIL, cost every request then), and how much of that this process's own work
    explains (``held``): the lag less the time the loop's thread waited, runnable, for a CPU and less the longest
    such wait of one other thread (``/proc/self/task/*/schedstat``: a worker preempted while it held the GIL; the
    longest, not the sum, so that threads queueing beside it are not taken off too), and at most the CPU time the
    process used meanwhile. On a machine short of CPUs the lag grows with the queue for them; what is held
    mostly does not (it is an estimate there: which thread held the GIL is not known). A stall of S shows as at
    least S - tick (it may begin partway through a sleep), so a bound B on what is seen bounds stalls by B + tick.
    Runs until cancelled."""
    loop = asyncio.get_running_loop()
    waits = _Waits(str(threading.get_native_id()))
    try:
        while True:
            due, cpu = loop.time() + tick, time.process_time()
            waits.since()
            await asyncio.sleep(tick)
            late = max(0.0, loop.time() - due)
            lag.observe(late)
            held.observe(max(0.0, min(late - waits.since(), time.process_time() - cpu)))
    finally:
        waits.close()


class _Waits:
    """How long this process's threads have waited, runnable, for a CPU: each thread's schedstat kept open (the
    list of threads read again every ``REFRESH`` calls), 4 µs a thread a read. Without schedstats: nothing."""

    REFRESH = 1  # every call: a worker thread that began within the tick counts too (20 µs a listing)

    def __init__(self, own: str) -> None:
        self._own = own  # the loop's thread
        self._fds: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._calls = 0

    def since(self) -> float:
        """Seconds the loop's thread waited since the last call, plus the longest wait of one other thread."""
        if self._calls % self.REFRESH == 0:
            self._refresh()
        self._calls += 1
        own, other = 0, 0
        for tid, fd in list(self._fds.items()):
            try:
                now = int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):  # the thread ended
                os.close(self._fds.pop(tid))
                self._last.pop(tid, None)
                continue
            before = self._last.get(tid)
            self._last[tid] = now
            if before is None:
                continue
            if tid == self._own:
                own = now - before
            else:
                other = max(other, now - before)
        return (own + other) / 1e9

    def _refresh(self) -> None:
        try:
            tids = set(os.listdir("/proc/self/task"))
        except OSError:
            return
        for tid in tids - self._fds.keys():
            try:
                self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
