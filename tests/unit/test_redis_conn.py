"""hedgerow.redis_conn without a server: URLs shown without passwords, settings that
cannot work refused at start, plaintext to another host called out."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
import trustme
from redis.exceptions import RedisError

from hedgerow.cli import build_parser
from hedgerow.redis_conn import (
    ACL_RULES,
    RedisSetupError,
    RedisTls,
    connection_options,
    is_plaintext_remote,
    open_redis,
    redact_url,
    scrub,
    warn_if_plaintext,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"


@pytest.mark.parametrize(("url", "shown"), [
    ("rediss://hedgerow:s3cret@redis.internal:6380/0", "rediss://hedgerow:***@redis.internal:6380/0"),
    ("rediss://:s3cret@10.0.0.5:6380", "rediss://:***@10.0.0.5:6380"),
    ("rediss://hedgerow:p%40ss%3Aw0rd@[::1]:6380/2", "rediss://hedgerow:***@[::1]:6380/2"),
    ("rediss://u:a@b@host:6380/0", "rediss://u:***@host:6380/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://user@host/0", "redis://user@host/0"),
    ("redis://host:6379/0?password=s3cret&db=1", "redis://host:6379/0?password=***&db=1"),
    ("rediss://u:s3cret@host:notaport/0", "rediss://(unparseable URL)"),
])
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_error_texts_lose_the_password_raw_or_encoded() -> None:
    url = "rediss://hedgerow:p%40ss@host:6380/0"
    assert scrub("auth p@ss failed; p%40ss", url) == "auth *** failed; ***"
    assert scrub("nothing secret here", "redis://host/0") == "nothing secret here"


@pytest.mark.parametrize(("url", "plaintext_remote"), [
    ("redis://10.1.2.3:6379/0", True),
    ("redis://redis.internal:6379/0", True),
    ("redis://127.0.0.1:6379/0", False),
    ("redis://[::1]:6379/0", False),
    ("redis://localhost:6379/0", False),
    ("rediss://10.1.2.3:6380/0", False),
    ("unix:///run/redis.sock", False),
])
def test_plaintext_to_another_host_is_recognised(url: str, plaintext_remote: bool) -> None:
    assert is_plaintext_remote(url) is plaintext_remote


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pems")
    ca = trustme.CA()
    client = ca.issue_cert("hedgerow-client")
    files = {"ca": root / "ca.pem", "cert": root / "client.pem", "key": root / "client.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    client.cert_chain_pems[0].write_to_path(str(files["cert"]))
    client.private_key_pem.write_to_path(str(files["key"]))
    return files


def test_tls_verifies_the_server_and_its_name(pems: dict[str, Path]) -> None:
    options = connection_options("rediss://u:p@redis.internal:6380/0",
                                 RedisTls(pems["ca"], pems["cert"], pems["key"]))
    assert options["ssl_cert_reqs"] == "required" and options["ssl_check_hostname"] is True
    assert options["ssl_ca_certs"] == str(pems["ca"])
    assert (options["ssl_certfile"], options["ssl_keyfile"]) == (str(pems["cert"]), str(pems["key"]))
    assert options["ssl_min_version"] >= ssl.TLSVersion.TLSv1_2


def test_the_client_really_gets_those_settings(pems: dict[str, Path]) -> None:
    redis = open_redis("rediss://u:p@redis.internal:6380/0", RedisTls(pems["ca"]),
                       socket_timeout=0.25, connect_timeout=0.5)
    kwargs = redis.connection_pool.connection_kwargs
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_check_hostname"] is True
    assert kwargs["ssl_ca_certs"] == str(pems["ca"])
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.25, 0.5)
    assert (kwargs["username"], kwargs["password"]) == ("u", "p")
    # No CLIENT SETINFO (not in the ACL): Redis 7.2+ would log a denial per connection.
    connection = redis.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    assert getattr(connection, "driver_info", None) is None
    assert getattr(connection, "lib_name", None) is None


def test_tls_files_with_a_plaintext_url_are_refused(pems: dict[str, Path]) -> None:
    with pytest.raises(RedisSetupError, match="use rediss://") as refused:
        connection_options("redis://u:s3cret@10.0.0.5:6379/0", RedisTls(pems["ca"]))
    assert "s3cret" not in str(refused.value)


def test_a_key_without_a_certificate_is_refused(pems: dict[str, Path]) -> None:
    with pytest.raises(RedisSetupError, match="--redis-key-file needs --redis-cert-file"):
        connection_options("rediss://u:p@host:6380/0", RedisTls(pems["ca"], key_file=pems["key"]))


def test_a_missing_or_bad_pem_file_is_named(pems: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(RedisSetupError, match=f"--redis-ca-file {missing}"):
        connection_options("rediss://u:p@host:6380/0", RedisTls(missing))
    with pytest.raises(RedisSetupError, match="--redis-cert-file"):
        connection_options("rediss://u:p@host:6380/0",
                           RedisTls(pems["ca"], pems["ca"], pems["key"]))  # a CA as client cert


def test_a_url_that_is_not_redis_is_refused_without_its_password() -> None:
    for url in ("http://u:s3cret@host:6380/0", "rediss://u:s3cret@host:port/0"):
        with pytest.raises(RedisSetupError) as refused:
            open_redis(url, socket_timeout=1, connect_timeout=1)
        assert "s3cret" not in str(refused.value)


def test_flags_and_environment_reach_the_tls_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEDGEROW_REDIS_CA_FILE", "/etc/hedgerow/redis-ca.pem")
    monkeypatch.setenv("HEDGEROW_REDIS_URL", "rediss://hedgerow:pw@redis:6380/0")
    for command in ("control-plane", "gateway"):
        args = build_parser().parse_args([command, "--redis-cert-file", "c.pem",
                                          "--redis-key-file", "c.key"])
        assert args.redis == "rediss://hedgerow:pw@redis:6380/0"
        assert (args.redis_ca_file, args.redis_cert_file, args.redis_key_file) == (
            Path("/etc/hedgerow/redis-ca.pem"), Path("c.pem"), Path("c.key"))
    assert RedisTls.from_env({"HEDGEROW_REDIS_KEY_FILE": "k"}) == RedisTls(key_file=Path("k"))


def test_gateway_options_keep_the_password_out_of_their_repr() -> None:
    from gateway.main import GatewayOptions

    assert "s3cret" not in repr(GatewayOptions(redis_url="rediss://u:s3cret@host:6380/0"))


def test_the_docs_give_operators_exactly_the_acl_the_code_needs() -> None:
    assert f"user hedgerow on #<sha256 of the password> {ACL_RULES}" in DOCS.read_text()


def test_the_plaintext_warning_is_loud_and_redacted(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hedgerow.redis"):
        assert not warn_if_plaintext("redis://hedgerow:s3cret@127.0.0.1:6379/0")
        assert not warn_if_plaintext("rediss://hedgerow:s3cret@10.0.0.5:6380/0")
        assert "PLAINTEXT" not in caplog.text
        assert warn_if_plaintext("redis://hedgerow:s3cret@10.0.0.5:6379/0", "shared state")
    assert "PLAINTEXT to a non-loopback host" in caplog.text
    assert "shared state: redis://hedgerow:***@10.0.0.5:6379/0" in caplog.text
    assert "s3cret" not in caplog.text


def test_a_dead_connection_is_retried_once_at_once_and_no_more() -> None:
    """A server that hangs up on every connection (Redis going down or just
    restarted): one immediate retry on a fresh connection, then the error, fast;
    no backoff that would hold a control-plane tick or a heartbeat."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    port = listener.getsockname()[1]
    redis = open_redis(f"redis://127.0.0.1:{port}/0", socket_timeout=1.0, connect_timeout=1.0)

    async def ping() -> float:
        started = time.monotonic()
        with pytest.raises(RedisError):
            await redis.ping()
        await redis.aclose()
        return time.monotonic() - started

    try:
        elapsed = asyncio.run(ping())
    finally:
        listener.close()
    assert len(accepted) == 2  # the first try and one retry, nothing more
    assert elapsed < 5.0
