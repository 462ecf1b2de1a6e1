"""A circuit breaker per worker: stop sending to a worker that keeps failing (sans-IO).

A dying worker should cost one or two requests, not every request routed to it
until its lease runs out. The breaker is an explicit state table:

    state      input    effect                                         next
    CLOSED     SUCCESS  failure streak reset                           CLOSED
    CLOSED     FAILURE  streak + 1; at ``failure_threshold`` trips     CLOSED | OPEN
    CLOSED     PERMIT   granted                                        CLOSED
    CLOSED     ABANDON  nothing                                        CLOSED
    OPEN       SUCCESS  late outcome of a request sent before tripping OPEN
    OPEN       FAILURE  late outcome, ignored (does not extend)        OPEN
    OPEN       PERMIT   refused                                        OPEN
    OPEN       TIMER    ``open_for`` elapsed: one probe may go         HALF_OPEN
    OPEN       ABANDON  nothing                                        OPEN
    HALF_OPEN  PERMIT   granted if no probe is out (one at a time)     HALF_OPEN
    HALF_OPEN  SUCCESS  probe out: closes, backoff reset; else stale   CLOSED | HALF_OPEN
    HALF_OPEN  FAILURE  probe out: reopens, ``open_for`` doubles up to
                        ``max_open_for_s``; else stale                 OPEN | HALF_OPEN
    HALF_OPEN  TIMER    the probe outlived ``probe_timeout_s``: failure OPEN
    HALF_OPEN  ABANDON  probe out: the probe was cancelled, slot freed  HALF_OPEN

``(CLOSED, TIMER)`` is missing on purpose: no timer is armed in CLOSED, so it
firing is a bug and raises ``RuntimeFault``, as does a TIMER in HALF_OPEN with
no probe out or in OPEN before it is due. FAILURE means a connection error, a
5xx or a TTFT timeout; ABANDON means a request that ended with neither (the
client went away, a hedge lost).

Outcomes carry no request identity, so in HALF_OPEN any outcome while a probe
is out counts as the probe's. Call ``allow`` only for the worker you are about
to send to: a granted probe permit is held until an outcome, an abandon or
``probe_timeout_s``.

Timers are lazy, like aioquic's: every call takes ``now`` and first fires any
timer that is due; ``next_timer()`` says when one will be.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hedgerow.errors import RuntimeFault


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerInput(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    PERMIT = "permit"
    TIMER = "timer"
    ABANDON = "abandon"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 5  # consecutive failures that trip a closed breaker
    open_for_s: float = 5.0  # first time open before a probe
    max_open_for_s: float = 60.0  # cap of the doubling after failed probes
    probe_timeout_s: float = 30.0  # an unanswered probe counts as a failure

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if not 0 < self.open_for_s <= self.max_open_for_s:
            raise ValueError("need 0 < open_for_s <= max_open_for_s")
        if not self.probe_timeout_s > 0:
            raise ValueError("probe_timeout_s must be > 0")


@dataclass(frozen=True)
class BreakerTransition:
    """A change of state, for logs and ``breaker_transitions_total{to}``."""

    from_state: BreakerState
    to_state: BreakerState
    at: float
    cause: BreakerInput


_Handler = Callable[["CircuitBreaker", float], bool]


class CircuitBreaker:
    """One worker's breaker. ``on_transition`` is called on every change of state."""

    def __init__(
        self,
        config: BreakerConfig = BreakerConfig(),
        on_transition: Callable[[BreakerTransition], None] | None = None,
    ) -> None:
        self.config = config
        self.on_transition = on_transition
        self.transitions_total: Counter[BreakerState] = Counter()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._open_for_s = config.open_for_s
        self._open_until = 0.0
        self._probe_until: float | None = None  # set while a probe is out
        self._input = BreakerInput.PERMIT  # the input being processed, for transitions

    def state(self, now: float) -> BreakerState:
        self._fire_due_timers(now)
        return self._state

    def allow(self, now: float) -> bool:
        """May a request be sent now? In HALF_OPEN a True is the one probe permit."""
        return self.process(BreakerInput.PERMIT, now)

    def on_success(self, now: float) -> None:
        self.process(BreakerInput.SUCCESS, now)

    def on_failure(self, now: float) -> None:
        """A connection error, a 5xx or a TTFT timeout."""
        self.process(BreakerInput.FAILURE, now)

    def on_abandoned(self, now: float) -> None:
        """A request ended with neither success nor failure (cancelled)."""
        self.process(BreakerInput.ABANDON, now)

    def next_timer(self) -> float | None:
        """When the breaker will next change state by itself, or None."""
        if self._state is BreakerState.OPEN:
            return self._open_until
        return self._probe_until

    def process(self, event: BreakerInput, now: float) -> bool:
        """Apply one input through the table (after any due timer); the named
        methods are the usual way in. Returns the permit answer for PERMIT."""
        if event is not BreakerInput.TIMER:
            self._fire_due_timers(now)
        return self._apply(event, now)

    def _apply(self, event: BreakerInput, now: float) -> bool:
        handler = TRANSITIONS.get((self._state, event))
        if handler is None:
            raise RuntimeFault(f"circuit breaker: no transition for {event.name} in "
                               f"{self._state.name}", code="breaker_transition")
        self._input = event
        return handler(self, now)

    def _fire_due_timers(self, now: float) -> None:
        timer = self.next_timer()
        while timer is not None and now >= timer:
            self._apply(BreakerInput.TIMER, now)
            timer = self.next_timer()

    def _move(self, to: BreakerState, now: float) -> None:
        change = BreakerTransition(self._state, to, now, self._input)
        self._state = to
        self.transitions_total[to] += 1
        if self.on_transition is not None:
            self.on_transition(change)

    def _open(self, now: float) -> None:
        self._probe_until = None
        self._open_until = now + self._open_for_s
        self._move(BreakerState.OPEN, now)

    # -- handlers: one per row of the table; each returns the permit answer --

    def _closed_success(self, now: float) -> bool:
        self._failures = 0
        return True

    def _closed_failure(self, now: float) -> bool:
        self._failures += 1
        if self._failures >= self.config.failure_threshold:
            self._failures = 0
            self._open(now)
        return True

    def _grant(self, now: float) -> bool:
        return True

    def _refuse(self, now: float) -> bool:
        return False

    def _ignore(self, now: float) -> bool:
        return True  # not a PERMIT: the answer is not used

    def _open_timer(self, now: float) -> bool:
        if now < self._open_until:
            raise RuntimeFault("circuit breaker: open timer fired early", code="breaker_transition")
        self._move(BreakerState.HALF_OPEN, now)
        return True

    def _half_open_permit(self, now: float) -> bool:
        if self._probe_until is not None:
            return False
        self._probe_until = now + self.config.probe_timeout_s
        return True

    def _half_open_success(self, now: float) -> bool:
        if self._probe_until is not None:
            self._probe_until = None
            self._open_for_s = self.config.open_for_s
            self._move(BreakerState.CLOSED, now)
        return True

    def _half_open_failure(self, now: float) -> bool:
        if self._probe_until is not None:
            self._open_for_s = min(2 * self._open_for_s, self.config.max_open_for_s)
            self._open(now)
        return True

    def _half_open_timer(self, now: float) -> bool:
        if self._probe_until is None or now < self._probe_until:
            raise RuntimeFault("circuit breaker: probe timer fired with no probe due",
                               code="breaker_transition")
        return self._half_open_failure(now)

    def _half_open_abandon(self, now: float) -> bool:
        self._probe_until = None
        return True


_S, _I, _B = BreakerState, BreakerInput, CircuitBreaker

TRANSITIONS: Mapping[tuple[BreakerState, BreakerInput], _Handler] = {
    (_S.CLOSED, _I.SUCCESS): _B._closed_success,
    (_S.CLOSED, _I.FAILURE): _B._closed_failure,
    (_S.CLOSED, _I.PERMIT): _B._grant,
    (_S.CLOSED, _I.ABANDON): _B._ignore,
    (_S.OPEN, _I.SUCCESS): _B._ignore,
    (_S.OPEN, _I.FAILURE): _B._ignore,
    (_S.OPEN, _I.PERMIT): _B._refuse,
    (_S.OPEN, _I.TIMER): _B._open_timer,
    (_S.OPEN, _I.ABANDON): _B._ignore,
    (_S.HALF_OPEN, _I.SUCCESS): _B._half_open_success,
    (_S.HALF_OPEN, _I.FAILURE): _B._half_open_failure,
    (_S.HALF_OPEN, _I.PERMIT): _B._half_open_permit,
    (_S.HALF_OPEN, _I.TIMER): _B._half_open_timer,
    (_S.HALF_OPEN, _I.ABANDON): _B._half_open_abandon,
}
"""The state table; a (state, input) pair that is not a key is a bug."""
