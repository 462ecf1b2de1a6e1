"""Real processes and Debian's headless Chromium, driven by Playwright.

One stack per module (control plane, simulated workers, gateway with its dev
certificate) and one Chromium per protocol: ``h2_browser`` has QUIC off, so
every request stays on HTTP/2; ``h3_browser`` forces QUIC for the gateway's
``localhost:PORT`` origin. Both trust the dev certificate by the SHA-256 of
its public key (``--ignore-certificate-errors-spki-list``), as a developer
would, and reach ``localhost``, which Chromium tries on ::1 first.
Nothing downloads a browser: Playwright launches ``/usr/bin/chromium``.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from playwright.sync_api import Browser, Playwright, sync_playwright

from policies.schema import DEFAULT_POLICY_PATH
from tests.support.stack import Stack

CHROMIUM = "/usr/bin/chromium"
MODEL = "smollm2-135m-instruct"  # served by a slow simulated worker: long answers to stop
SHORT = "sim-short"  # a simulated model whose answers end quickly
BREAKS = "sim-break"  # a simulated model whose streams break mid-way
SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1", "--sim-jitter", "0"]
LONG_TOKENS = 2000  # at 30 ms a token: a minute, unless it is stopped
SHORT_TOKENS = 24


def policy_text(**cors: Any) -> str:
    """The shipped policy with a ``cors:`` section, as a control plane takes it."""
    document = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    document["cors"] = {**document.get("cors", {}), **cors}
    return yaml.safe_dump(document)


def spki_sha256(cert_pem: Path) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem.read_bytes())
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("browser")
    policy = root / "policy.yaml"
    policy.write_text(policy_text())
    stack = Stack(root)
    try:
        stack.start_control_plane(policy=policy)
        stack.start_worker("sim-long", *SIM, "--slots", "2", "--sim-decode-ms-per-token", "30",
                           "--sim-output-tokens", str(LONG_TOKENS))
        stack.start_worker("sim-short", *SIM, "--model-name", SHORT,
                           "--sim-decode-ms-per-token", "20",
                           "--sim-output-tokens", str(SHORT_TOKENS))
        stack.start_worker("sim-break", *SIM, "--model-name", BREAKS,
                           "--sim-decode-ms-per-token", "20", "--sim-output-tokens", "40",
                           "--sim-midstream-fail-prob", "1")
        stack.start_gateway("--gateway-id", "gw-browser")
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


def _launch(playwright: Playwright, stack: Stack, *flags: str) -> Browser:
    spki = spki_sha256(stack.root / "state" / "tls" / "cert.pem")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=[
        "--no-sandbox",  # tests run as root
        f"--ignore-certificate-errors-spki-list={spki}",
        *flags,
    ])


@pytest.fixture(scope="module")
def h2_browser(playwright: Playwright, stack: Stack) -> Iterator[Browser]:
    browser = _launch(playwright, stack, "--disable-quic")
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def h3_browser(playwright: Playwright, stack: Stack) -> Iterator[Browser]:
    browser = _launch(playwright, stack, "--enable-quic",
                      f"--origin-to-force-quic-on=localhost:{stack.gateway_port}")
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def page_url(stack: Stack) -> str:
    return f"https://localhost:{stack.gateway_port}/"
