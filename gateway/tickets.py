"""Tickets and the messages of the scheduler actor.

A ``Ticket`` is one admitted request from admission until its last attempt
ends; its ``assignment`` is the one-shot through which the scheduler hands it
a worker (or the reason it never will). The messages are what request
handlers and the dispatcher send the scheduler (``gateway.scheduler``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import anyio

from hedgerow.errors import HedgerowError
from hedgerow.wire import WorkerRecord
from policies.edf import EdfHandle
from policies.schema import Policy
from policies.scoring import RouteRequest

Outcome = Literal["success", "failure", "abandoned"]


class _Assignment:
    """One-shot: the worker a queued ticket got, or why it never will."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._worker: WorkerRecord | None = None
        self._error: HedgerowError | None = None

    @property
    def settled(self) -> bool:
        return self._event.is_set()

    @property
    def worker(self) -> WorkerRecord | None:
        """The worker given, if one was."""
        return self._worker

    def give(self, worker: WorkerRecord) -> None:
        self._worker = worker
        self._event.set()

    def refuse(self, error: HedgerowError) -> None:
        self._error = error
        self._event.set()

    async def wait(self) -> WorkerRecord:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        assert self._worker is not None
        return self._worker


@dataclass(eq=False)
class Ticket:
    """One admitted request, from admission until its last attempt ends."""

    request_id: str
    tenant: str
    model: str
    arrival: float
    deadline: float  # absolute (monotonic): still queued then, shed
    estimated_tokens: int
    route: RouteRequest
    hedgeable: bool
    # Absolute: first token wanted by then; the queue serves by it. None: the deadline.
    due: float | None = None
    # The policy in force when the request arrived (None: the dispatcher's own).
    policy: Policy | None = None
    assignment: _Assignment = field(default_factory=_Assignment)
    handle: EdfHandle | None = None
    charged: float = 0.0
    finished: bool = False
    assigned_at: float | None = None  # its first assignment (queue wait ends there)
    upstream_at: float | None = None  # the first attempt's request handed to the HTTP client
    # Workers its attempts went to, in order, once it waits in the queue for a retry.
    tried: tuple[str, ...] = ()
    # Its requests/s already charged at the door (``ChargeRequest``): Submit skips it.
    request_charged: bool = False
    # The scheduler instance that admitted it. A scheduler rebuilt after a crash
    # starts with empty admission counts: it must not release what it never admitted.
    admitted_by: object | None = field(default=None, repr=False)

    def requeue_for_retry(self, tried: tuple[str, ...]) -> None:
        """Back to waiting: a fresh one-shot for the retry's worker (the old one is spent)."""
        self.tried = tried
        self.assignment = _Assignment()


# -- messages ---------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """Ask: admit and queue (or assign at once). Replies None or a ``Refused``."""

    ticket: Ticket


@dataclass(frozen=True)
class ChargeRequest:
    """Ask: charge one request to ``tenant``'s requests/s now, before the cache
    answers it or it joins a flight (a ticket made for it afterwards has
    ``request_charged``). Replies None or a ``Refused``."""

    tenant: str
    policy: Policy | None = None  # the request's policy (the shared limits read it)


@dataclass(frozen=True)
class Withdraw:
    """Tell: the client left while the ticket waited for a worker, for its first
    attempt or a retry (still queued, or assigned a worker it will never use)."""

    ticket: Ticket


@dataclass(frozen=True)
class Reroute:
    """Ask: a worker for a retry or a hedge right now, or None.

    A hedge never queues. A retry with no free worker goes back into its
    model's queue (reply ``REQUEUED``; wait on ``ticket.assignment`` again)
    while a healthy worker it may use exists; otherwise None."""

    ticket: Ticket
    exclude: tuple[str, ...]
    hedge: bool


@dataclass(frozen=True)
class Requeued:
    """The reply to a retry's ``Reroute`` that put the ticket back in the queue."""


REQUEUED = Requeued()


@dataclass(frozen=True)
class AttemptDone:
    """Tell: one attempt on ``worker_id`` ended."""

    worker_id: str
    outcome: Outcome


@dataclass(frozen=True)
class TicketDone:
    """Tell: the request is over; settle its tenant's tokens and concurrency."""

    ticket: Ticket
    actual_tokens: int


@dataclass(frozen=True)
class FirstToken:
    """Tell: a first token came from ``pool`` after ``ttft_s`` (feeds hedge timing)."""

    model: str
    pool: str
    ttft_s: float


@dataclass(frozen=True)
class HedgeDelay:
    """Ask: seconds to wait for a first token before hedging on ``pool``."""

    model: str
    pool: str


@dataclass(frozen=True)
class Reconfigure:
    """Tell: a new policy is in force for requests admitted from now on."""

    policy: Policy


@dataclass(frozen=True)
class Stats:
    """Ask: a snapshot for /metrics and tests."""
