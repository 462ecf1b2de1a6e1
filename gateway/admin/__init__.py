"""The operator's view of a gateway: admin API, metrics, access log, span attributes.

``api`` (cache purge and stats on the admin listener, and the client
``hedgerow cache purge`` uses), ``metrics`` (the Prometheus registry and each
request's ``RequestMetrics``), ``usage_metrics`` (usage per tenant, GenAI
names), ``access_log`` (one JSON line per request) and ``tracing_attributes``
(what a request's span says).

Hot path: recorded on it, never deciding anything -- ``RequestMetrics``,
the access log line and span attributes are written for every request, so
their cost counts; ``api`` runs on its own listener, off the public port.
"""
