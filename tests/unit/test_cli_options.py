"""The command line as an operator meets it: ``--version``, help on every option,
and every option settable from the environment (hedgerow.cli_env)."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from hedgerow.cli import build_parser, main
from hedgerow.cli_env import EnvironmentValueError, env_name, long_option, options, walk


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"hedgerow {importlib.metadata.version('hedgerow')}"


def test_every_option_and_argument_of_every_subcommand_has_help() -> None:
    missing = []
    for command, parser in walk(build_parser({})):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip():
                name = long_option(action) if action.option_strings else action.dest
                missing.append(f"hedgerow {' '.join(command)} {name}")
    assert not missing, "no help text: " + ", ".join(missing)


def test_every_option_names_its_environment_variable_and_names_are_unique() -> None:
    seen: dict[str, str] = {}
    for command, parser in walk(build_parser({})):
        for action in options(parser):
            name = env_name(command, long_option(action))
            assert f"[env {name}]" in (action.help or ""), (command, action.option_strings)
            where = f"{' '.join(command)} {long_option(action)}"
            assert seen.setdefault(name, where) == where or name == "HEDGEROW_JOIN_TOKEN", \
                f"{name} names both {seen[name]} and {where}"
            seen[name] = where


def test_command_line_beats_environment_beats_default() -> None:
    env = {"HEDGEROW_GATEWAY_PORT": "9443", "HEDGEROW_GATEWAY_DRAIN_TIMEOUT_S": "7.5",
           "HEDGEROW_GATEWAY_HOST": "127.0.0.2,::1", "HEDGEROW_WORKER_PORT": "7000"}
    args = build_parser(env).parse_args(["gateway"])
    assert (args.port, args.drain_timeout_s, args.host) == (9443, 7.5, ["127.0.0.2", "::1"])
    args = build_parser(env).parse_args(["gateway", "--port", "1234", "--host", "10.0.0.1"])
    assert (args.port, args.host) == (1234, ["10.0.0.1"])
    # Scoped: the gateway's variable leaves the others alone.
    assert build_parser(env).parse_args(["control-plane"]).port == 8500
    assert build_parser(env).parse_args(["worker"]).port == 7000
    assert build_parser({}).parse_args(["gateway"]).port == 8443


def test_switches_paths_nested_commands_and_required_options_from_environment() -> None:
    env = {"HEDGEROW_WORKER_NO_WARM_UP": "true", "HEDGEROW_WORKER_INSECURE_INTERNAL": "0",
           "HEDGEROW_WORKER_STATE_DIR": "/var/lib/hedgerow",
           "HEDGEROW_CACHE_PURGE_TENANT": "acme", "HEDGEROW_TOKEN_CREATE_ROLE": "worker",
           "HEDGEROW_BENCH_RUN_RATE": "5"}
    parser = build_parser(env)
    worker = parser.parse_args(["worker"])
    assert (worker.warm_up, worker.insecure_internal) == (False, False)
    assert worker.state_dir == Path("/var/lib/hedgerow")
    assert build_parser(env).parse_args(["worker", "--insecure-internal"]).insecure_internal
    assert build_parser(env).parse_args(["cache", "purge"]).tenant == "acme"
    assert build_parser(env).parse_args(["token", "create"]).role == "worker"
    assert build_parser(env).parse_args(["bench", "run", "https://x"]).rate == 5.0


def test_shared_variables_from_before_the_scheme_still_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"HEDGEROW_REDIS_URL": "redis://shared", "HEDGEROW_POP": "ams",
           "HEDGEROW_LOG_FORMAT": "json", "HEDGEROW_ADMIN_IDENTITY": "/etc/admin"}
    for key, value in env.items():  # the shared names are read by the options' defaults
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(["gateway"])
    assert (args.redis, args.pop, args.log_format) == ("redis://shared", "ams", "json")
    assert build_parser().parse_args(["status"]).admin_identity == Path("/etc/admin")
    scoped = build_parser({**env, "HEDGEROW_GATEWAY_REDIS": "redis://mine"})
    assert scoped.parse_args(["gateway"]).redis == "redis://mine"


@pytest.mark.parametrize("env", [{"HEDGEROW_GATEWAY_PORT": "eighty"},
                                 {"HEDGEROW_WORKER_BACKEND": "gpt"},
                                 {"HEDGEROW_WORKER_NO_WARM_UP": "maybe"}])
def test_a_bad_value_names_its_variable(env: dict[str, str]) -> None:
    with pytest.raises(EnvironmentValueError, match=next(iter(env))):
        build_parser(env)


def test_help_never_shows_secrets_from_the_environment() -> None:
    secret = "s3cret-4f1d9a"
    env = {"HEDGEROW_JOIN_TOKEN": secret, "HEDGEROW_REDIS_URL": f"rediss://u:{secret}@r:6380",
           "HEDGEROW_WORKER_JOIN_TOKEN_FILE": f"/run/{secret}",
           "HEDGEROW_GATEWAY_REDIS": f"rediss://u:{secret}@r:6380",
           "HEDGEROW_ADMIN_TOKEN": secret, "PATH": "/usr/bin:/bin"}
    for command in ("worker", "gateway", "control-plane", "status"):
        shown = subprocess.run([sys.executable, "-m", "hedgerow.cli", command, "--help"],
                               env={**env, "PYTHONPATH": ":".join(sys.path)},
                               capture_output=True, text=True, timeout=60, check=True)
        assert secret not in shown.stdout + shown.stderr, command
        assert "HEDGEROW_" in shown.stdout
