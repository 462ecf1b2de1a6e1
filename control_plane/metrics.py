"""The control plane's Prometheus metrics.

- ``hedgerow_control_plane_workers`` and ``hedgerow_control_plane_slots``:
  workers registered now and their slots, from the published snapshot;
- ``hedgerow_control_plane_registrations_total``,
  ``hedgerow_control_plane_deregistrations_total``,
  ``hedgerow_control_plane_lease_expiries_total``: registry changes, counted
  by the registry actor as it makes them;
- ``hedgerow_control_plane_watchers``: watch streams open now (gateways).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from hedgerow.latest import LatestValue
from hedgerow.metrics import render
from hedgerow.wire import RegistrySnapshot


class ControlPlaneMetrics:
    def __init__(self, published: LatestValue[RegistrySnapshot]) -> None:
        self.registry = r = CollectorRegistry()
        workers = Gauge("hedgerow_control_plane_workers", "Workers registered now.", registry=r)
        workers.set_function(lambda: len(published.value.workers))
        slots = Gauge("hedgerow_control_plane_slots", "Slots of the workers registered now.",
                      registry=r)
        slots.set_function(lambda: sum(w.registration.slots for w in published.value.workers))
        self.registrations = Counter("hedgerow_control_plane_registrations", "Worker "
                                     "registrations (re-registrations included).", registry=r)
        self.deregistrations = Counter("hedgerow_control_plane_deregistrations", "Workers that "
                                       "left the registry on their own.", registry=r)
        self.expiries = Counter("hedgerow_control_plane_lease_expiries", "Workers dropped "
                                "because their heartbeats stopped.", registry=r)
        self.watchers = Gauge("hedgerow_control_plane_watchers", "Watch streams open now.",
                              registry=r)

    def render(self) -> bytes:
        return render(self.registry)
