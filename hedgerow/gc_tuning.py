"""The cyclic garbage collector, tuned for a server in its steady state.

CPython starts a young-generation collection after every 700 net container
allocations. A gateway streaming to 100 clients allocates that many in well
under a millisecond (a request's coroutines, cancel scopes, events, dicts),
and each collection walks every young object still alive -- the live
requests' -- to find the few cycles among them: measured with py-spy under
the overhead scenario's load, the allocation sites that trigger collections
(``anyio.Event()``, ``CancelScope()``) were the largest self-time entries
of the gateway after the event loop itself. Two changes, once startup is
done:

- ``gc.freeze()``: what startup built (modules, the policy, the app, the
  metric families: ~55,000 objects) moves to a permanent generation that
  collections no longer walk.
- ``gc.set_threshold(50_000, 20, 100)``: a young collection every 50,000
  net allocations instead of 700; the older generations as rarely, relative
  to it. Objects freed by reference counting (nearly all of a request's) are
  freed at once as before; only garbage in reference cycles waits longer,
  at most one young threshold's worth of objects (a few MB).

Measured (``bench/corridor.py 3000 100 8 app`` and the same with ``gc``: the
corridor in one process, 100 streams, alternated, two runs each): 1.28 / 1.21
ms of CPU per request with CPython's defaults, 0.85 / 0.93 tuned
(docs/benchmarks.md, "overhead"). Instagram's Django fleet freezes its
startup objects for the same reason.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
MIDDLE_THRESHOLD = 20
OLD_THRESHOLD = 100


def tune_for_serving() -> None:
    """Freeze what startup built and collect rarely; call once, before serving."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)
