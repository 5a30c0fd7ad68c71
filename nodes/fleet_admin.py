"""Fleet housekeeping for the web panel routes and the MGPU Fleet Control node: status, unload, stop.

These go over a short-lived connection of their own instead of ``mgpu_backend.ltx.api``'s shared one:
that one is held for the whole length of a running job, and the panel must answer (and Restart
must work, e.g. on a hung job) while a node is running. None of them starts a fleet: a status
request with no fleet running says so. After a stop, the next node starts a fresh fleet and
reloads its model from the MGPU_MODEL handle on its own.
"""

from __future__ import annotations

import os
import time

from mgpu_backend.fleet.addresses import ENV_SOCKET
from mgpu_backend.fleet.client import FleetClient, FleetError, FleetUnavailable
from mgpu_backend.fleet.client import format_status as client_format_status
from mgpu_backend.fleet.protocol import ConnectionClosed

UNREACHABLE = (FleetUnavailable, ConnectionClosed, OSError)
"""No fleet, or one on its way out (the connection drops during the handshake)."""
STOP_WAIT_SECONDS = 30.0


def _connect() -> FleetClient:
    return FleetClient.connect(autostart=False)


def _answers() -> bool:
    try:
        _connect().close()
    except UNREACHABLE:
        return False
    return True


def not_running_message(reason: str) -> str:
    """The one sentence the panel and the Fleet Control node show while no fleet answers.

    A fleet started by hand (MGPU_SOCKET set) is never started by ComfyUI, so only then does it
    point at ``python -m mgpu_backend serve`` (the client's ``reason`` says where it looked);
    otherwise the next MGPU node starts one, and the client's advice to start one by hand would
    contradict that."""
    if os.environ.get(ENV_SOCKET):
        return f"fleet not running: {reason}"
    return "fleet not running: the first MGPU node starts it (on every visible GPU, or MGPU_GPUS / MGPU_CPU_RANKS)"


def status_snapshot() -> dict:
    """``{"running": True, **server status}`` or ``{"running": False, "message": not_running_message}``."""
    try:
        with _connect() as client:
            return {"running": True, **client.status()}
    except UNREACHABLE as exc:
        return {"running": False, "message": not_running_message(str(exc))}


def stop_fleet(wait_seconds: float = STOP_WAIT_SECONDS) -> dict:
    """Stop the fleet server and its ranks (a running job ends with an error in its node).

    Returns once the server no longer answers, so that the next node starts a fresh fleet instead
    of attaching to the one on its way out.
    """
    try:
        with _connect() as client:
            client.shutdown()
    except UNREACHABLE as exc:
        return {"stopped": False, "message": not_running_message(str(exc))}
    deadline = time.monotonic() + wait_seconds
    while _answers() and time.monotonic() < deadline:
        time.sleep(0.1)
    if os.environ.get(ENV_SOCKET):
        return {"stopped": True, "message": f"fleet stopped; it was started by hand ({ENV_SOCKET} is set): start it again with 'python -m mgpu_backend serve'"}
    return {"stopped": True, "message": "fleet stopped; the next MGPU node starts a fresh one and reloads its model"}


def unload_models() -> dict:
    """Drop every loaded model from the ranks; the fleet stays up. Waits behind a running job."""
    try:
        with _connect() as client:
            fields = client.run("unload").fields
    except UNREACHABLE as exc:
        return {"unloaded": False, "message": not_running_message(str(exc))}
    except FleetError as exc:
        return {"unloaded": False, "message": f"unload failed: {exc}"}
    return {"unloaded": True, "message": "models unloaded; the next MGPU node reloads its model", "fleet_reply": fields}


def format_status(status: dict) -> str:
    """A few lines for a node's text output: devices, per-rank memory, the current job, the queue."""
    if not status.get("running"):
        return status["message"]
    return client_format_status(status)

