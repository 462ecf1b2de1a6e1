"""Processes inside the PoP namespaces: Hedgerow's own CLI, Redis, the relay, agents."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.pops.netns import PopNetwork
from bench.stack import Proc

ANSWER_TIMEOUT_S = 30.0


@dataclass
class Agent:
    """A ``bench.pops.agent`` in one namespace; ``ask`` it a JSON command."""

    name: str
    popen: subprocess.Popen[bytes]
    buffer: bytes = b""

    def send(self, command: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(orjson.dumps(command) + b"\n")
        self.popen.stdin.flush()

    def answer(self, timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"agent {self.name} gave no answer in {timeout:.0f}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"agent {self.name} exited ({self.popen.poll()})")
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        answer: dict[str, Any] = orjson.loads(line)
        return answer

    def ask(self, command: dict[str, Any], timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        self.send(command)
        return self.answer(timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            assert self.popen.stdin is not None
            self.popen.stdin.close()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class PopProcesses:
    """Every process the harness started, by namespace, with its log in ``root``."""

    net: PopNetwork
    root: Path
    procs: list[Proc] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)

    def spawn(self, namespace: str, name: str, argv: list[str]) -> Proc:
        log_path = self.root / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        popen = subprocess.Popen([*self.net.exec_prefix(namespace), *argv],
                                 stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def hedgerow(self, namespace: str, name: str, *args: str) -> Proc:
        return self.spawn(namespace, name, [sys.executable, "-m", "hedgerow.cli", *args])

    def redis(self, namespace: str, port: int) -> Proc:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        (self.root / "redis").mkdir(exist_ok=True)
        return self.spawn(namespace, "redis", [
            binary, "--port", str(port), "--bind", "0.0.0.0", "--protected-mode", "no",
            "--save", "", "--appendonly", "no", "--dir", str(self.root / "redis")])

    def relay(self, config_path: Path) -> Proc:
        return self.spawn(self.net.wan_namespace, "relay",
                          [sys.executable, "-m", "bench.pops.relay", str(config_path)])

    def agent(self, namespace: str, name: str) -> Agent:
        log = (self.root / f"{name}.log").open("wb")
        popen = subprocess.Popen(
            [*self.net.exec_prefix(namespace), sys.executable, "-m", "bench.pops.agent"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        agent = Agent(name, popen)
        self.agents.append(agent)
        if not agent.answer(60).get("ready"):
            raise RuntimeError(f"agent {name} did not start")
        return agent

    def stop_all(self) -> None:
        for agent in self.agents:
            agent.stop()
        for proc in reversed(self.procs):
            proc.stop(timeout=10)
