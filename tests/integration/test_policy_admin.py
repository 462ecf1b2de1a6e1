"""Operator policy against a real control-plane process: the admin API, the
``hedgerow policy`` commands and the watched policy directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.stack import Stack, wait_for

POLICY = """\
# the policy the control plane starts with
classes:
  - {name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}
tenants:
  - name: local
    class: interactive
anonymous_tenant: local
limits:
  max_tokens: 100
"""
TYPO = POLICY.replace("  max_tokens: 100", "  max_tokenz: 200")  # line 9


def with_max_tokens(tokens: int) -> str:
    return POLICY.replace("max_tokens: 100", f"max_tokens: {tokens}")


def hedgerow(*args: str, cwd: Path | None = None,
             stack: Stack | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI; as the admin of ``stack`` (its admin credential) when given."""
    env = dict(stack.admin_env() if stack else os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "hedgerow.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    root = tmp_path_factory.mktemp("policy")
    (root / "initial.yaml").write_text(POLICY)
    watched = root / "policies"
    watched.mkdir()
    stack = Stack(root)
    stack.start_control_plane(policy=root / "initial.yaml", policy_dir=watched)
    try:
        yield stack, watched
    finally:
        stack.stop_all()


def get(stack: Stack, path: str) -> httpx.Response:
    with stack.admin() as admin:
        return admin.get(path)


def current(stack: Stack) -> dict[str, Any]:
    return dict(get(stack, "/v1/policy").json())


def post(stack: Stack, path: str, text: str = "", source: str = "") -> httpx.Response:
    params = {"source": source} if source else None
    with stack.admin() as admin:
        return admin.post(path, content=text.encode(), params=params)


def test_apply_validate_history_and_rollback_over_http(plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    start = current(stack)
    assert start["text"] == POLICY and start["source"].endswith("initial.yaml")

    refused = post(stack, "/v1/policy/validate", TYPO, source="ops/edge.yaml")
    assert refused.status_code == 400
    assert refused.json()["issues"] == [{
        "source": "ops/edge.yaml", "line": 9, "column": 3, "path": "limits.max_tokenz",
        "message": "unknown key 'max_tokenz' (did you mean 'max_tokens'?)"}]
    assert refused.json()["error"]["code"] == "invalid_policy"
    assert post(stack, "/v1/policy", TYPO).status_code == 400
    assert current(stack) == start  # nothing half-applied

    checked = post(stack, "/v1/policy/validate", with_max_tokens(300))
    assert checked.status_code == 200 and checked.json()["checksum"] != start["checksum"]
    applied = post(stack, "/v1/policy", with_max_tokens(300), source="edge.yaml")
    assert applied.status_code == 201
    assert applied.json() | {"applied_at": 0} == {
        "version": start["version"] + 1, "checksum": checked.json()["checksum"],
        "source": "edge.yaml", "changed": True, "applied_at": 0}
    again = post(stack, "/v1/policy", "# same content\n" + with_max_tokens(300))
    assert again.status_code == 200 and again.json()["changed"] is False
    assert again.json()["version"] == applied.json()["version"]

    rolled = post(stack, f"/v1/policy/rollback/{start['version']}")
    assert rolled.status_code == 201 and rolled.json()["checksum"] == start["checksum"]
    assert current(stack)["text"] == POLICY
    history = get(stack, "/v1/policy/history").json()
    assert [v["version"] for v in history["versions"]][-3:] == [
        start["version"], start["version"] + 1, start["version"] + 2]
    assert history["current"] == rolled.json()["version"]
    old = get(stack, f"/v1/policy/{start['version'] + 1}").json()
    assert old["text"] == with_max_tokens(300)
    assert get(stack, "/v1/policy/999").status_code == 404
    assert post(stack, "/v1/policy/rollback/999").status_code == 404


def test_cli_applies_shows_lists_and_rolls_back(plane: tuple[Stack, Path], tmp_path: Path) -> None:
    stack, _ = plane
    url = ["--control-plane", stack.control_plane_url]
    (tmp_path / "bad.yaml").write_text(TYPO)
    (tmp_path / "good.yaml").write_text(with_max_tokens(400))
    before = current(stack)

    bad = hedgerow("policy", "apply", "bad.yaml", *url, cwd=tmp_path, stack=stack)
    assert bad.returncode == 1
    assert bad.stdout.startswith("bad.yaml:9:3: limits.max_tokenz: unknown key 'max_tokenz'")
    assert "not applied" in bad.stderr
    assert current(stack) == before

    good = hedgerow("policy", "apply", "good.yaml", *url, cwd=tmp_path, stack=stack)
    assert good.returncode == 0, good.stderr
    assert f"as policy v{before['version'] + 1}" in good.stdout
    shown = hedgerow("policy", "show", *url, stack=stack)
    assert shown.returncode == 0 and shown.stdout == with_max_tokens(400)
    listed = hedgerow("policy", "history", *url, stack=stack)
    assert f"* {before['version'] + 1:>7}" in listed.stdout and "good.yaml" in listed.stdout

    rolled = hedgerow("policy", "rollback", str(before["version"]), *url, stack=stack)
    assert rolled.returncode == 0, rolled.stderr
    assert current(stack)["checksum"] == before["checksum"]
    missing = hedgerow("policy", "show", "999", *url, stack=stack)
    assert missing.returncode == 1 and "no policy version 999" in missing.stderr


def test_cli_says_when_the_control_plane_is_unreachable(plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    for url in ("https://127.0.0.1:9", "http://127.0.0.1:9"):  # with the admin credential
        result = hedgerow("policy", "history", "--control-plane", url, stack=stack)
        assert result.returncode == 3
        assert f"cannot reach the control plane at {url}" in result.stderr


def test_watched_directory_applies_edits_and_keeps_the_last_good_policy(
    plane: tuple[Stack, Path],
) -> None:
    stack, watched = plane
    (watched / "edge.yaml").write_text(with_max_tokens(500))
    applied = wait_for(lambda: (p := current(stack))["source"].endswith("edge.yaml") and p,
                       "the watched file to be applied", timeout=10)
    assert applied["text"] == with_max_tokens(500)

    (watched / "edge.yaml").write_text(TYPO)
    log = stack.procs[0]
    wait_for(lambda: f"{watched / 'edge.yaml'}:9:3: limits.max_tokenz" in log.log(),
             "the rejection to be logged", timeout=10)
    time.sleep(0.6)  # one more poll: still nothing applied
    assert current(stack) == applied


def test_control_plane_refuses_to_start_with_an_invalid_policy(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(TYPO)
    result = hedgerow("control-plane", "--port", "0", "--policy", str(tmp_path / "bad.yaml"),
                      "--state-dir", str(tmp_path / "state"), "--join-port", "0")
    assert result.returncode == 1
    assert f"{tmp_path / 'bad.yaml'}:9:3: limits.max_tokenz" in result.stderr


def test_validate_offline_prints_the_checksum_or_every_problem(tmp_path: Path) -> None:
    (tmp_path / "good.yaml").write_text(POLICY)
    (tmp_path / "bad.yaml").write_text(TYPO.replace("ttft_slo_ms: 1000", "ttft_slo_ms: soon")
                                       + "routing: {allow_cpu_fallback: maybe}\n")
    good = hedgerow("policy", "validate", "good.yaml", cwd=tmp_path)
    assert good.returncode == 0
    checksum = good.stdout.split()[-1]
    assert good.stdout == f"good.yaml: valid; checksum {checksum}\n" and len(checksum) == 64

    bad = hedgerow("policy", "validate", "bad.yaml", cwd=tmp_path)
    assert bad.returncode == 1
    assert bad.stdout.splitlines() == [
        "bad.yaml:3:38: classes[0].ttft_slo_ms: Input should be a valid integer, "
        "unable to parse string as an integer",
        "bad.yaml:9:3: limits.max_tokenz: unknown key 'max_tokenz' (did you mean 'max_tokens'?)",
        "bad.yaml:10:31: routing.allow_cpu_fallback: Input should be a valid boolean, "
        "unable to interpret input",
    ]
    missing = hedgerow("policy", "validate", "nope.yaml", cwd=tmp_path)
    assert missing.returncode == 1 and "cannot read nope.yaml" in missing.stderr
