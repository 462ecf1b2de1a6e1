"""Graceful drain of a gateway: refuse new work, finish what runs, cut the rest.

On SIGTERM the gateway begins draining: readiness turns 503, new completion
requests are refused with 503 ``gateway_draining`` (Retry-After), and the
listeners close. Requests already in flight run on until they finish or the
drain deadline passes; then each remaining one is cancelled and ended
explicitly: a stream that already started gets a terminal SSE error event
(never a silent cut), one still waiting for its first token gets the 503.

    shutdown ──► begin() ──► [in flight finish] ──► idle ──► exit
                       └───► deadline ──► cut(): cancel the rest ──► exit
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio

from hedgerow.asgi import Message, Send


@dataclass(eq=False)
class InFlight:
    """One request being served: its cancel scope and how far its response got."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    response_started: bool = False
    response_finished: bool = False
    # Called by the cut before any request is cancelled: a stream notes that
    # the drain, not its client, stopped it (else the generation, ending first,
    # would write stream_cancelled as the stream's last word).
    before_cut: list[Callable[[], None]] = field(default_factory=list)

    def watch(self, send: Send) -> Send:
        """``send``, noting the response's start and end as they go out."""

        async def watched(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                self.response_started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                self.response_finished = True

        return watched

    @property
    def cut(self) -> bool:
        """True when the drain deadline cancelled it."""
        return self.scope.cancelled_caught


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.deadline_passed = False
        self._in_flight: set[InFlight] = set()
        self._changed = anyio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def begin(self) -> None:
        self.draining = True

    def cut(self) -> None:
        """The deadline: cancel every request still running, each told first."""
        self.deadline_passed = True
        running = list(self._in_flight)
        for request in running:
            for note in request.before_cut:
                note()
        for request in running:
            request.scope.cancel()

    @contextmanager
    def track(self) -> Iterator[InFlight]:
        """Run the body as one in-flight request, cancellable by ``cut``."""
        request = InFlight()
        with request.scope:
            if self.deadline_passed:
                request.scope.cancel()
            self._in_flight.add(request)
            try:
                yield request
            finally:
                self._in_flight.discard(request)
                self._changed.set()

    async def cut_after(self, timeout_s: float) -> None:
        """Wait for the requests in flight to finish, at most ``timeout_s``; cut the rest."""
        with anyio.move_on_after(timeout_s):
            while self._in_flight:
                self._changed = anyio.Event()
                await self._changed.wait()
        self.cut()
