"""The edge: what a client's bytes meet before the request corridor.

Hypercorn serving the app on one port (``transport``: TLS over TCP for h1/h2,
QUIC for h3) and every adaptation of hypercorn and aioquic (``h2_guard``,
``quic_cap``, ``write_coalescing``), the sans-IO decisions those adapters ask
(``h2_budget``, ``quic_admission``), TLS state (``cert_reload``,
``ticket_keys``, ``quic_tickets``, ``devcert``), and the browser-facing layer
around the app (``cors``, ``security_headers``, the chat page in ``page``).

Hot path: yes, per connection and per frame/datagram -- ``transport``,
``h2_guard``/``h2_budget``, ``quic_cap``/``quic_admission`` and
``write_coalescing`` run on every read and write; ``cors`` and
``security_headers`` wrap every request. Off it: certificate and ticket-key
rotation (timers), ``devcert`` (start-up), ``page`` (``GET /`` only).
"""
