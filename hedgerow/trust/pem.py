"""PEM files written as a reader may safely see them: whole, and keys private.

Every file goes to a temporary name and is renamed into place, so a process
that reloads its certificate never reads half of one; keys get mode 0600.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

KEY_MODE = 0o600
PUBLIC_MODE = 0o644


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    write_atomically(path, key_pem(key), mode=KEY_MODE)


def write_cert(path: Path, cert: x509.Certificate) -> None:
    write_atomically(path, cert_pem(cert), mode=PUBLIC_MODE)


def check_private_directory(directory: Path) -> None:
    """Refuse a state directory another user could have planted files in: it must
    belong to this user (or root) and not be writable by others. Raises ValueError."""
    info = directory.stat()
    if info.st_uid not in (os.getuid(), 0):
        raise ValueError(f"{directory} belongs to uid {info.st_uid}, not to this user: "
                         "refusing to trust keys in it")
    if info.st_mode & 0o002:
        raise ValueError(f"{directory} is writable by every user: refusing to trust keys "
                         f"in it (chmod o-w {directory})")


def write_atomically(path: Path, data: bytes, *, mode: int) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        os.unlink(temporary)  # a stale one of ours (never followed: unlink removes a link)
    except FileNotFoundError:
        pass
    # O_EXCL | O_NOFOLLOW: never write through a file or link someone else planted.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with open(fd, "wb") as file:
        os.fchmod(file.fileno(), mode)  # O_CREAT's mode is masked by the umask
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
