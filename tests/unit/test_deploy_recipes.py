"""The deployment recipes under deploy/ stay in step with the code.

Kubernetes manifests must be valid API objects and give each gateway a PoP of
the policy's topology, readiness on /readyz and time to drain; every
``hedgerow`` flag the manifests and systemd units pass must exist in the CLI;
the container image must install with the same steps as ``make run``.
"""

from __future__ import annotations

import argparse
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hedgerow.cli import build_parser
from policies.schema import parse_policy

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.31"


def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def containers(kind: str | None = None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for _, doc in manifests():
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet") and kind in (None, doc["kind"]):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def hedgerow_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(d, c) for d, c in containers() if c["image"] == "hedgerow"]


def subcommand_flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subparsers.choices[command]
    return {flag for action in sub._actions for flag in action.option_strings}


def flags_of(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def arg(args: list[str], flag: str) -> list[str]:
    """Every value given to ``--flag`` (as ``--flag=value`` or ``--flag value``)."""
    values = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            values.append(a.split("=", 1)[1])
        elif a == flag:
            values.append(args[i + 1])
    return values


def test_every_manifest_is_a_valid_kubernetes_object() -> None:
    for name, doc in manifests():
        if doc["kind"] == "Kustomization":
            listed = set(doc["resources"])
            assert listed == {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} - {name}
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_hedgerow_flag_in_the_manifests_exists() -> None:
    parser = build_parser()
    seen = set()
    for doc, container in hedgerow_containers():
        command, *args = container["args"]
        seen.add(command)
        unknown = set(flags_of(args)) - subcommand_flags(parser, command)
        assert not unknown, f"{doc['metadata']['name']}: hedgerow {command} has no {unknown}"
        parser.parse_args([command, *args])  # values of the right types too
    assert seen == {"gateway", "worker", "control-plane"}


def policy() -> Any:
    config = next(d for _, d in manifests() if d["kind"] == "ConfigMap"
                  and d["metadata"]["name"] == "hedgerow-policy")
    return parse_policy(config["data"]["policy.yaml"], "deploy/kubernetes/policy.yaml")


def test_one_gateway_per_pop_of_the_topology_ready_on_readyz_with_time_to_drain() -> None:
    pops = {p.name for p in policy().topology.pops}
    gateways = [(d, c) for d, c in hedgerow_containers() if c["args"][0] == "gateway"]
    assert sorted(p for _, c in gateways for p in arg(c["args"], "--pop")) == sorted(pops)
    for doc, container in gateways:
        spec = doc["spec"]
        assert spec["replicas"] == 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        drain = float(arg(container["args"], "--drain-timeout-s")[0])
        pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
        grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > pre_stop + drain + 2, "SIGKILL would cut streams still draining"
        assert arg(container["args"], "--redis") == ["redis://redis:6379/0"]


def test_workers_are_labelled_with_a_declared_pop_and_drain_before_sigkill() -> None:
    pops = {p.name for p in policy().topology.pops}
    workers = [(d, c) for d, c in hedgerow_containers() if c["args"][0] == "worker"]
    assert workers
    for doc, container in workers:
        labels = dict(v.split("=", 1) for v in arg(container["args"], "--label"))
        assert labels["pop"] in pops
        assert labels["pop"] == doc["spec"]["template"]["spec"]["nodeSelector"]["hedgerow.dev/pop"]
        drain = float(arg(container["args"], "--drain-timeout-s")[0])
        assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_control_planes_share_redis_and_the_policy() -> None:
    cps = [(d, c) for d, c in hedgerow_containers() if c["args"][0] == "control-plane"]
    assert cps and all(arg(c["args"], "--redis") == ["redis://redis:6379/0"] for _, c in cps)
    services = {d["metadata"]["name"] for _, d in manifests() if d["kind"] == "Service"}
    assert {"redis", "hedgerow-control-plane"} <= services


def systemd_exec_starts() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        for line in path.read_text().splitlines():
            if line.startswith("ExecStart="):
                found.append((path.name, shlex.split(line.removeprefix("ExecStart="))))
    return found


def test_systemd_units_use_only_flags_the_cli_has() -> None:
    parser = build_parser()
    commands = set()
    for unit, argv in systemd_exec_starts():
        assert argv[0] == "/opt/hedgerow/.venv/bin/hedgerow", unit
        command, *args = argv[1:]
        commands.add(command)
        unknown = set(flags_of(args)) - subcommand_flags(parser, command)
        assert not unknown, f"{unit}: hedgerow {command} has no {unknown}"
    assert commands == {"gateway", "worker", "control-plane"}


def make_variables(text: str) -> dict[str, str]:
    return {m[1]: m[2].strip() for m in re.finditer(r"^(\w+)\s*[:?]?=\s*(.*)$", text, re.M)}


def test_the_image_installs_with_the_same_steps_as_make_run() -> None:
    makefile = (ROOT / "Makefile").read_text()
    variables = make_variables(makefile)
    run_deps = re.search(r"^run:\s*(.*)$", makefile, re.M)
    assert run_deps is not None and run_deps[1].strip() == "$(STAMP)"
    stamp = variables["STAMP"].replace("$(VENV)", variables["VENV"])
    recipe = (DEPLOY / "Containerfile").read_text()
    runs = [line for line in recipe.splitlines() if line.startswith("RUN make ")]
    assert [shlex.split(line)[2] for line in runs] == [stamp]
    # Everything the install needs is in the image: the packages pyproject names.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {part.strip("./") for line in recipe.splitlines() if line.startswith("COPY ")
              for part in line.split()[1:-1]}
    assert packages | {"pyproject.toml", "Makefile", pyproject["project"]["readme"]} <= copied
    entrypoint = re.search(r"^ENTRYPOINT (.*)$", recipe, re.M)
    assert entrypoint is not None and stamp.split("/")[0] in entrypoint[1]


@pytest.mark.parametrize("unit", sorted(p.name for p in (DEPLOY / "systemd").glob("*.service")))
def test_units_stop_with_sigterm_and_wait_for_the_drain(unit: str) -> None:
    text = (DEPLOY / "systemd" / unit).read_text()
    assert "KillSignal=SIGTERM" in text
    timeout = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M)[1])  # type: ignore[index]
    drain = re.search(r"--drain-timeout-s (\d+)", text)
    assert drain is None or timeout > int(drain[1]) + 2
