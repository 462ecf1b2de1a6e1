"""The gateway's Prometheus metrics: request latencies, outcomes, scheduler state.

``GatewayMetrics`` owns the app's registry. Each completion request gets a
``RequestMetrics`` that the request path feeds with monotonic timestamps as
they happen (sans-IO: it only does arithmetic and ``observe``):

- ``hedgerow_ttft_seconds{model,class}``: arrival at the gateway → first
  generated text written to a streaming client (observed once per stream that
  got that far, even if it failed later).
- ``hedgerow_itl_seconds{model,class}``: between consecutive text chunks
  written to a streaming client.
- ``hedgerow_queue_wait_seconds{model,class}``: ticket submitted to the
  scheduler → worker slot assigned (requests that got a slot).
- ``hedgerow_request_duration_seconds{model,class}``: arrival → last byte,
  for requests answered with 200.
- ``hedgerow_gateway_overhead_seconds{phase}``: time the gateway itself adds.
  ``request``: arrival → upstream request handed to the HTTP client, less the
  queue wait; ``first_token``: first token received from the winning worker →
  written to the client; ``chunk``: each later token chunk, taken from the
  upstream SSE parser → written to the client (includes waiting on a slow
  client's flow control).
- ``hedgerow_requests_total{model,class,status}``: every completion request by
  the HTTP status it was answered with (499: the client left before any
  response); model and class are empty when the request was refused before
  they were known (a bad key, an unknown model).
- ``hedgerow_cache_requests_total{result}``: admitted requests by cache result.
- From ``ResponseCache.stats()`` at scrape time (``watch_cache``):
  ``hedgerow_cache_redis_faults_total{kind}`` (timeout, error, skipped while
  the circuit is open, sync), ``hedgerow_cache_guard_rejections_total{reason}``
  (semantic candidates refused by the pair model or a guard), ``hedgerow_cache_evictions_total{kind}``,
  ``hedgerow_cache_entries{kind}`` (this gateway's memory), and the embedder's
  health: ``hedgerow_cache_embedder_ready``,
  ``hedgerow_cache_embedder_starts_total`` and
  ``hedgerow_cache_embeds_failed_total{reason}`` (refused, lost) and
  ``hedgerow_cache_judgements_failed_total`` (answered FAILED: no pair model), exported only
  while the policy turns the semantic cache on.
- From ``ConnectionCap.stats()`` at scrape time (``watch_connections``):
  ``hedgerow_connections_open`` (TCP and QUIC connections open now,
  handshakes included), ``hedgerow_connections_limit`` (``--max-connections``) and
  ``hedgerow_connections_refused_total`` (refused before TLS: at the cap); with
  per-client limits, ``hedgerow_connections_refused_per_client_total{limit}``,
  ``hedgerow_connection_sources{state}`` and
  ``hedgerow_connection_sources_forgotten_total``.
- From ``CertificateReloader.stats()`` (``watch_certificates``):
  ``hedgerow_certificate_reloads_total{result}`` and, after a reload,
  ``hedgerow_certificate_not_after_seconds``.
- Session tickets (``watch_tickets``): ``hedgerow_tls_ticket_key_rotations_total``,
  ``hedgerow_tls_tickets_total{event}`` (TCP) and ``hedgerow_quic_tickets_total{event}``.
- ``BodyBudget.stats()`` (``watch_body_budget``): ``hedgerow_request_body_bytes_buffered{state}``
  and ``hedgerow_request_body_budget_refused_total``.

The scheduler's own counters and gauges are read from its ``Stats`` snapshot
at scrape time: ``hedgerow_shed_total{reason}``, ``hedgerow_hedges_total{outcome}``
(started, budget_exhausted, won), ``hedgerow_retries_total``,
``hedgerow_breaker_transitions_total{to}``, ``hedgerow_breaker_state{worker,state}`` (1 for
the state each worker's breaker is in, 0 for the others),
``hedgerow_queue_depth{model}``, ``hedgerow_slots_in_use{worker}`` (slots this
gateway holds), ``hedgerow_slots{worker}`` (slots each registered worker
offers) and ``hedgerow_hedge_budget``. (The ``hedgerow_worker_*`` series are
the workers' own, on their ``/metrics``.)

Usage per tenant and the OpenTelemetry GenAI names: ``gateway.admin.usage_metrics``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hedgerow.metrics import (
    LATENCY_BUCKETS,
    OVERHEAD_BUCKETS,
    TOKEN_BUCKETS,
    Histogram,
    HistogramSeries,
    render,
)
from gateway.admin.usage_metrics import Finished, Price, Usage, UsageMetrics
from hedgerow.wire import RegistrySnapshot

BREAKER_STATES = ("closed", "half_open", "open")
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"
NO_STATS: dict[str, Any] = {"counters": {}, "breakers": {}, "queued": {}, "inflight": {},
                            "hedge_budget": {"level": 0.0}}


@dataclass(frozen=True)
class _ModelSeries:
    ttft: HistogramSeries
    itl: HistogramSeries
    queue_wait: HistogramSeries
    duration: HistogramSeries


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        by = ("model", "class")
        self.ttft = Histogram("hedgerow_ttft_seconds", "Arrival to first token written to the "
                              "client (streaming).", by, LATENCY_BUCKETS, r)
        self.itl = Histogram("hedgerow_itl_seconds", "Gaps between token chunks written to "
                             "the client (streaming).", by, TOKEN_BUCKETS, r)
        self.queue_wait = Histogram("hedgerow_queue_wait_seconds", "Submitted to the scheduler "
                                    "to a worker slot assigned.", by, LATENCY_BUCKETS, r)
        self.duration = Histogram("hedgerow_request_duration_seconds", "Arrival to the last "
                                  "byte, requests answered 200.", by, LATENCY_BUCKETS, r)
        overhead = Histogram("hedgerow_gateway_overhead_seconds", "Time the gateway adds: before "
                             "the upstream request (less queue wait), to relay the first token, "
                             "to relay each later chunk.", ("phase",), OVERHEAD_BUCKETS, r)
        self.overhead_request = overhead.labels("request")
        self.overhead_first_token = overhead.labels("first_token")
        self.overhead_chunk = overhead.labels("chunk")
        self.requests = Counter("hedgerow_requests", "Completion requests by HTTP status.",
                                ("model", "class", "status"), registry=r)
        self.cache = Counter("hedgerow_cache_requests", "Completion requests by cache result "
                             "(exact, semantic, miss, bypass, uncacheable).", ("result",),
                             registry=r)
        self.joined = Counter("hedgerow_single_flight_joined", "Requests that joined an "
                              "identical request's generation instead of starting one.",
                              registry=r)
        self.usage = UsageMetrics(r)
        self.scheduler = SchedulerCollector(r)
        self.cache_stats = StatsCollector(r, cache_families)
        self.connection_stats = StatsCollector(r, connection_families)
        self.quic_stats = StatsCollector(r, quic_families)
        self.h2_stats = StatsCollector(r, h2_families)
        self.certificate_stats = StatsCollector(r, certificate_families)
        self.ticket_stats = StatsCollector(r, ticket_families)
        self.body_budget_stats = StatsCollector(r, body_budget_families)
        # Labelled children resolved once per label set, not per request
        # (``labels()`` builds a key, and prometheus_client's takes a lock, on
        # every call). At most RESOLVED_MAX label sets are remembered.
        self._series: dict[tuple[str, str], _ModelSeries] = {}
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._cache: dict[str, Any] = {}

    def request(self, arrived: float) -> RequestMetrics:
        return RequestMetrics(self, arrived)

    def model_series(self, model: str, klass: str) -> _ModelSeries:
        series = self._series.get((model, klass))
        if series is None:
            series = _ModelSeries(self.ttft.labels(model, klass), self.itl.labels(model, klass),
                                  self.queue_wait.labels(model, klass),
                                  self.duration.labels(model, klass))
            _remember(self._series, (model, klass), series)
        return series

    def answered(self, model: str, klass: str, status: int) -> None:
        """Count one completion request answered with ``status``."""
        counter = self._requests.get((model, klass, status))
        if counter is None:
            counter = self.requests.labels(model, klass, str(status))
            _remember(self._requests, (model, klass, status), counter)
        counter.inc()

    def watch_cache(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the response cache's own counters (``ResponseCache.stats``) on scrape."""
        self.cache_stats.stats = stats

    def watch_connections(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the connection cap's counts (``ConnectionCap.stats``) on scrape."""
        self.connection_stats.stats = stats

    def watch_quic(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the QUIC front door's counts (``QuicFrontDoor.stats``) on scrape."""
        self.quic_stats.stats = stats
    def watch_h2(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the HTTP/2 guard's counts (``H2GuardStats.snapshot``) on scrape."""
        self.h2_stats.stats = stats
    def watch_certificates(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the certificate reloader's counts (``CertificateReloader.stats``) on scrape."""
        self.certificate_stats.stats = stats

    def watch_tickets(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the TCP ticket key ring's and the QUIC ticket store's counts on scrape."""
        self.ticket_stats.stats = stats

    def watch_body_budget(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the request body budget's counts (``BodyBudget.stats``) on scrape."""
        self.body_budget_stats.stats = stats

    def cache_lookup(self, result: str) -> None:
        counter = self._cache.get(result)
        if counter is None:
            counter = self.cache.labels(result)
            _remember(self._cache, result, counter)
        counter.inc()

    def single_flight_joined(self) -> None:
        self.joined.inc()

    def hedge_won(self) -> None:
        self.scheduler.hedges_won += 1

    def render(self, stats: Mapping[str, Any], directory: RegistrySnapshot) -> bytes:
        """The whole exposition, with the scheduler's ``stats`` snapshot of this scrape."""
        self.scheduler.stats, self.scheduler.directory = stats, directory
        return render(self.registry)


class RequestMetrics:
    """One completion request's timings and outcome (monotonic seconds), and what
    its access log line says (``gateway.admin.access_log``)."""

    def __init__(self, metrics: GatewayMetrics, arrived: float) -> None:
        self._metrics = metrics
        self.arrived = arrived
        self.model = ""
        self.klass = ""
        self.tenant = ""
        self.operation = "chat"
        self.status: int | None = None
        self.error_code = ""
        self.usage: Usage | None = None
        self.cache = ""  # exact, semantic, joined; empty: none
        self.worker = ""
        self.hedged = False
        self.ttft_s: float | None = None
        self.duration_s: float | None = None
        self._prices: Callable[[str], Price | None] | None = None
        self._series: _ModelSeries | None = None
        self._last_token_at: float | None = None

    def identified(self, tenant: str, klass: str,
                   prices: Callable[[str], Price | None] | None = None) -> None:
        """The tenant and class are known; ``prices`` gives a model's price (the
        policy the request runs under)."""
        self.tenant, self.klass, self._prices = tenant, klass, prices

    def labelled(self, model: str, klass: str) -> None:
        """The model (canonical, known) and class are settled: resolve the series once."""
        self.model, self.klass = model, klass
        self._series = self._metrics.model_series(model, klass)

    def used(self, prompt_tokens: int, completion_tokens: int, *, cached: str = "",
             error_code: str = "") -> None:
        """The tokens of the answer: computed by a worker, or ``cached`` (exact,
        semantic, joined) when no worker computed them for this request."""
        self.usage = Usage(prompt_tokens, completion_tokens, cached=bool(cached))
        self.cache = cached
        if error_code and not self.error_code:
            self.error_code = error_code

    def served_by(self, worker: str | None, hedged: bool) -> None:
        self.worker, self.hedged = worker or "", hedged

    def failed(self, error: BaseException) -> None:
        """The request ended with ``error``: its status and code (first call wins)."""
        self.responded(status_of(error))
        code = getattr(error, "code", None)
        if isinstance(code, str) and not self.error_code:
            self.error_code = code
        elif not isinstance(error, Exception) and not self.error_code:
            self.error_code = "client_closed"

    def dispatched(self, submitted: float, assigned: float | None,
                   upstream: float | None) -> None:
        """The first-token phase ended; times from the ticket (None: never reached)."""
        if self._series is None or assigned is None:
            return
        self._series.queue_wait.observe(assigned - submitted)
        if upstream is not None:
            before_queue = submitted - self.arrived
            self._metrics.overhead_request.observe(before_queue + max(0.0, upstream - assigned))

    def responded(self, status: int) -> None:
        """The response started with ``status`` (the first call wins)."""
        if self.status is None:
            self.status = status

    def relayed(self, received: float, written: float, token: bool) -> None:
        """One SSE event got from upstream at ``received`` reached the client at ``written``."""
        series = self._series
        if not token or series is None:
            return
        if self._last_token_at is None:
            self.ttft_s = written - self.arrived
            series.ttft.observe(self.ttft_s)
            self._metrics.overhead_first_token.observe(written - received)
        else:
            series.itl.observe(written - self._last_token_at)
            self._metrics.overhead_chunk.observe(written - received)
        self._last_token_at = written

    def finished(self, now: float) -> None:
        status = 500 if self.status is None else self.status
        self.status = status
        self.duration_s = now - self.arrived
        self._metrics.answered(self.model, self.klass, status)
        if status == 200 and self._series is not None:
            self._series.duration.observe(self.duration_s)
        price = self._prices(self.model) if self._prices is not None and self.model else None
        self._metrics.usage.finished(Finished(
            self.tenant, self.model, self.operation, status, self.error_code, self.usage, price,
            self.duration_s, self.ttft_s))


RESOLVED_MAX = 1024


def _remember(resolved: dict[Any, Any], key: Any, child: Any) -> None:
    """Keep a resolved child for next time, up to RESOLVED_MAX of them."""
    if len(resolved) < RESOLVED_MAX:
        resolved[key] = child


def status_of(error: BaseException) -> int:
    """The status a request that ended with ``error`` was answered with."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    return 500 if isinstance(error, Exception) else CLIENT_CLOSED


# -- the scheduler's snapshot -------------------------------------------------------


class SchedulerCollector(Collector):
    """Reads the scheduler ``Stats`` snapshot that ``GatewayMetrics.render`` hands it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.stats: Mapping[str, Any] = NO_STATS
        self.directory = RegistrySnapshot(version=0)
        self.hedges_won = 0
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        return iter(scheduler_families(NO_STATS, RegistrySnapshot(version=0), 0))

    def collect(self) -> Iterator[Metric]:
        return iter(scheduler_families(self.stats, self.directory, self.hedges_won))


class StatsCollector(Collector):
    """A component's counters, read from its ``stats()`` at scrape time and turned
    into metric families by ``families``."""

    def __init__(self, registry: CollectorRegistry,
                 families: Callable[[Mapping[str, Any]], list[Metric]]) -> None:
        self.stats: Callable[[], Mapping[str, Any]] | None = None
        self.families = families
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        return iter(self.families({}))

    def collect(self) -> Iterator[Metric]:
        return iter(self.families(self.stats() if self.stats is not None else {}))


def connection_families(stats: Mapping[str, Any]) -> list[Metric]:
    """``ConnectionCap.stats()`` as metric families (sans-IO); none without a cap."""
    if not stats:
        return []
    return [
        _gauge("hedgerow_connections_open", "TCP and QUIC connections open now (handshakes "
               "included).", None, {"": stats["open"]}),
        _gauge("hedgerow_connections_limit", "Open TCP and QUIC connections allowed "
               "(--max-connections).", None, {"": stats["limit"]}),
        _counter("hedgerow_connections_refused_total", "Connections refused before TLS "
                 "(TCP closed at accept, QUIC Initials dropped) at the connection limit.", None,
                 {"": stats["refused"]}),
        *_source_families(stats.get("sources")),
    ]


def _source_families(stats: Mapping[str, Any] | None) -> list[Metric]:
    """The per-client limits' counts (``SourceLimits.stats``); none when they are off."""
    if not stats:
        return []
    return [
        _counter("hedgerow_connections_refused_per_client_total", "TCP connections closed "
                 "at accept, before TLS, and QUIC Initials dropped, by a per-client limit "
                 "(TCP and QUIC count together): ip_open/prefix_open "
                 "(--max-connections-per-ip/-prefix), ip_rate/prefix_rate "
                 "(--new-connections-per-ip/-prefix).", "limit", stats["refused"]),
        _gauge("hedgerow_connection_sources", "Client IPs and prefixes tracked: open (with "
               "connections open) and idle (a rate bucket still refilling).", "state",
               {"open": stats["open_sources"], "idle": stats["idle_sources"]}),
        _counter("hedgerow_connection_sources_forgotten_total", "Idle client sources "
                 "dropped from the full table (least recently seen first).", None,
                 {"": stats["forgotten"]}),
    ]


def certificate_families(stats: Mapping[str, Any]) -> list[Metric]:
    """``CertificateReloader.stats()`` as metric families (sans-IO); none without one."""
    if not stats:
        return []
    families: list[Metric] = [
        _counter("hedgerow_certificate_reloads_total", "Reloads of the public certificate "
                 "and key (--certfile/--keyfile) after they changed or on SIGHUP: loaded, or "
                 "refused (unreadable, or a key that does not match; the old pair serves on).",
                 "result", {"loaded": stats["reloads"], "refused": stats["failures"]}),
    ]
    if stats.get("not_after") is not None:
        families.append(_gauge("hedgerow_certificate_not_after_seconds", "When the public "
                               "certificate last reloaded expires (POSIX seconds).", None,
                               {"": stats["not_after"]}))
    return families


def ticket_families(stats: Mapping[str, Any]) -> list[Metric]:
    """Session ticket counts, TCP (``TicketKeyRing.stats``) and QUIC
    (``QuicTicketStore.statistics``), as metric families (sans-IO)."""
    families: list[Metric] = []
    tcp = stats.get("tcp")
    if tcp:
        families += [
            _counter("hedgerow_tls_ticket_key_rotations_total", "TCP session ticket keys "
                     "replaced on schedule (--tls-ticket-rotation-s).", None,
                     {"": tcp["rotations"]}),
            _counter("hedgerow_tls_tickets_total", "TCP session tickets sealed, and presented "
                     "ones opened with the current key, the previous key (the grace after a "
                     "rotation) or none (a full handshake).", "event",
                     {"sealed": tcp["sealed"], **{f"opened_{k}": v
                                                  for k, v in tcp["opened"].items()}}),
        ]
    quic = stats.get("quic")
    if quic is not None:
        families.append(_counter(
            "hedgerow_quic_tickets_total", "QUIC session tickets issued, resumed, and not "
            "resumed: unknown (missed), expired, retired by rotation, evicted (store full).",
            "event", {"issued": quic.issued, "resumed": quic.resumed, "missed": quic.missed,
                      "expired": quic.expired, "rotated": quic.rotated,
                      "evicted": quic.evicted}))
    return families


def body_budget_families(stats: Mapping[str, Any]) -> list[Metric]:
    """``BodyBudget.stats()`` as metric families (sans-IO)."""
    if not stats:
        return []
    return [
        _gauge("hedgerow_request_body_bytes_buffered", "Request body bytes being received "
               "now (all requests), its peak, and the limit (--max-buffered-body-bytes).",
               "state", {"in_use": stats["in_use"], "peak": stats["peak"],
                         "limit": stats["limit"]}),
        _counter("hedgerow_request_body_budget_refused_total", "Request bodies refused with "
                 "503 body_budget_exhausted: they did not fit in the body budget.", None,
                 {"": stats["refused"]}),
    ]


def quic_families(stats: Mapping[str, Any]) -> list[Metric]:
    """``QuicFrontDoor.stats()`` as metric families (sans-IO); none without a door."""
    if not stats:
        return []
    reasons = {reason: stats["refused"].get(reason, 0) for reason in
               ("half_open", "per_source", "per_client", "connection_cap", "invalid_token")}
    return [
        _gauge("hedgerow_quic_half_open", "QUIC connections whose handshake is not done.",
               None, {"": stats["half_open"]}),
        _gauge("hedgerow_quic_half_open_limit", "Half-open QUIC connections allowed "
               "(--quic-max-half-open).", None, {"": stats["max_half_open"]}),
        _gauge("hedgerow_quic_established", "QUIC connections past their handshake.", None,
               {"": stats["established"]}),
        _counter("hedgerow_quic_refused_total", "QUIC Initials refused before any handshake "
                 "work, by reason.", "reason", reasons),
        _counter("hedgerow_quic_retries_total", "QUIC Retry packets sent (address "
                 "validation).", None, {"": stats["retries_sent"]}),
        _counter("hedgerow_quic_handshake_timeouts_total", "QUIC connections closed with "
                 "their handshake not done in --quic-handshake-timeout-s.", None,
                 {"": stats["handshake_timeouts"]}),
        _counter("hedgerow_h3_headers_refused_total", "HTTP/3 requests refused for a "
                 "header section over --h3-max-field-section-bytes (answered 431 on their "
                 "stream, or their connection closed).", None,
                 {"": stats["h3_headers_refused"]}),
        _counter("hedgerow_h3_header_connections_cut_total", "HTTP/3 connections closed "
                 "(H3_EXCESSIVE_LOAD) for oversized header sections: past "
                 "--h3-max-refused-header-sections of them, or in trailers.", None,
                 {"": stats.get("h3_connections_cut", 0)}),
    ]


def h2_families(stats: Mapping[str, Any]) -> list[Metric]:
    """``H2GuardStats.snapshot()`` as metric families (sans-IO)."""
    if not stats:
        return []
    return [
        _counter("hedgerow_h2_connections_cut_total", "HTTP/2 connections cut (GOAWAY "
                 "ENHANCE_YOUR_CALM) for overspending a per-connection budget (--h2-limit).",
                 "budget", stats["cut"]),
        _counter("hedgerow_h2_connections_drained_total", "HTTP/2 connections drained "
                 "gracefully after --max-requests-per-connection streams.", None,
                 {"": stats["drained"]}),
    ]


def cache_families(stats: Mapping[str, Any]) -> list[Metric]:
    """``ResponseCache.stats()`` as metric families (sans-IO); none without a cache."""
    if not stats:
        return []
    faults = {"timeout": stats.get("redis_timeouts", 0), "error": stats.get("redis_errors", 0),
              "skipped": stats.get("redis_skipped", 0),
              "sync": stats.get("redis_sync_faults", 0)}
    return [
        _counter("hedgerow_cache_redis_faults_total", "Cache calls to Redis that failed, timed "
                 "out, were skipped while Redis was marked down, or broke the semantic sync "
                 "(each served as a miss, never failed).", "kind", faults),
        _counter("hedgerow_cache_guard_rejections_total", "Semantic candidates refused: "
                 "by the pair model (reason pair_model), or, with judge cosine, above the "
                 "threshold but refused by a guard (numbers, units, negations, names, code "
                 "identifiers...).", "reason", dict(stats.get("guard_rejections", {}))),
        _counter("hedgerow_cache_evictions_total", "Entries evicted from this gateway's "
                 "memory by the size bounds.", "kind",
                 {"exact": stats.get("exact_evictions", 0),
                  "semantic": stats.get("semantic_evictions", 0)}),
        _gauge("hedgerow_cache_entries", "Entries in this gateway's memory.", "kind",
               {"exact": stats.get("exact_entries", 0),
                "semantic": stats.get("semantic_entries", 0)}),
        *_embedder_families(stats.get("embedder") or {}),
    ]


def _embedder_families(embedder: Mapping[str, int]) -> list[Metric]:
    if not embedder:
        return []
    return [
        _gauge("hedgerow_cache_embedder_ready", "1 while the semantic cache's embedding "
               "model (its sidecar process) answers; 0: semantic lookups are misses.", None,
               {"": embedder.get("ready", 0)}),
        _counter("hedgerow_cache_embedder_starts_total", "Times the embedding sidecar "
                 "became ready (more than one: it died and was restarted).", None,
                 {"": embedder.get("starts", 0)}),
        _counter("hedgerow_cache_embeds_failed_total", "Embeddings not made (each a "
                 "semantic miss): refused (not ready, queue full) or lost (the sidecar "
                 "died while they waited).", "reason",
                 {"refused": embedder.get("refused", 0), "lost": embedder.get("lost", 0)}),
        _counter("hedgerow_cache_judgements_failed_total", "Semantic lookups whose candidates "
                 "the sidecar answered it could not judge (each a miss): above all, a sidecar "
                 "without the pair model (run `hedgerow cache export-model`). Judgements "
                 "refused or lost count in hedgerow_cache_embeds_failed_total.", None,
                 {"": embedder.get("judge_failures", 0)}),
    ]


def _counter(name: str, help_text: str, label: str | None,
             values: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[] if label is None else [label])
    for key, value in sorted(values.items()):
        family.add_metric([] if label is None else [key], value)
    return family


def _gauge(name: str, help_text: str, label: str | None,
           values: Mapping[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=[] if label is None else [label])
    for key, value in sorted(values.items()):
        family.add_metric([] if label is None else [key], value)
    return family


def _with_prefix(counters: Mapping[str, int], prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): v for k, v in counters.items() if k.startswith(prefix)}


def scheduler_families(stats: Mapping[str, Any], directory: RegistrySnapshot,
                       hedges_won: int) -> list[Metric]:
    """The scheduler's counters and gauges as metric families (sans-IO)."""
    counters: Mapping[str, int] = stats["counters"]
    hedges = {"started": counters.get("hedges_started", 0),
              "budget_exhausted": counters.get("hedge_budget_exhausted", 0),
              "won": hedges_won}
    breakers = stats["breakers"]
    slots = {w.registration.worker_id: w.registration.slots for w in directory.workers}
    return [
        _counter("hedgerow_shed_total", "Requests refused or shed, by reason.", "reason",
                 _with_prefix(counters, "shed_")),
        _counter("hedgerow_hedges_total", "Hedged attempts: started, refused by the budget, "
                 "and won (the hedge gave the first token).", "outcome", hedges),
        _counter("hedgerow_retries_total", "Attempts retried on another worker before the "
                 "first token.", None, {"": counters.get("retries", 0)}),
        _counter("hedgerow_breaker_transitions_total", "Circuit breaker state changes, by new "
                 "state.", "to", _with_prefix(counters, "breaker_to_")),
        _breaker_states(breakers),
        _gauge("hedgerow_queue_depth", "Requests waiting for a worker slot.", "model",
               stats["queued"]),
        _gauge("hedgerow_slots_in_use", "Worker slots this gateway holds now (attempts in "
               "flight), by worker.", "worker", stats["inflight"]),
        _gauge("hedgerow_slots", "Slots each registered worker offers.", "worker", slots),
        _gauge("hedgerow_hedge_budget", "Hedges that could be started now.", None,
               {"": round(stats["hedge_budget"]["level"], 3)}),
        _counter("hedgerow_shared_limits_fallback_total", "Requests admitted on this "
                 "gateway's own limits because Redis (--redis) was unreachable.", None,
                 {"": counters.get("shared_limits_fallback", 0)}),
        _gauge("hedgerow_asyncio_tasks", "Tasks alive on the gateway's event loop (a leak "
               "shows as growth at steady load).", None, {"": _asyncio_tasks()}),
    ]


def _breaker_states(breakers: Mapping[str, str]) -> GaugeMetricFamily:
    """One series per worker and state, 1 for the state it is in and 0 for the
    others: ``max by (worker) (hedgerow_breaker_state{state="open"})`` alerts,
    and a sum counts workers per state (an enum as one number cannot be summed)."""
    family = GaugeMetricFamily("hedgerow_breaker_state", "Circuit breaker state per worker: "
                               "1 for the state it is in (closed, half_open, open), 0 for the "
                               "others.", labels=["worker", "state"])
    for worker, current in sorted(breakers.items()):
        for state in BREAKER_STATES:
            family.add_metric([worker, state], 1 if state == current else 0)
    return family


def _asyncio_tasks() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # no running loop (rendered outside the gateway)
        return 0
