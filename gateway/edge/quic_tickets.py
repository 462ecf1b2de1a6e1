"""Server-side store of QUIC (TLS 1.3) session tickets, sans-IO.

aioquic's server issues a ticket after each full handshake through
``session_ticket_handler(ticket)`` and, when a returning client presents one,
asks ``session_ticket_fetcher(label)`` for it; a ticket the fetcher does not
return means a full handshake. This store holds those tickets:

- bounded by count, evicting the least recently issued ticket first;
- expiry checked against an injected ``now`` (never read from a clock here);
- rotated (``rotate_every(period)``): time is cut into periods of the UTC
  clock, and a ticket issued in one period resumes during it and the next,
  not later -- the schedule TCP's ticket keys follow (``gateway.edge.ticket_keys``),
  so a resumption secret held here outlives at most one rotation;
- single use: ``pop`` removes the ticket. RFC 8446 section 8.1 — a server
  that accepts each ticket at most once cannot be made to replay 0-RTT data
  by a client that resends its ClientHello.

``hooks(clock)`` adapts the store to aioquic's two callbacks; the clock is the
only I/O and it lives in the caller.
"""

from __future__ import annotations

import datetime
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aioquic.tls import SessionTicket, SessionTicketFetcher, SessionTicketHandler

Clock = Callable[[], datetime.datetime]

DEFAULT_MAX_TICKETS = 10_000
# aioquic issues tickets that live 24 h; a shorter cap bounds how long a
# stolen ticket can skip certificate authentication.
DEFAULT_MAX_AGE = datetime.timedelta(hours=12)


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class TicketStoreStats:
    stored: int
    issued: int
    resumed: int
    missed: int
    expired: int
    evicted: int
    rotated: int = 0  # presented or pruned after their period and the next had passed


@dataclass(frozen=True)
class TicketHooks:
    """The two callbacks ``aioquic.quic.connection.QuicConnection`` takes."""

    session_ticket_fetcher: SessionTicketFetcher
    session_ticket_handler: SessionTicketHandler


class QuicTicketStore:
    def __init__(
        self,
        *,
        max_tickets: int = DEFAULT_MAX_TICKETS,
        max_age: datetime.timedelta = DEFAULT_MAX_AGE,
    ) -> None:
        if max_tickets < 1:
            raise ValueError("max_tickets must be at least 1")
        if max_age <= datetime.timedelta(0):
            raise ValueError("max_age must be positive")
        self._max_tickets = max_tickets
        self._max_age = max_age
        # label -> (ticket, expires at, the rotation period it was issued in)
        self._tickets: OrderedDict[bytes, tuple[SessionTicket, datetime.datetime, int]] = (
            OrderedDict()
        )
        self._issued = self._resumed = self._missed = self._expired = self._evicted = 0
        self._rotated = 0
        self._rotation: datetime.timedelta | None = None

    def rotate_every(self, period: datetime.timedelta | None) -> None:
        """Retire tickets one full period after the period they were issued in (None: never)."""
        if period is not None and period <= datetime.timedelta(0):
            raise ValueError("the rotation period must be positive")
        self._rotation = period

    def _period(self, now: datetime.datetime) -> int:
        if self._rotation is None:
            return 0
        return math.floor(now.timestamp() / self._rotation.total_seconds())

    def _retired(self, issued_in: int, now: datetime.datetime) -> bool:
        return self._period(now) - issued_in > 1

    def __len__(self) -> int:
        return len(self._tickets)

    def add(self, ticket: SessionTicket, *, now: datetime.datetime) -> None:
        expires_at = min(ticket.not_valid_after, now + self._max_age)
        self._tickets.pop(ticket.ticket, None)
        self._tickets[ticket.ticket] = (ticket, expires_at, self._period(now))
        self._issued += 1
        while len(self._tickets) > self._max_tickets:
            self._tickets.popitem(last=False)
            self._evicted += 1

    def pop(self, label: bytes, *, now: datetime.datetime) -> SessionTicket | None:
        entry = self._tickets.pop(label, None)
        if entry is None:
            self._missed += 1
            return None
        ticket, expires_at, issued_in = entry
        if now >= expires_at:
            self._expired += 1
            return None
        if self._retired(issued_in, now):
            self._rotated += 1
            return None
        self._resumed += 1
        return ticket

    def prune(self, *, now: datetime.datetime) -> int:
        """Drop expired tickets; returns how many were dropped."""
        stale = [label for label, (_, expires_at, _) in self._tickets.items()
                 if now >= expires_at]
        for label in stale:
            del self._tickets[label]
        self._expired += len(stale)
        retired = [label for label, (_, _, issued_in) in self._tickets.items()
                   if self._retired(issued_in, now)]
        for label in retired:
            del self._tickets[label]
        self._rotated += len(retired)
        return len(stale) + len(retired)

    def statistics(self) -> TicketStoreStats:
        return TicketStoreStats(
            stored=len(self._tickets),
            issued=self._issued,
            resumed=self._resumed,
            missed=self._missed,
            expired=self._expired,
            evicted=self._evicted,
            rotated=self._rotated,
        )

    def hooks(self, clock: Clock = utc_now) -> TicketHooks:
        def fetch(label: bytes) -> SessionTicket | None:
            return self.pop(label, now=clock())

        def keep(ticket: SessionTicket) -> None:
            self.add(ticket, now=clock())

        return TicketHooks(session_ticket_fetcher=fetch, session_ticket_handler=keep)
