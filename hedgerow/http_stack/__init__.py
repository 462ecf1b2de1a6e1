"""Every change Hedgerow makes to hypercorn's and aioquic's private internals.

Hedgerow serves HTTP/1.1, HTTP/2 and HTTP/3 with hypercorn (and aioquic for
QUIC) without forking them. Where they lack a hook or have a bug the gateway
cannot live with, a patch here changes their private code in place. Outside
this package nothing assigns into hypercorn, aioquic or h2
(``tests/unit/test_http_stack_boundary.py`` holds that): the gateway and the
control plane supply *behaviour* (an ``H2Guard``'s handlers, the QUIC front
door, the coalescing writer) and a patch module here decides *where* it
plugs in.

The rules every patch module follows:

- One module per patch, named for what it changes. Its docstring says what
  it changes, why, the upstream version it was written against (``PINNED``
  in ``versions.py``: hypercorn 0.18.0, aioquic 1.7.2, h2 4.4.1), how it
  fails if the internals moved, and its scope: *process* (every listener in
  the process gets it) or *listener* (installed process-wide, but takes
  effect only where a listener's config or context variable asks for it).
- It applies itself with ``patch.require`` / ``patch.wrap`` /
  ``patch.replace`` only: what it reaches into is checked when it is
  installed (``PatchError`` at start, never an ``AttributeError``
  mid-request), it is applied once however often ``install`` runs, and a
  wrapper takes ``(self, *args, **kwargs)`` and passes them through.
- ``tests/unit/test_http_stack_<module>.py`` shows the patch taking effect on
  the pinned version with a real connection or the library's own objects:
  it fails if the patch stops working.
- Where the patch fixes a bug or adds a missing hook upstream could take,
  ``docs/upstream/`` holds the same change as a patch against hypercorn.

``check_versions()`` (``versions.py``) is called at process start by every
role that serves HTTP and refuses to start on other versions
(``HEDGEROW_ALLOW_UNTESTED_HTTP_STACK=1``: warn only).

Adding a patch (e.g. QUIC connection-ID steering for ``--processes``)::

    # hedgerow/http_stack/quic_cid_steering.py
    \"\"\"<What it changes> (hypercorn 0.18.0 / aioquic 1.7.2).
    Why: ... If the internals moved: ``PatchError`` at start naming ...
    Scope: process | listener (how).\"\"\"
    from hedgerow.http_stack.patch import wrap
    NAME = "quic_cid_steering"
    def install(...) -> None:
        wrap(QuicProtocol, "handle", lambda original: ..., patch=NAME)

then a row in ``INVENTORY`` below, a test module, and a line in
``docs/architecture.md`` ("HTTP stack").
"""

from __future__ import annotations

from hedgerow.http_stack.patch import APPLIED, PatchError
from hedgerow.http_stack.versions import (ESCAPE_HATCH, PINNED, UntestedHttpStack,
                                          check_versions)

__all__ = ["APPLIED", "ESCAPE_HATCH", "INVENTORY", "PINNED", "PatchError",
           "UntestedHttpStack", "applied", "check_versions"]

# module -> (what it changes, scope). Scope "process": every listener of the
# process; "listener": installed once, in effect only where asked (how: the
# module's docstring).
INVENTORY: dict[str, tuple[str, str]] = {
    "eof": ("hypercorn TCPServer._read_data: stop the keep-alive timer at EOF", "process"),
    "linger": ("hypercorn TCPServer._read_data/protocol_send: a connection the server cuts "
               "drops what its client still sends before closing", "process"),
    "disconnect_hook": ("hypercorn asyncio TaskGroup.spawn_app and HTTPStream.handle: a "
                        "hedgerow.disconnect scope extension fired on StreamClosed", "process"),
    "tls_peer": ("hypercorn TCPServer.run: the verified client certificate, per connection",
                 "process"),
    "write_coalescing": ("hypercorn TCPServer.__init__: the connection's writer replaced",
                         "listener"),
    "accept_loop": ("hypercorn.asyncio.run's asyncio.start_server: the capped accept loop",
                    "listener"),
    "udp_server": ("hypercorn.asyncio.run.UDPServer: screened datagrams, a larger queue, "
                   "a transport that closes", "process"),
    "quic_connection": ("hypercorn.protocol.quic.QuicConnection: bounded flow control and "
                        "session tickets", "process"),
    "quic_certificates": ("hypercorn QuicProtocol.__init__: its QuicConfiguration registered",
                          "listener"),
    "quic_front_door": ("hypercorn QuicProtocol.handle/_handle_events, H3Protocol.handle, "
                        "hypercorn.protocol.h3.H3Connection", "listener"),
    "h2_protocol": ("hypercorn H2Protocol (6 methods) and h2 H2Connection internals: the "
                    "HTTP/2 guard, one flush per read", "process"),
    "quic_cid": ("aioquic QuicConnection.__init__/_replenish_connection_ids: server "
                 "connection ids whose first byte names the process (--processes N)",
                 "process"),
}


def applied() -> dict[str, list[str]]:
    """What each installed patch changed, as ``{patch: ["Owner.attribute", ...]}``."""
    return {name: [f"{getattr(owner, '__name__', owner)}.{attribute}"
                   for owner, attribute, _, _ in changes]
            for name, changes in APPLIED.items()}
