"""Two gateway processes on one Redis (``--redis``) in front of one simulated worker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.redis_server import RedisServer
from tests.support.stack import Proc, Stack


@dataclass
class Gateways:
    stack: Stack
    redis: RedisServer
    urls: tuple[str, str]
    procs: tuple[Proc, Proc]


def start_two_gateways(root: Path, policy_text: str, redis: RedisServer,
                       worker_args: list[str]) -> Gateways:
    """Control plane, worker ``sim-1`` and gateways ``gw-a``/``gw-b`` sharing
    ``redis``; the caller stops them (``gateways.stack.stop_all()``)."""
    policy = root / "policy.yaml"
    policy.write_text(policy_text)
    stack = Stack(root)
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *worker_args)
        urls, procs = [], []
        for name in ("a", "b"):
            procs.append(stack.start_gateway("--policy", str(policy), "--redis", redis.url,
                                             "--gateway-id", f"gw-{name}"))
            urls.append(stack.gateway_url)
    except BaseException:
        stack.stop_all()
        raise
    return Gateways(stack, redis, (urls[0], urls[1]), (procs[0], procs[1]))
