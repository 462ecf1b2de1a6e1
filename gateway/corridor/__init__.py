"""The request corridor: one completion request from admission to its last byte.

``key_gate`` (who is asking; key and budget checks) and ``shared_limits`` /
``shared_budgets`` (the same across gateways, in Redis) → ``tickets`` and the
sans-IO ``scheduler`` (admission, EDF queues, routing, breakers, hedge budget),
entered through ``scheduling`` (the door and the clock task) → ``dispatch``
and ``attempt`` (first token: retry, hedge) → ``generation`` into a
``stream_log`` → ``relay`` to the client. ``dialects`` maps Anthropic's API
onto this one path; ``drain`` tracks what is in flight for a graceful stop;
``embeddings`` and ``embed_route`` serve ``POST /v1/embeddings``.

Hot path: yes -- every module here runs for every completion request (the
embeddings pair for every embeddings request). Upstream I/O is
``gateway.upstream``'s; the ASGI routes that call in here are ``gateway.app``.
"""
