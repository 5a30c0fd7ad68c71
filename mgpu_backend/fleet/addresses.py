"""Where the fleet listens, and the token that proves client and server to each other.

Every fleet lives in a private directory (mode 0700, owned by the user) under
``$XDG_RUNTIME_DIR/comfyui-mgpu`` or ``/tmp/comfyui-mgpu-<uid>``: its Unix socket (0600), the token
beside it in ``<socket>.token`` (0600) and the log of a fleet a client started, ``server.log``.

Which socket, when none is named (``--socket``, ``MGPU_SOCKET`` or ``api.configure``):

- In ComfyUI, or any other program that uses the library: one fleet per process, at
  ``process-<pid>/fleet.sock`` in the private directory. A ComfyUI's pid is stable for as long as it
  runs, and the fleet it starts is tied to that pid (it ends when ComfyUI does), so the name names
  exactly one fleet; two ComfyUIs running at once have two pids, hence two fleets, each on the
  devices its own ComfyUI asked for, and stopping one never touches the other's jobs. The panel and
  the Fleet Control node of a ComfyUI find its fleet the same way. (A base directory or port would
  not do: two ComfyUIs may share a base directory, and a ComfyUI restarted on the same port could
  meet the previous one's fleet on its way out.)
- On the command line (``python -m mgpu_backend serve | status | stop | generate``): the per-user
  socket ``fleet.sock`` in the private directory, so that ``serve`` in one shell and ``generate`` or
  ``status`` in another meet (``cli.main`` runs every sub-command in ``user_socket_by_default``).

Attaching to another process's fleet happens only when its socket is named (``MGPU_SOCKET``, or
``--socket``: ``process_fleets()`` lists those of running processes for ``status``). Where Unix
sockets are unavailable, ``tcp://127.0.0.1:PORT`` listens on loopback only, with the token in the
private directory. Never listen on anything but loopback. The token itself never travels: the
handshake exchanges HMAC proofs of it (``protocol.handshake_proof``).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENV_SOCKET = "MGPU_SOCKET"
SOCKET_NAME = "fleet.sock"
PROCESS_FOLDER_PREFIX = "process-"
_user_socket_is_default = False


class AddressError(Exception):
    """The socket location is unusable (wrong owner, open permissions, not loopback)."""


def private_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir() and os.access(base, os.W_OK):
        return Path(base) / "comfyui-mgpu"
    return Path(tempfile.gettempdir()) / f"comfyui-mgpu-{os.getuid()}"


def user_socket() -> Path:
    """The command line's default socket: one per user."""
    return private_dir() / SOCKET_NAME


def process_socket(pid: int | None = None) -> Path:
    """The default socket of process ``pid`` (default: this one): its own fleet."""
    return private_dir() / f"{PROCESS_FOLDER_PREFIX}{os.getpid() if pid is None else pid}" / SOCKET_NAME


@contextmanager
def user_socket_by_default() -> Iterator[None]:
    """Within it, the per-user socket is the default instead of this process's own: the command line."""
    global _user_socket_is_default
    saved, _user_socket_is_default = _user_socket_is_default, True
    try:
        yield
    finally:
        _user_socket_is_default = saved


def default_socket() -> str:
    """``MGPU_SOCKET`` when set, else this process's default (see the module docstring)."""
    return os.environ.get(ENV_SOCKET) or str(user_socket() if _user_socket_is_default else process_socket())


def process_fleets() -> list[tuple[int, Path, str]]:
    """``(pid, socket, command line on one line)`` of every per-process fleet socket in the private
    directory whose process still runs, for people looking for a ComfyUI's fleet."""
    found = []
    for socket_path in sorted(private_dir().glob(f"{PROCESS_FOLDER_PREFIX}*/{SOCKET_NAME}")):
        pid_text = socket_path.parent.name[len(PROCESS_FOLDER_PREFIX) :]
        if not pid_text.isdigit():
            continue
        try:
            command = " ".join(Path(f"/proc/{pid_text}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
        except OSError:
            continue  # that process is gone: its fleet is on its way out
        found.append((int(pid_text), socket_path, command))
    return found


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700 (and any missing parent, 0700 too) or check that an existing one is ours
    and closed to others."""
    if not path.parent.exists():
        ensure_private_dir(path.parent)
    path.mkdir(mode=0o700, exist_ok=True)
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
        text = text or default_socket()
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

    @property
    def log_path(self) -> Path:
        """Where a fleet a client started writes its log."""
        return self.directory / "server.log"

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
