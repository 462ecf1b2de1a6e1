"""The systemd units under deploy/systemd: flags the CLI has, drains that
finish before SIGKILL, and a sandbox a security review signs off: a dedicated
user, no capabilities, a read-only system, state and credentials only where
systemd puts them. ``systemd-analyze`` (where installed) checks the syntax and
scores the exposure.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.deploy_recipes import (
    HEDGEROW,
    arg,
    check_command_line,
    unit_command,
    unit_names,
    unit_settings,
    unit_text,
)

UNITS = unit_names()
SECRET_FLAGS = ("--join-token-file", "--admin-token-file", "--metrics-token-file", "--keyfile",
                "--tls-key", "--ca-key")
# Exposure score of `systemd-analyze security` (0 best, 10 worst; under 2: "OK").
MAX_EXPOSURE = 2.0
MAX_PROCESSES = 256  # hedgerow gateway --processes


def test_units_use_only_flags_the_cli_has() -> None:
    commands = set()
    for unit in UNITS:
        argv, _ = unit_command(unit)
        assert argv[0] == HEDGEROW, unit
        command, *args = argv[1:]
        commands.add(command)
        # Values from the env files are unknown here: a number parses as any type.
        sample = [re.sub(r"\$\{\w+\}", "1", a) for a in args]
        try:
            check_command_line(command, sample)
        except AssertionError as error:
            raise AssertionError(f"{unit}: {error}") from error
    assert commands == {"gateway", "worker", "control-plane"}


def unit_ports(unit: str) -> set[int]:
    """The ports a unit listens on: its numeric port flags, and the example
    value of a port its env file sets (the worker's)."""
    argv, _ = unit_command(unit)
    ports = {int(v) for flag in ("--port", "--join-port", "--admin-port")
             for v in arg(argv, flag) if v.isdigit()}
    ports |= {int(p) for p in re.findall(r"HEDGEROW_\w*PORT=(\d+)", unit_text(unit))}
    return ports


def test_the_gateways_admin_ports_clear_every_other_port_whatever_the_core_count() -> None:
    """The gateway unit runs one process per core, process i with its admin
    listener on --admin-port + i: up to 256 of them must not reach a port of
    the control plane or a worker on the same host, nor the gateway's own."""
    argv, _ = unit_command("hedgerow-gateway.service")
    first = int(arg(argv, "--admin-port")[0])
    assert not arg(argv, "--processes"), "the unit keeps every core (the default)"
    admin = set(range(first, first + MAX_PROCESSES))
    others = {p for unit in UNITS for p in unit_ports(unit)} - {first}
    assert 8500 in others and 8600 in others  # the control plane's and a worker's were read
    assert not admin & others, sorted(admin & others)


@pytest.mark.parametrize("unit", UNITS)
def test_units_stop_with_sigterm_and_wait_for_the_drain(unit: str) -> None:
    text = unit_text(unit)
    assert "KillSignal=SIGTERM" in text
    timeout = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M)[1])  # type: ignore[index]
    drain = re.search(r"--drain-timeout-s (\d+)", text)
    assert drain is None or timeout > int(drain[1]) + 2


@pytest.mark.parametrize("unit", UNITS)
def test_units_run_sandboxed_as_a_dedicated_user_without_capabilities(unit: str) -> None:
    settings = unit_settings(unit)

    def one(key: str) -> str:
        values = settings.get(key)
        assert values, f"{unit}: no {key}="
        return values[-1]

    assert one("User") not in ("root", "0") and one("Group") not in ("root", "0")
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "PrivateDevices": "yes", "ProtectKernelTunables": "yes",
                       "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
                       "RestrictNamespaces": "yes", "RestrictSUIDSGID": "yes",
                       "LockPersonality": "yes", "SystemCallArchitectures": "native",
                       "UMask": "0077"}.items():
        assert one(key) == value, f"{unit}: {key}={one(key)}"
    assert one("CapabilityBoundingSet") == "", f"{unit}: keeps capabilities"
    assert settings.get("AmbientCapabilities", [""])[-1] == "", f"{unit}: grants capabilities"
    families = set(one("RestrictAddressFamilies").split())
    assert families <= {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}, unit
    assert "@system-service" in settings["SystemCallFilter"]
    assert not settings.get("ReadWritePaths"), f"{unit}: writes only its StateDirectory"


@pytest.mark.parametrize("unit", UNITS)
def test_state_and_identity_live_in_the_units_own_state_directory(unit: str) -> None:
    settings = unit_settings(unit)
    (state_directory,) = settings["StateDirectory"]
    assert settings["StateDirectoryMode"] == ["0700"]
    own = f"/var/lib/{state_directory}"
    argv, _ = unit_command(unit)
    written = arg(argv, "--state-dir") + arg(argv, "--identity-dir")
    assert written, f"{unit}: keeps its identity nowhere"
    for path in written:
        assert path == own or path.startswith(own + "/"), f"{unit}: {path} outside {own}"


@pytest.mark.parametrize("unit", UNITS)
def test_secrets_come_from_credentials_never_from_the_unit_or_its_environment(unit: str) -> None:
    settings = unit_settings(unit)
    credentials = dict(c.split(":", 1) for c in settings.get("LoadCredential", []))
    argv, prelude = unit_command(unit)
    for flag in SECRET_FLAGS:
        for path in arg(argv, flag):
            name = path.removeprefix("%d/")
            assert path.startswith("%d/") and name in credentials, \
                f"{unit}: {flag} {path} is not a credential"
            assert credentials[name].startswith("/etc/hedgerow/credentials/")
    if argv[1] != "control-plane":
        assert arg(argv, "--join-token-file"), f"{unit}: joins without a token file"
    for line in settings.get("Environment", []):
        name = line.split("=", 1)[0]
        assert not re.search(r"TOKEN|PASSWORD|SECRET|KEY|REDIS_URL", name), f"{unit}: {line}"
    assert "--redis" not in argv, "a Redis URL as an argument shows its password"


@pytest.mark.parametrize("unit", ["hedgerow-gateway.service", "hedgerow-control-plane.service"])
def test_metrics_open_with_a_read_only_token_prometheus_can_hold(unit: str) -> None:
    # Prometheus must not need the admin token (it purges caches, applies
    # policies): each unit with an admin API is given a metrics token too.
    credentials = dict(c.split(":", 1) for c in unit_settings(unit)["LoadCredential"])
    argv, _ = unit_command(unit)
    (admin,) = arg(argv, "--admin-token-file")
    (metrics,) = arg(argv, "--metrics-token-file")
    assert metrics != admin and metrics.removeprefix("%d/") in credentials
    assert credentials[metrics.removeprefix("%d/")] != credentials[admin.removeprefix("%d/")]


@pytest.mark.parametrize("unit", [u for u in UNITS if "--redis-ca-file" in unit_text(u)])
def test_redis_is_reached_over_tls_with_the_password_credential(unit: str) -> None:
    credentials = dict(c.split(":", 1) for c in unit_settings(unit)["LoadCredential"])
    argv, prelude = unit_command(unit)
    assert prelude is not None
    url = re.fullmatch(r'export HEDGEROW_REDIS_URL="([^"]+)"', prelude)
    assert url is not None, prelude
    # `$$` is systemd's literal `$`: the shell reads the credential at start.
    assert url[1] == "rediss://hedgerow:$$(cat %d/redis-password)@${HEDGEROW_REDIS_ADDR}/0"
    assert "redis-password" in credentials
    assert arg(argv, "--redis-ca-file")


def test_the_worker_unit_needs_no_redis_and_the_others_do() -> None:
    using = {unit for unit in UNITS if unit_command(unit)[1] is not None}
    assert using == {"hedgerow-control-plane.service", "hedgerow-gateway.service"}


def installed_copy(unit: str, directory: Path) -> Path:
    """The unit as installed, with a stand-in for the venv's executable; a
    template is instantiated (verify needs an instance)."""
    stand_in = directory / "hedgerow"
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    name = unit.replace("@.service", "@ams-1.service")
    copy = directory / name
    copy.write_text(unit_text(unit).replace(HEDGEROW, str(stand_in)))
    return copy


# `make test` installs Debian's systemd for it: a missing one is a failure, not a skip.
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "systemd-analyze"


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_accepts_every_line_of_the_unit(unit: str, tmp_path: Path) -> None:
    copy = installed_copy(unit, tmp_path)
    done = subprocess.run([str(SYSTEMD_ANALYZE), "verify", str(copy)], capture_output=True,
                          text=True, timeout=60, check=False)
    # systemd ignores a misspelt or malformed setting with a warning only.
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), \
        done.stderr + done.stdout


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_rates_the_units_exposure_low(unit: str, tmp_path: Path) -> None:
    copy = installed_copy(unit, tmp_path)
    done = subprocess.run([str(SYSTEMD_ANALYZE), "security", "--offline=yes", "--no-pager",
                           str(copy)], capture_output=True, text=True, timeout=60, check=False)
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout + done.stderr)
    assert score is not None, done.stdout + done.stderr
    assert float(score[1]) <= MAX_EXPOSURE, done.stdout
