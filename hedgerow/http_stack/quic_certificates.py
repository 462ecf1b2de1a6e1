"""Each QUIC listener's ``QuicConfiguration``, handed to whoever reloads certificates.

Changes: hypercorn's ``QuicProtocol.__init__`` (``hypercorn/protocol/quic.py``,
hypercorn 0.18.0), which builds the listener's ``QuicConfiguration`` from the
certificate files once: after it, the hook given to ``install`` is called
with that configuration (``self.quic_config``).

Why: the gateway reloads a renewed certificate without a restart
(``gateway.edge.cert_reload``). For TCP it registers the ``SSLContext`` from
``Config.create_ssl_context``, a public override; for QUIC the configuration
is built inside ``QuicProtocol`` and nothing else can reach it. aioquic reads
the certificate from it when a connection starts its handshake, so
replacing it there reaches every later handshake.

If the internals moved: ``PatchError`` at install when ``QuicProtocol`` has
no ``__init__`` of its own; if it stops setting ``quic_config`` the first
QUIC listener fails to start with ``AttributeError`` naming it (not
mid-request). ``tests/unit/test_http_stack_quic_certificates.py`` shows a
real listener's configuration reaching the hook.

Scope: listener. The hook decides per listener (the gateway's looks up the
reloader its listener's task put in ``ACTIVE_CERTIFICATES``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from hypercorn.protocol.quic import QuicProtocol

from hedgerow.http_stack.patch import wrap

NAME = "quic_certificates"

ConfigurationHook = Callable[[QuicConfiguration], None]
_hook: list[ConfigurationHook] = []


def install(on_configuration: ConfigurationHook) -> None:
    """Idempotent; a later hook replaces the earlier one."""
    _hook[:] = [on_configuration]

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            for hook in _hook:
                hook(self.quic_config)
        return init

    wrap(QuicProtocol, "__init__", make, patch=NAME)
