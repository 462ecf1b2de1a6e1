"""An nginx reverse proxy in front of one upstream, for side-by-side benchmarks.

The Debian ``nginx`` package's binary, started in the foreground with a
generated config in its own directory: one worker process, TLS with the
certificate it is given, HTTP/2, streaming unbuffered (``proxy_buffering off``)
to an upstream it keeps keep-alive HTTP/1.1 connections to, and an access
log in nginx's stock format (``combined``, to a file), as a stock nginx.conf
has it: Hedgerow writes its own access log by default, so both pay for a line
per request.
With ``upstream_tls`` it speaks TLS to the upstream and presents a client
certificate (a Hedgerow worker takes mutual TLS only). nginx checks an upstream
certificate's DNS/IP names, never a SPIFFE URI, so it does not verify a worker
(whose certificate names only its identity): the handshake costs it the same,
and kept-alive connections make handshakes rare either way.
That is the configuration an operator would use to put nginx in front of an
SSE-streaming model server, so its added latency and CPU are a fair yardstick.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.stack import Proc, free_port
from hedgerow.errors import RuntimeFault

START_TIMEOUT_S = 20.0
NGINX_CANDIDATES = ("nginx", "/usr/sbin/nginx")


class NginxUnavailable(RuntimeFault):
    """The nginx binary is not installed, or it would not start."""

    default_code = "nginx_unavailable"


def nginx_binary() -> str:
    """Path of the nginx binary; ``NginxUnavailable`` (with the fix) if there is none."""
    for candidate in NGINX_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    raise NginxUnavailable("nginx is not installed; the overhead scenario compares against it. "
                           "Install it with `apt-get install -y nginx` (Debian/Ubuntu).")


@dataclass(frozen=True)
class NginxConfig:
    """What the generated config needs: where it lives, listens, and proxies to."""

    root: Path  # config, pid file, error log and temp paths go here
    port: int
    upstream: str  # host:port of the upstream
    cert: Path
    key: Path
    upstream_keepalive: int = 256
    upstream_tls: Path | None = None  # TLS upstream: a directory with cert.pem, key.pem

    def render(self) -> str:
        root = self.root
        temp_paths = "\n".join(f"    {kind}_temp_path {root / kind};"
                               for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        return f"""daemon off;
worker_processes 1;
pid {root / 'nginx.pid'};
error_log {root / 'error.log'} warn;
events {{ worker_connections 4096; }}
http {{
    access_log {root / 'access.log'};
{temp_paths}
    upstream model_worker {{
        server {self.upstream};
        keepalive {self.upstream_keepalive};
    }}
    server {{
        listen 127.0.0.1:{self.port} ssl http2;
        ssl_certificate {self.cert};
        ssl_certificate_key {self.key};
        ssl_protocols TLSv1.2 TLSv1.3;
        keepalive_requests 1000000;
        location / {{
            proxy_pass {"https" if self.upstream_tls else "http"}://model_worker;
{self._upstream_tls_lines()}            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


    def _upstream_tls_lines(self) -> str:
        if self.upstream_tls is None:
            return ""
        creds = self.upstream_tls
        return (f"            proxy_ssl_certificate {creds / 'cert.pem'};\n"
                f"            proxy_ssl_certificate_key {creds / 'key.pem'};\n"
                # Hedgerow's internal listeners take TLS 1.3 only; nginx 1.22
                # offers up to 1.2 upstream unless told.
                "            proxy_ssl_protocols TLSv1.2 TLSv1.3;\n"
                "            proxy_ssl_session_reuse on;\n")


def start_nginx(root: Path, upstream: str, cert: Path, key: Path,
                upstream_tls: Path | None = None) -> tuple[Proc, str]:
    """Start nginx proxying ``https://127.0.0.1:PORT`` to ``upstream``; the process and URL."""
    binary = nginx_binary()
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # worker processes may run as another user when started as root
    config = NginxConfig(root=root, port=free_port(), upstream=upstream, cert=cert, key=key,
                         upstream_tls=upstream_tls)
    config_path = root / "nginx.conf"
    config_path.write_text(config.render())
    log_path = root / "nginx.log"
    popen = subprocess.Popen([binary, "-p", str(root), "-c", str(config_path)],
                             stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    proc = Proc("nginx", popen, log_path)
    _wait_listening(proc, config.port, root / "error.log")
    return proc, f"https://127.0.0.1:{config.port}"


def _wait_listening(proc: Proc, port: int, error_log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise NginxUnavailable(f"nginx exited with {proc.popen.returncode}:\n{proc.log()}\n"
                                   f"{error_log.read_text() if error_log.exists() else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)
    proc.stop()
    raise NginxUnavailable(f"nginx did not listen on port {port} within {START_TIMEOUT_S} s")
