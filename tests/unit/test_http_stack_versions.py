"""``check_versions``: the roles refuse to serve on a hypercorn/aioquic/h2 the
patches in ``hedgerow.http_stack`` were not tested on."""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest

from hedgerow import cli
from hedgerow.http_stack import ESCAPE_HATCH, PINNED, UntestedHttpStack, check_versions


def _installed(**found: str | None) -> dict[str, str | None]:
    return {**PINNED, **found}


def test_the_installed_versions_are_the_pinned_ones() -> None:
    # The patches reach into private code: a new version must be re-read first.
    assert {name: version(name) for name in PINNED} == dict(PINNED)
    check_versions(environ={})  # does not raise


def test_another_hypercorn_is_refused_with_what_to_do() -> None:
    found = _installed(hypercorn="0.18.1")
    with pytest.raises(UntestedHttpStack) as refused:
        check_versions(environ={}, installed=found.get)
    message = str(refused.value)
    assert "hypercorn 0.18.1 is installed" in message
    assert f"hypercorn=={PINNED['hypercorn']}" in message
    assert ESCAPE_HATCH in message and "aioquic" not in message


def test_every_mismatch_is_named() -> None:
    found = _installed(aioquic="1.8.0", h2="4.3.0")
    with pytest.raises(UntestedHttpStack, match=r"aioquic 1\.8\.0 .*h2 4\.3\.0"):
        check_versions(environ={}, installed=found.get)


def test_a_role_without_aioquic_starts() -> None:
    # The control plane and workers are installed without the gateway extra.
    check_versions(environ={}, installed=_installed(aioquic=None).get)


def test_the_escape_hatch_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    found = _installed(h2="4.5.0")
    with caplog.at_level(logging.WARNING, logger="hedgerow.http_stack"):
        check_versions(environ={ESCAPE_HATCH: "1"}, installed=found.get)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "h2 4.5.0 is installed" in line and "Serving anyway" in line
    with pytest.raises(UntestedHttpStack):  # only "1" opens it
        check_versions(environ={ESCAPE_HATCH: "yes"}, installed=found.get)


def test_the_cli_reports_a_refusal_without_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    def run() -> None:
        raise BaseExceptionGroup("serving", [UntestedHttpStack("hypercorn 9 is installed")])

    with caplog.at_level(logging.ERROR, logger="hedgerow"):
        assert cli._run_reporting_setup_errors(run) == 1
    assert "cannot start: hypercorn 9 is installed" in caplog.text


@pytest.mark.anyio
async def test_every_role_checks_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hypercorn other than the pinned one (as seen by the check): each role's
    # entry refuses before it touches its options or binds anything.
    import anyio

    from control_plane.main import run_control_plane
    from gateway.main import run_gateway
    from hedgerow.http_stack import versions
    from workers.main import run_worker

    monkeypatch.setattr(versions, "PINNED", {**PINNED, "hypercorn": "0.0.1"})
    monkeypatch.delenv(ESCAPE_HATCH, raising=False)
    starts = (lambda: run_gateway(None, anyio.Event()),  # type: ignore[arg-type]
              lambda: run_control_plane("127.0.0.1", 0, anyio.Event()),
              lambda: run_worker(None, None, anyio.Event()))  # type: ignore[arg-type]
    for start in starts:
        with pytest.raises(UntestedHttpStack, match="hypercorn==0.0.1"):
            await start()
