"""Tickets and the scheduler's answers.

A ``Ticket`` is one admitted request from admission until its last attempt
ends; its ``assignment`` is the one-shot through which the scheduler hands it
a worker (or the reason it never will): the only thing a queued request awaits.
The answers are what the scheduler's calls return (``gateway.corridor.scheduler``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from hedgerow.errors import HedgerowError
from hedgerow.wire import WorkerRecord
from policies.edf import EdfHandle
from policies.admission import Refused
from policies.schema import Policy
from policies.scoring import RouteRequest

Outcome = Literal["success", "failure", "abandoned"]


class _Assignment:
    """One-shot: the worker a queued ticket got, or why it never will."""

    def __init__(self) -> None:
        # asyncio's own: a quarter of anyio's cost, and no extra loop step when set.
        self._event = asyncio.Event()
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
    # Its requests/s already charged at the door (``charge_request``): submit skips it.
    request_charged: bool = False

    def requeue_for_retry(self, tried: tuple[str, ...]) -> None:
        """Back to waiting: a fresh one-shot for the retry's worker (the old one is spent)."""
        self.tried = tried
        self.assignment = _Assignment()


# -- the scheduler's answers ---------------------------------------------------


@dataclass(frozen=True)
class Assigned:
    """``submit``'s answer: admitted, and on ``worker`` already (the assignment is settled)."""

    worker: WorkerRecord


@dataclass(frozen=True)
class Queued:
    """``submit``'s answer: admitted, waiting in its model's queue (wait on the assignment)."""


QUEUED = Queued()

# Admitted (assigned or queued) or refused; a refusal touched no worker.
Submitted = Assigned | Queued | Refused


@dataclass(frozen=True)
class Requeued:
    """``reroute``'s answer for a retry that went back into the queue."""


REQUEUED = Requeued()
