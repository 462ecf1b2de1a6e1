"""Following the control plane: background services, one per stream of state.

``follower`` (the registry of workers, ``/v1/watch``), ``policy_follower``
(policy versions, ACK/NACK, xDS style) and ``key_secret`` (the cluster's
virtual-key secret, fetched once). Each publishes what it learns into state
the request path reads; they reconnect with capped backoff, and the last
known value stays in force while the control plane is away.

Hot path: no -- the request path reads what they published and never waits
on them. They talk to the control plane over HTTP only; nothing here imports
``control_plane``.
"""
