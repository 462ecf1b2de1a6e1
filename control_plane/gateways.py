"""Which gateway runs which policy version: the ACK/NACK book (sans-IO).

Gateways answer every policy version they receive with an ACK (in force) or
a NACK (rejected, with the reason; their last good version stays). The book
keeps the latest answer per gateway, bounded, for ``hedgerow status``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_GATEWAYS = 4096


@dataclass(frozen=True)
class GatewayAnswer:
    gateway_id: str
    version: int
    accepted: bool
    checksum: str | None
    error: str | None
    at: float


class GatewayBook:
    def __init__(self, max_gateways: int = MAX_GATEWAYS) -> None:
        self.max_gateways = max_gateways
        self._answers: OrderedDict[str, GatewayAnswer] = OrderedDict()
        self._running: dict[str, int] = {}

    def record(self, answer: GatewayAnswer) -> None:
        self._answers.pop(answer.gateway_id, None)
        self._answers[answer.gateway_id] = answer
        if answer.accepted:
            self._running[answer.gateway_id] = answer.version
        while len(self._answers) > self.max_gateways:
            gone, _ = self._answers.popitem(last=False)
            self._running.pop(gone, None)

    def running(self, gateway_id: str) -> int | None:
        """The last version this gateway ACKed (what it runs now)."""
        return self._running.get(gateway_id)

    def rows(self, now: float) -> list[dict[str, object]]:
        return [
            {
                "gateway_id": a.gateway_id,
                "running_version": self._running.get(a.gateway_id),
                "last_answer": {"version": a.version, "accepted": a.accepted,
                                "error": a.error},
                "seconds_since_answer": round(max(0.0, now - a.at), 1),
            }
            for a in sorted(self._answers.values(), key=lambda a: a.gateway_id)
        ]
