"""A task beside the request's own, joined as a task group's exit would join it.

An anyio task group with one ``start_soon`` costs about four plain
``create_task`` calls (docs/benchmarks.md, "anyio off the hot path"), and a
streamed miss needs exactly one task beside its reader: the generation. So
the request creates that task itself and ``join`` gives back what the group
guaranteed: the request does not end before the task has; when the request
is cancelled meanwhile (the drain's cut, the server tearing it down), the
task's work is cancelled through its own cancel scope -- so shielded cleanup
inside it still runs -- and the request waits for it, then re-raises the
cancellation; an exception the task ended with is raised here.
"""

from __future__ import annotations

import asyncio
import logging

import anyio

log = logging.getLogger("hedgerow.gateway")


async def join(task: asyncio.Task[None], work: anyio.CancelScope) -> None:
    """Wait for ``task``, whose work runs in ``work``; see the module docstring."""
    if not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            work.cancel()
            # Shielded: anyio would deliver the cancellation again at every
            # step of the wait; a native cancel still lands, and is waited out.
            with anyio.CancelScope(shield=True):
                while not task.done():
                    try:
                        await asyncio.wait((task,))
                    except asyncio.CancelledError:
                        pass
            _log_failure(task)
            raise
    task.result()


def _log_failure(task: asyncio.Task[None]) -> None:
    """A failure nobody will raise (the request is cancelled): logged, not lost."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("a request's generation failed while the request was cancelled",
                  exc_info=error)
