"""A versioned "latest value" cell that many tasks can wait on.

Publishers replace the value; waiters ask for anything newer than the version
they already hold. Slow waiters never queue old values: they skip straight to
the newest one, so memory stays bounded however many watchers there are.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class LatestValue(Generic[T]):
    def __init__(self, initial: T, version: int = 0) -> None:
        self._value = initial
        self._version = version
        self._changed = anyio.Event()

    @property
    def version(self) -> int:
        return self._version

    @property
    def value(self) -> T:
        return self._value

    def publish(self, value: T, version: int) -> None:
        if version <= self._version:
            return
        self._value, self._version = value, version
        self._changed.set()
        self._changed = anyio.Event()

    def replace(self, value: T, version: int) -> None:
        """Publish unconditionally, e.g. when the source restarted its count."""
        self._value, self._version = value, version
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_newer(self, version: int) -> tuple[int, T]:
        """Return ``(version, value)`` once the held version exceeds ``version``."""
        while self._version <= version:
            await self._changed.wait()
        return self._version, self._value
