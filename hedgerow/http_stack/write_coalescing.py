"""A listener's TCP connections write through a writer the listener chooses.

Changes: hypercorn's ``TCPServer.__init__`` (``hypercorn/asyncio/tcp_server.py``,
hypercorn 0.18.0): when the listener's config has a ``wrap_writer``
(a callable taking the connection's ``asyncio.StreamWriter``), the writer
``TCPServer`` keeps is ``config.wrap_writer(writer)``. The gateway's public
port sets it to ``gateway.edge.write_coalescing.CoalescingWriter``, which
merges a connection's writes of one loop pass into one TLS record and one
``send``.

Why: hypercorn writes every piece of a response as soon as it is framed (over
HTTP/2 the HEADERS frame, each DATA frame, END_STREAM, window updates: a TLS
record and a syscall each); profiled on cache hits, ``StreamWriter.write`` was
15% of the gateway's CPU. Hypercorn has no hook for the writer.

Signature changes: the wrapper takes ``(self, *args, **kwargs)``; where the
``config`` and ``writer`` parameters sit is read from ``TCPServer.__init__``'s
signature when the patch is installed, so a reordered or extended signature
still works, and one without parameters of those names raises ``PatchError``
at install.

Scope: listener. A config without ``wrap_writer`` (the internal listeners,
hypercorn's own ``Config``) gets hypercorn's writer unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hypercorn.asyncio.tcp_server import TCPServer

from hedgerow.http_stack.patch import PatchError, wrap

NAME = "write_coalescing"
CONFIG_ATTRIBUTE = "wrap_writer"


def _position(parameters: list[str], name: str) -> int:
    if name not in parameters:
        raise PatchError(f"hedgerow.http_stack.{NAME} cannot be applied: TCPServer.__init__ "
                         f"has no {name!r} parameter (its parameters: {parameters})")
    return parameters.index(name) - 1  # less ``self``: the index into *args


def install() -> None:
    """Idempotent."""
    parameters = list(inspect.signature(TCPServer.__init__).parameters)
    config_at, writer_at = _position(parameters, "config"), _position(parameters, "writer")

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            config = kwargs["config"] if "config" in kwargs else args[config_at]
            wrap_writer = getattr(config, CONFIG_ATTRIBUTE, None)
            if wrap_writer is not None:
                if "writer" in kwargs:
                    kwargs["writer"] = wrap_writer(kwargs["writer"])
                else:
                    args = (*args[:writer_at], wrap_writer(args[writer_at]), *args[writer_at + 1:])
            original(self, *args, **kwargs)
        return init

    wrap(TCPServer, "__init__", make, patch=NAME)
