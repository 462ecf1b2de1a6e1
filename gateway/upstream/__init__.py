"""Talking to workers: the gateway's own HTTP/1.1 client.

``client`` (``WorkerClient``: one request to one worker, its errors mapped
once), over ``worker_http`` (the keep-alive connection pool, reading straight
from an ``asyncio.Protocol``), over ``http1`` (response framing, sans-IO).
The in-memory twin for tests is ``tests.support.worker_mock``.

Hot path: yes -- every attempt, and every relayed chunk, goes through here.
"""
