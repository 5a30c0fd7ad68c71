"""Where the fleet listens, and the token that proves client and server to each other.

Default: a Unix socket ``fleet.sock`` in a private directory (mode 0700, owned by the user) under
``$XDG_RUNTIME_DIR/comfyui-mgpu`` or ``/tmp/comfyui-mgpu-<uid>``; the socket itself is 0600 and the
token sits beside it in ``fleet.sock.token`` (0600). ``MGPU_SOCKET`` or ``--socket`` name another
path. Where Unix sockets are unavailable, ``tcp://127.0.0.1:PORT`` listens on loopback only, with
the token in the same private directory. Never listen on anything but loopback. The token itself
never travels: the handshake exchanges HMAC proofs of it (``protocol.handshake_proof``).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV_SOCKET = "MGPU_SOCKET"


class AddressError(Exception):
    """The socket location is unusable (wrong owner, open permissions, not loopback)."""


def private_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir() and os.access(base, os.W_OK):
        return Path(base) / "comfyui-mgpu"
    return Path(tempfile.gettempdir()) / f"comfyui-mgpu-{os.getuid()}"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700 or check that an existing one is ours and closed to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise AddressError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise AddressError(f"{path} belongs to uid {info.st_uid}, not to you; choose another --socket path")
    if info.st_mode & 0o077:
        raise AddressError(
            f"{path} is open to other users (mode {oct(info.st_mode & 0o777)}); run 'chmod 700 {path}' or remove it"
        )
    return path


@dataclass(frozen=True)
class Address:
    """A Unix socket path, or a loopback TCP port, plus the path of its token file."""

    unix_path: Path | None = None
    tcp_port: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> Address:
        text = text or os.environ.get(ENV_SOCKET) or str(private_dir() / "fleet.sock")
        if text.startswith("tcp://"):
            host, _, port = text[len("tcp://") :].rpartition(":")
            if host not in ("127.0.0.1", "localhost"):
                raise AddressError(f"the fleet only listens on loopback; got {host!r}, use tcp://127.0.0.1:PORT")
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise AddressError(f"bad TCP port in {text!r}")
            return cls(tcp_port=int(port))
        return cls(unix_path=Path(text).expanduser().absolute())

    @property
    def token_path(self) -> Path:
        if self.unix_path is not None:
            return self.unix_path.with_name(self.unix_path.name + ".token")
        return private_dir() / f"tcp-{self.tcp_port}.token"

    @property
    def directory(self) -> Path:
        return self.token_path.parent

    def __str__(self) -> str:
        return str(self.unix_path) if self.unix_path is not None else f"tcp://127.0.0.1:{self.tcp_port}"


def write_token(path: Path) -> str:
    token = secrets.token_hex(32)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token)
    os.replace(tmp, path)
    return token


def read_token(path: Path) -> str:
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise AddressError(f"token file {path} must be yours and mode 0600")
    return path.read_text().strip()
