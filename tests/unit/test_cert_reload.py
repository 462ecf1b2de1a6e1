"""When the certificate reloader reloads, and what it refuses (``gateway.edge.cert_reload``)."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest

from gateway.edge.cert_reload import CertificateReloader, ReloadDecision, file_stamp, read_pair
from gateway.edge.devcert import ensure_dev_certificate

A: tuple[int, int, int, int, int, int] = (1, 10, 100, 2, 20, 200)
B: tuple[int, int, int, int, int, int] = (3, 10, 100, 2, 20, 200)


def test_decision_reloads_on_change_or_when_asked_and_not_a_failed_pair_again() -> None:
    decision = ReloadDecision(A)
    assert not decision.due(A, asked=False)
    assert decision.due(A, asked=True)  # SIGHUP: always
    assert decision.due(B, asked=False)
    decision.tried(B)  # say it failed: not retried every poll
    assert not decision.due(B, asked=False)
    assert not decision.due(None, asked=True)  # a file missing: keep what serves


def _pair(root: Path, name: str) -> tuple[Path, Path]:
    made = ensure_dev_certificate(root / name)
    return made.cert, made.key


def test_a_key_that_does_not_match_is_refused_and_nothing_is_touched(tmp_path: Path) -> None:
    cert_a, key_a = _pair(tmp_path, "a")
    cert_b, key_b = _pair(tmp_path, "b")
    served_cert, served_key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(cert_a, served_cert)
    shutil.copy(key_a, served_key)
    live = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    live.load_cert_chain(served_cert, served_key)
    reloader = CertificateReloader(served_cert, served_key)
    reloader.register_tls(live)
    assert reloader.check() is None  # unchanged
    shutil.copy(cert_b, served_cert)  # B's certificate, A's key
    with pytest.raises(ssl.SSLError):
        read_pair(served_cert, served_key)
    assert reloader.check() is False
    assert reloader.check() is None  # the same broken pair: not tried again
    shutil.copy(key_b, served_key)
    assert reloader.check() is True
    assert reloader.stats()["reloads"] == 1 and reloader.stats()["failures"] == 1
    assert reloader.not_after is not None
    assert file_stamp(served_cert, tmp_path / "missing.pem") is None
