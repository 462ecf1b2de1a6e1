"""The worker's Prometheus metrics: generation timings, outcomes, backend load.

- ``hedgerow_worker_prefill_seconds{model}``: request received → the backend's
  first event (its first token, normally). Includes any wait for a free slot
  (``hedgerow_worker_queued`` shows when there is one).
- ``hedgerow_worker_decode_seconds_per_token{model}``: per generation, the time
  from its first to its last token chunk divided by the chunks in between
  (generations with at least two).
- ``hedgerow_worker_generations_total{model,finish_reason}``: generations by how
  they ended: ``stop``, ``length``, ``cancelled`` (the caller left first) or
  ``error``.
- From ``Backend.load()`` at scrape time: ``hedgerow_worker_slots``,
  ``hedgerow_worker_active``, ``hedgerow_worker_queued``,
  ``hedgerow_worker_tokens_total`` (its rate is the decode rate:
  ``rate(hedgerow_worker_tokens_total[1m])``; the heartbeat carries the worker's
  own recent rate to the routing, a rate kept as a gauge is not exported) and
  ``hedgerow_worker_draining``.
- Prompt reuse, from ``Backend.load()``:
  ``hedgerow_worker_prompt_cache_lookups_total{result="hit"|"miss"}``
  (a hit: the prompt started with tokens its slot still held),
  ``hedgerow_worker_prompt_tokens_total`` and
  ``hedgerow_worker_prompt_tokens_reused_total`` (prompt tokens taken from the
  cache instead of computed).
- Prompt-lookup decoding: ``hedgerow_worker_draft_tokens_total`` and
  ``hedgerow_worker_draft_tokens_accepted_total``; their ratio is the
  acceptance rate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hedgerow.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, Histogram, render
from workers.backend import BackendLoad, GenerationEvent, TokenChunk, ToolCallDelta


@dataclass
class GenerationTiming:
    """What one generation did and when (monotonic seconds), fed as events arrive."""

    started: float
    first_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_chunks: int = 0
    finish_reason: str | None = None
    failed: bool = False

    def saw(self, event: GenerationEvent, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        if isinstance(event, TokenChunk | ToolCallDelta):  # a call's delta is output too
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.token_chunks += 1
        else:
            self.finish_reason = event.finish_reason

    @property
    def outcome(self) -> str:
        if self.failed:
            return "error"
        return self.finish_reason or "cancelled"

    def decode_s_per_token(self) -> float | None:
        if self.token_chunks < 2 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / (self.token_chunks - 1)


class WorkerMetrics:
    def __init__(self, load: Callable[[], BackendLoad], draining: Callable[[], bool]) -> None:
        self.registry = r = CollectorRegistry()
        self.prefill = Histogram("hedgerow_worker_prefill_seconds", "Request received to the "
                                 "first token (includes waiting for a slot).", ("model",),
                                 LATENCY_BUCKETS, r)
        self.decode = Histogram("hedgerow_worker_decode_seconds_per_token", "Time per token "
                                "after the first, per generation.", ("model",), TOKEN_BUCKETS, r)
        self.generations = Counter("hedgerow_worker_generations", "Generations by how they "
                                   "ended.", ("model", "finish_reason"), registry=r)
        r.register(LoadCollector(load, draining))

    def generation_done(self, model: str, timing: GenerationTiming) -> None:
        if timing.first_at is not None:
            self.prefill.labels(model).observe(timing.first_at - timing.started)
        per_token = timing.decode_s_per_token()
        if per_token is not None:
            self.decode.labels(model).observe(per_token)
        self.generations.labels(model, timing.outcome).inc()

    def render(self) -> bytes:
        return render(self.registry)


class LoadCollector(Collector):
    """The backend's load snapshot, read at scrape time."""

    def __init__(self, load: Callable[[], BackendLoad], draining: Callable[[], bool]) -> None:
        self._load = load
        self._draining = draining

    def describe(self) -> Iterator[Metric]:
        return iter(load_families(BackendLoad(0, 0, 0, 0.0, 0, 0, 0), False))

    def collect(self) -> Iterator[Metric]:
        return iter(load_families(self._load(), self._draining()))


def load_families(load: BackendLoad, draining: bool) -> list[Metric]:
    def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, help_text, value=value)

    return [
        gauge("hedgerow_worker_slots", "Generations this worker runs at once.", load.slots),
        gauge("hedgerow_worker_active", "Generations holding a slot.", load.active),
        gauge("hedgerow_worker_queued", "Generations waiting for a slot.", load.queued),
        CounterMetricFamily("hedgerow_worker_tokens_total", "Tokens generated since start.",
                            value=load.tokens_generated_total),
        gauge("hedgerow_worker_draining", "1 while the worker drains for shutdown.",
              1 if draining else 0),
        _prompt_cache_family(load),
        CounterMetricFamily("hedgerow_worker_prompt_tokens_total", "Prompt tokens of finished "
                            "generations.", value=load.prompt_tokens_total),
        CounterMetricFamily("hedgerow_worker_prompt_tokens_reused_total", "Prompt tokens taken "
                            "from a slot's KV cache instead of computed.",
                            value=load.prompt_tokens_reused_total),
        CounterMetricFamily("hedgerow_worker_draft_tokens_total", "Tokens drafted by "
                            "prompt-lookup decoding.", value=load.draft_tokens_total),
        CounterMetricFamily("hedgerow_worker_draft_tokens_accepted_total", "Drafted tokens the "
                            "model accepted.", value=load.draft_tokens_accepted_total),
    ]


def _prompt_cache_family(load: BackendLoad) -> CounterMetricFamily:
    family = CounterMetricFamily("hedgerow_worker_prompt_cache_lookups_total", "Generations "
                                 "whose prompt did (hit) or did not (miss) start with tokens "
                                 "their slot still held.", labels=("result",))
    family.add_metric(("hit",), load.prompt_cache_hits_total)
    family.add_metric(("miss",), load.prompt_cache_misses_total)
    return family
