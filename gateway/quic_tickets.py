"""Server-side store of QUIC (TLS 1.3) session tickets, sans-IO.

aioquic's server issues a ticket after each full handshake through
``session_ticket_handler(ticket)`` and, when a returning client presents one,
asks ``session_ticket_fetcher(label)`` for it; a ticket the fetcher does not
return means a full handshake. This store holds those tickets:

- bounded by count, evicting the least recently issued ticket first;
- expiry checked against an injected ``now`` (never read from a clock here);
- single use: ``pop`` removes the ticket. RFC 8446 section 8.1 — a server
  that accepts each ticket at most once cannot be made to replay 0-RTT data
  by a client that resends its ClientHello.

``hooks(clock)`` adapts the store to aioquic's two callbacks; the clock is the
only I/O and it lives in the caller.
"""

from __future__ import annotations

import datetime
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
        self._tickets: OrderedDict[bytes, tuple[SessionTicket, datetime.datetime]] = (
            OrderedDict()
        )
        self._issued = self._resumed = self._missed = self._expired = self._evicted = 0

    def __len__(self) -> int:
        return len(self._tickets)

    def add(self, ticket: SessionTicket, *, now: datetime.datetime) -> None:
        expires_at = min(ticket.not_valid_after, now + self._max_age)
        self._tickets.pop(ticket.ticket, None)
        self._tickets[ticket.ticket] = (ticket, expires_at)
        self._issued += 1
        while len(self._tickets) > self._max_tickets:
            self._tickets.popitem(last=False)
            self._evicted += 1

    def pop(self, label: bytes, *, now: datetime.datetime) -> SessionTicket | None:
        entry = self._tickets.pop(label, None)
        if entry is None:
            self._missed += 1
            return None
        ticket, expires_at = entry
        if now >= expires_at:
            self._expired += 1
            return None
        self._resumed += 1
        return ticket

    def prune(self, *, now: datetime.datetime) -> int:
        """Drop expired tickets; returns how many were dropped."""
        stale = [label for label, (_, expires_at) in self._tickets.items() if now >= expires_at]
        for label in stale:
            del self._tickets[label]
        self._expired += len(stale)
        return len(stale)

    def statistics(self) -> TicketStoreStats:
        return TicketStoreStats(
            stored=len(self._tickets),
            issued=self._issued,
            resumed=self._resumed,
            missed=self._missed,
            expired=self._expired,
            evicted=self._evicted,
        )

    def hooks(self, clock: Clock = utc_now) -> TicketHooks:
        def fetch(label: bytes) -> SessionTicket | None:
            return self.pop(label, now=clock())

        def keep(ticket: SessionTicket) -> None:
            self.add(ticket, now=clock())

        return TicketHooks(session_ticket_fetcher=fetch, session_ticket_handler=keep)
