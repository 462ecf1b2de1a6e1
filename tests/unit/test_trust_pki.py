"""The cluster CA, identities in certificates, live TLS contexts, the peer of a
connection as the app sees it, and the gateway's check of a worker's identity:
in-process, over real sockets on 127.0.0.1."""

from __future__ import annotations

import datetime
import ssl
from functools import partial
from pathlib import Path

import anyio
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gateway.upstream.http1 import ConnectFailed
from gateway.upstream.worker_http import HttpPool
from hedgerow.asgi import Receive, Scope, Send, send_json
from hedgerow.serving import serve_internal
from hedgerow.trust.ca import CaError, ClusterCA, csr_public_key, fingerprint, make_csr
from hedgerow.trust.credentials import Credentials, TlsContexts
from hedgerow.trust.identity import Identity, IdentityError, identity_of
from hedgerow.trust.join import renew_at
from hedgerow.trust.peer import PEER

NOW = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
HOUR = datetime.timedelta(hours=1)


@pytest.fixture
def ca(tmp_path: Path) -> ClusterCA:
    return ClusterCA.load_or_create(tmp_path / "ca", datetime.datetime.now(datetime.UTC))


def credentials(ca: ClusterCA, directory: Path, identity: Identity, **names: tuple[str, ...]
                ) -> Credentials:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = ca.issue(key.public_key(), identity, lifetime=HOUR,
                    now=datetime.datetime.now(datetime.UTC), **names)
    creds = Credentials(directory)
    creds.write_issued(key, cert, ca.cert)
    return creds


def test_identities_parse_both_spellings_and_refuse_the_rest() -> None:
    worker = Identity("worker", "cpu-1")
    assert worker.uri == "spiffe://hedgerow/worker/cpu-1"
    assert Identity.parse("worker/cpu-1") == Identity.parse(worker.uri) == worker
    for bad in ("cpu-1", "root/cpu-1", "worker/", "worker/../x", "worker/a b",
                "spiffe://other/worker/x"):
        with pytest.raises(IdentityError):
            Identity.parse(bad)


def test_an_issued_certificate_speaks_for_exactly_its_identity(ca: ClusterCA) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    identity = Identity("gateway", "gw-1")
    # Whatever the request asks for, the CA decides the identity.
    cert = ca.issue_for_csr(make_csr(key, Identity("admin", "root")), identity,
                            lifetime=HOUR, now=NOW)
    assert identity_of(cert) == identity
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == []  # never passes a hostname check
    assert cert.not_valid_after_utc == NOW + HOUR
    assert cert.issuer == ca.cert.subject
    assert renew_at(cert) == NOW + HOUR * 2 / 3  # two thirds of its life after issuance


def test_a_short_lived_certificate_is_renewed_after_it_was_issued_not_before(ca: ClusterCA) -> None:
    # not_valid_before is backdated a minute for clock skew; counting the life
    # from there made anything under ~30 s due before issuance: renewed in a loop.
    key = ec.generate_private_key(ec.SECP256R1())
    life = datetime.timedelta(seconds=6)
    cert = ca.issue_for_csr(make_csr(key, Identity("worker", "w")), Identity("worker", "w"),
                            lifetime=life, now=NOW)
    assert cert.not_valid_before_utc < NOW
    assert renew_at(cert) == NOW + datetime.timedelta(seconds=4)


def test_a_certificate_request_that_does_not_verify_is_refused() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = make_csr(key, Identity("worker", "w"))
    assert csr_public_key(csr) == key.public_key()
    tampered = csr.replace(csr[100:104], b"AAAA") if csr[100:104] != b"AAAA" else csr[:90]
    with pytest.raises(CaError):
        csr_public_key(tampered)
    with pytest.raises(CaError):
        csr_public_key(b"not a request")


def test_the_ca_is_made_once_and_reused(tmp_path: Path) -> None:
    first = ClusterCA.load_or_create(tmp_path / "ca", NOW)
    again = ClusterCA.load_or_create(tmp_path / "ca", NOW)
    assert fingerprint(first.cert) == fingerprint(again.cert)
    assert (tmp_path / "ca" / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    with pytest.raises(CaError):  # a leaf is no CA
        leaf = credentials(first, tmp_path / "leaf", Identity("worker", "w"))
        ClusterCA.load(leaf.cert_path, leaf.key_path)


async def _whoami(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http":
        peer = PEER.get()
        await send_json(send, 200, {"peer": str(peer.identity) if peer else None})


def _client(creds: Credentials, *, check_hostname: bool = True) -> ssl.SSLContext:
    return TlsContexts(creds).client(check_hostname=check_hostname)


async def _serving(app: object, tls: ssl.SSLContext, run: object) -> None:
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(serve_internal, tls=tls), app, "127.0.0.1", 0, stop)
        await anyio.sleep(0.3)  # hypercorn listens after it reports the port
        try:
            await run(port)  # type: ignore[operator]
        finally:
            stop.set()


def test_each_connection_sees_its_own_peer_and_strangers_fail_the_handshake(
        ca: ClusterCA, tmp_path: Path) -> None:
    server = credentials(ca, tmp_path / "cp", Identity("control-plane", "cp"),
                         ip_addresses=("127.0.0.1",))
    alice = credentials(ca, tmp_path / "a", Identity("worker", "alice"))
    bob = credentials(ca, tmp_path / "b", Identity("gateway", "bob"))
    rogue = credentials(ClusterCA.load_or_create(tmp_path / "rogue", NOW), tmp_path / "r",
                        Identity("worker", "alice"))

    async def run(port: int) -> None:
        url = f"https://127.0.0.1:{port}/"
        async with httpx.AsyncClient(verify=_client(alice)) as a, \
                httpx.AsyncClient(verify=_client(bob)) as b:
            for _ in range(3):  # interleaved on kept-alive connections
                assert (await a.get(url)).json() == {"peer": "worker/alice"}
                assert (await b.get(url)).json() == {"peer": "gateway/bob"}
        no_cert = ssl.create_default_context(cafile=server.ca_path)
        forged = ssl.create_default_context(cafile=server.ca_path)
        forged.load_cert_chain(rogue.cert_path, rogue.key_path)
        for context in (no_cert, forged):
            with pytest.raises(httpx.HTTPError):
                async with httpx.AsyncClient(verify=context) as c:
                    await c.get(url)
        with pytest.raises(httpx.HTTPError):
            async with httpx.AsyncClient() as c:
                await c.get(url.replace("https", "http"))

    anyio.run(_serving, _whoami, TlsContexts(server).server(), run)


def test_a_renewed_certificate_is_used_by_new_handshakes_and_old_connections_live_on(
        ca: ClusterCA, tmp_path: Path) -> None:
    server = credentials(ca, tmp_path / "cp", Identity("control-plane", "cp"),
                         ip_addresses=("127.0.0.1",))
    contexts = TlsContexts(server)
    serving = contexts.server()

    async def run(port: int) -> None:
        client = credentials(ca, tmp_path / "c", Identity("gateway", "g"))
        url = f"https://127.0.0.1:{port}/"
        async with httpx.AsyncClient(verify=_client(client)) as kept:
            assert (await kept.get(url)).status_code == 200
            before = server.certificate().serial_number
            credentials(ca, tmp_path / "cp", Identity("control-plane", "cp"),
                        ip_addresses=("127.0.0.1",))  # renewed files, same place
            contexts.reload()
            assert server.certificate().serial_number != before
            assert (await kept.get(url)).status_code == 200  # the open connection
            seen: list[int] = []

            async with httpx.AsyncClient(verify=_client(client)) as fresh:
                response = await fresh.get(url)
                stream = response.extensions["network_stream"]
                der = stream.get_extra_info("ssl_object").getpeercert(binary_form=True)
                seen.append(x509.load_der_x509_certificate(der).serial_number)
            assert seen == [server.certificate().serial_number]

    anyio.run(_serving, _whoami, serving, run)


def test_the_gateway_accepts_a_worker_only_if_it_proves_the_registered_identity(
        ca: ClusterCA, tmp_path: Path) -> None:
    worker = credentials(ca, tmp_path / "w", Identity("worker", "w-1"))
    gateway = TlsContexts(credentials(ca, tmp_path / "g", Identity("gateway", "g")))

    async def run(port: int) -> None:
        pool = HttpPool(internal_tls=gateway)
        url = f"https://127.0.0.1:{port}/v1/chat/completions"
        try:
            ok = await pool.request("POST", url, {}, b"{}", peer=Identity("worker", "w-1").uri)
            assert ok.status == 200
            await ok.read_all(10_000)
            with pytest.raises(ConnectFailed, match="proved spiffe://hedgerow/worker/w-1"):
                await pool.request("POST", url, {}, b"{}", peer=Identity("worker", "w-2").uri)
        finally:
            await pool.aclose()

    anyio.run(_serving, _whoami, TlsContexts(worker).server(), run)


def test_a_worker_keeps_the_revocations_it_learned_across_a_restart(tmp_path: Path) -> None:
    """A restarted worker refuses a revoked gateway before its first heartbeat."""
    from hedgerow.trust.peer import Peer, Revocations

    joined = datetime.datetime(2026, 12, 1, 11, 0, tzinfo=datetime.UTC)
    gateway = Peer(Identity("gateway", "g"), joined, joined + HOUR, joined)
    learned = Revocations(tmp_path / "revoked.json")
    assert not learned.revoked(gateway)
    learned.update({"gateway/g": (joined + HOUR / 2).timestamp(), "gateway/x": float("nan")})
    assert learned.revoked(gateway)
    restarted = Revocations(tmp_path / "revoked.json")
    assert restarted.revoked(gateway)
    rejoined = Peer(gateway.identity, NOW, NOW + HOUR, NOW)  # joined again after it
    assert not restarted.revoked(rejoined)


def test_a_worker_whose_revocations_file_holds_no_object_still_answers(tmp_path: Path) -> None:
    """A revoked.json that holds valid JSON but not an object (hand-edited,
    truncated to ``[]``) counts as none kept: the worker still answers its peers,
    and the next heartbeat brings the list back."""
    from hedgerow.trust.peer import Peer, Revocations

    joined = datetime.datetime(2026, 12, 1, 11, 0, tzinfo=datetime.UTC)
    gateway = Peer(Identity("gateway", "g"), joined, joined + HOUR, joined)
    (tmp_path / "revoked.json").write_text("[]")
    restarted = Revocations(tmp_path / "revoked.json")
    assert not restarted.revoked(gateway)
    restarted.update({"gateway/g": (joined + HOUR / 2).timestamp()})
    assert restarted.revoked(gateway)
