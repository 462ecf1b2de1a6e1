"""Reading the deployment recipes under deploy/ for the tests that check them.

The Kubernetes manifests as the API server would get them from
``kubectl apply -k`` (images as the kustomization rewrites them), the
``hedgerow`` command lines in the manifests and the systemd units, and the
flags of the CLI contract that the code does not have yet.
"""

from __future__ import annotations

import argparse
import functools
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from hedgerow.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob")
HEDGEROW = "/opt/hedgerow/.venv/bin/hedgerow"

# The zero-trust plane's CLI contract, being built in parallel: the recipes
# already pass these. While the parser lacks one of them it is accepted
# unparsed; once the parser has it, the real parser checks it and its value.
PLANNED_FLAGS: dict[str, frozenset[str]] = {
    "control-plane": frozenset({"--state-dir", "--join-port", "--cert-ttl-s", "--ca-cert",
                                "--ca-key", "--insecure-internal", "--redis-ca-file"}),
    "gateway": frozenset({"--join-url", "--join-token-file", "--ca-file", "--ca-pin",
                          "--identity-dir", "--tls-cert", "--tls-key", "--redis-ca-file"}),
    "worker": frozenset({"--join-url", "--join-token-file", "--ca-file", "--ca-pin",
                         "--identity-dir", "--tls-cert", "--tls-key"}),
}
# Flags that never take a value (the rest of the contract's flags take one).
PLANNED_SWITCHES = frozenset({"--insecure-internal"})


@functools.cache  # read-only: many tests ask, the files do not change during a run
def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    return next(doc for doc in of_kind(kind) if doc["metadata"]["name"] == name)


def workloads() -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] in WORKLOADS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def containers(kind: str | None = None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in workloads():
        if kind in (None, doc["kind"]):
            for container in pod_spec(doc)["containers"]:
                yield doc, container


def hedgerow_containers(command: str | None = None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(d, c) for d, c in containers()
            if c["image"].startswith("hedgerow-") and command in (None, c["args"][0])]


def effective_image(image: str) -> str:
    """The image reference after the kustomization's ``images:`` rewrite."""
    kustomization = next(d for _, d in manifests() if d["kind"] == "Kustomization")
    name, _, tag = image.partition(":")
    for rule in kustomization.get("images", []):
        if rule["name"] == name:
            name = rule.get("newName", name)
            tag = str(rule.get("newTag", tag))
            if "digest" in rule:
                return f"{name}@{rule['digest']}"
    return f"{name}:{tag}" if tag else name


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def mounted_volume(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume (and its mount) under which ``path`` lies in ``container``, deepest first."""
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    for mount in mounts:
        if path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/"):
            claims = {t["metadata"]["name"]: {"name": t["metadata"]["name"],
                                               "persistentVolumeClaim": t["spec"]}
                      for t in spec.get("_claims", [])}
            volumes = {v["name"]: v for v in spec.get("volumes", [])} | claims
            return {"mount": mount, **volumes[mount["name"]]}
    return None


def mounted(workload: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any] | None:
    spec = dict(pod_spec(workload))
    spec["_claims"] = workload["spec"].get("volumeClaimTemplates", [])
    return mounted_volume(spec, container, path)


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


def subcommand_flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subparsers.choices[command]
    return {flag for action in sub._actions for flag in action.option_strings}


def check_command_line(command: str, args: list[str]) -> None:
    """Every flag exists (in the parser or the contract) and the parser takes the values."""
    parser = build_parser()
    known = subcommand_flags(parser, command)
    unknown = set(flags_of(args)) - known - PLANNED_FLAGS[command]
    assert not unknown, f"hedgerow {command} has no {sorted(unknown)}"
    parser.parse_args([command, *without_planned(args, PLANNED_FLAGS[command] - known)])


def without_planned(args: list[str], planned: frozenset[str] | set[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in planned:
            skip = "=" not in a and flag not in PLANNED_SWITCHES
            continue
        kept.append(a)
    return kept


def unit_text(unit: str) -> str:
    return (DEPLOY / "systemd" / unit).read_text()


def unit_names() -> list[str]:
    return sorted(p.name for p in (DEPLOY / "systemd").glob("*.service"))


def unit_settings(unit: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit, every value of a key in order (comments dropped)."""
    settings: dict[str, list[str]] = {}
    for line in unit_text(unit).splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def unit_command(unit: str) -> tuple[list[str], str | None]:
    """The ``hedgerow`` argv a unit starts, and the shell line that sets up its
    environment first (for ``/bin/sh -c '...; exec hedgerow ...'``), if any."""
    (exec_start,) = unit_settings(unit)["ExecStart"]
    argv = shlex.split(exec_start)
    if argv[0] != "/bin/sh":
        return argv, None
    assert argv[1] == "-c" and len(argv) == 3, f"{unit}: /bin/sh -c 'SCRIPT' only"
    prelude, sep, command = argv[2].rpartition("; exec ")
    assert sep, f"{unit}: the shell must exec hedgerow"
    return shlex.split(command), prelude
