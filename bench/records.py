"""What the load generator measured for each request, and its JSON summary.

Every duration of a ``RequestRecord`` is in seconds and — except the
inter-token gaps — counted from the request's *intended* send time: the
arrival the schedule asked for, not the moment the request actually left. A
stalled client or server therefore shows up in the latencies instead of
silently thinning the load (coordinated omission). ``send_delay_s`` says how
late the actual send was.

Error kinds, one per failed request:

    http_status  the response status was not 200 (the body's error code is kept)
    sse_error    a ``data: {"error": ...}`` event arrived in the stream
    truncated    the stream ended cleanly but without ``data: [DONE]``
    transport    connect failure, reset, or a stream cut off mid-way
    timeout      no complete response within the request timeout
    dropped      not sent: the generator's in-flight cap was full at its arrival
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from bench.stats import summarize_ms, tally

ErrorKind = Literal["http_status", "sse_error", "truncated", "transport", "timeout", "dropped"]
ERROR_KINDS: tuple[ErrorKind, ...] = (
    "http_status", "sse_error", "truncated", "transport", "timeout", "dropped",
)

HEADERS_OF_INTEREST: tuple[str, ...] = (
    "x-hedgerow-worker", "x-hedgerow-hedged", "x-hedgerow-cache", "retry-after",
)


@dataclass
class RequestRecord:
    """One request's measurements; see the module docstring for the clock they use."""

    index: int
    tag: str
    intended_s: float  # scheduled send time, seconds since the run started
    send_delay_s: float | None = None  # actual send minus intended send
    ttft_s: float | None = None  # first content token (streams) or whole body (non-streamed)
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive token events
    e2e_s: float | None = None  # end of the response
    status: int | None = None
    http_version: str | None = None
    tokens: int = 0  # content-bearing stream events
    error: ErrorKind | None = None
    error_detail: str | None = None  # e.g. the error envelope's code
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    def fail(self, kind: ErrorKind, detail: str | None = None) -> None:
        """Record the first failure only; a later symptom of the same failure is ignored."""
        if self.error is None:
            self.error = kind
            self.error_detail = detail


@dataclass
class LoadResult:
    """All records of one run (in index order) and the run's wall-clock duration."""

    records: list[RequestRecord]
    wall_s: float
    load: dict[str, Any]  # the load shape that produced it, for the report

    def summary(self) -> dict[str, Any]:
        return summarize(self.records, self.wall_s, self.load)

    def record_dicts(self) -> list[dict[str, Any]]:
        return [asdict(record) for record in self.records]


def summarize(records: list[RequestRecord], wall_s: float, load: dict[str, Any]) -> dict[str, Any]:
    """Overall and per-tag summaries, JSON-able."""
    by_tag: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        by_tag[record.tag].append(record)
    return {
        "load": load,
        "wall_s": round(wall_s, 3),
        "overall": summarize_group(records, wall_s),
        "by_tag": {tag: summarize_group(group, wall_s) for tag, group in sorted(by_tag.items())},
    }


def summarize_group(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Counts, latency percentiles (ms) and rates of one group of requests.

    ``ttft_ms`` covers every request that got a first token (including ones
    that failed later); ``itl_ms`` every gap of those requests; ``e2e_ms``
    only successful requests; ``refused_ms`` the end-to-end time of requests
    answered with an error status (how fast refusals come back).
    """
    ok = [r for r in records if r.ok]
    errors = {kind: sum(1 for r in records if r.error == kind) for kind in ERROR_KINDS}
    tokens = sum(r.tokens for r in records)
    per_second = wall_s if wall_s > 0 else float("inf")
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": {kind: count for kind, count in errors.items() if count},
        "error_codes": tally(r.error_detail for r in records if r.error_detail),
        "status": tally(str(r.status) for r in records if r.status is not None),
        "ttft_ms": summarize_ms(r.ttft_s for r in records if r.ttft_s is not None),
        "itl_ms": summarize_ms(gap for r in records for gap in r.itl_s),
        "e2e_ms": summarize_ms(r.e2e_s for r in ok if r.e2e_s is not None),
        "refused_ms": summarize_ms(
            r.e2e_s for r in records if r.error == "http_status" and r.e2e_s is not None
        ),
        "send_delay_ms": summarize_ms(r.send_delay_s for r in records if r.send_delay_s is not None),
        "throughput_rps": round(len(ok) / per_second, 3),
        "tokens_per_s": round(tokens / per_second, 3),
        "headers": {
            name: tally(r.headers[name] for r in records if name in r.headers)
            for name in sorted({name for r in records for name in r.headers})
        },
    }
