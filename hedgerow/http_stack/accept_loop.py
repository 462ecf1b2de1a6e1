"""Hypercorn's worker opens its TCP listeners through Hedgerow's accept loop.

Changes: the ``asyncio`` module global of ``hypercorn.asyncio.run``
(hypercorn 0.18.0), which ``worker_serve`` calls ``asyncio.start_server`` on
for each listener, becomes ``hedgerow.connection_cap.HypercornAsyncio``: the
``asyncio`` module in every attribute but ``start_server``, which is
``capped_start_server``.

Why: hypercorn accepts without limit, so a flood takes every descriptor and
the memory of a TLS session each. ``capped_start_server`` runs its own accept
loop that closes a connection over the cap (and the per-client limits)
before any TLS byte, and otherwise builds exactly what ``start_server`` would
(``hedgerow.connection_cap``). Hypercorn has no hook for how it listens.

If the internals moved: ``PatchError`` at install when
``hypercorn.asyncio.run`` no longer has an ``asyncio`` global (it imports the
module some other way); if ``worker_serve`` stops calling
``asyncio.start_server`` the cap silently stops applying, which
``tests/unit/test_http_stack_accept_loop.py`` catches on a real listener.

Scope: listener. The global is swapped once per process, but the accept loop
applies the cap a listener's task put in ``ACTIVE_CAP`` (a context variable
set by ``serve``/``serve_internal`` before hypercorn starts); with no cap,
no TLS or no ready socket it is ``asyncio.start_server`` itself.
"""

from __future__ import annotations

import hypercorn.asyncio.run

from hedgerow.connection_cap import HypercornAsyncio
from hedgerow.http_stack.patch import replace

NAME = "accept_loop"


def install() -> None:
    """Idempotent."""
    replace(hypercorn.asyncio.run, "asyncio", HypercornAsyncio(), patch=NAME)
