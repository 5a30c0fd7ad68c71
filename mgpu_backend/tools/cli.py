"""Command line: ``python -m mgpu_backend serve | status | stop | make-tiny | generate | queue | doctor``.

Each sub-command is a small function, and only the sub-command that runs has its parser built and
its modules imported: ``queue`` needs nothing but the standard library (it runs in a Python
without torch), ``status`` answers without importing the model code, and ``--help`` lists every
sub-command from ``SUMMARIES`` alone.

The fleet commands' default socket is the per-user one (``fleet.sock`` in the private directory,
``addresses.user_socket``): ``serve`` in one shell and ``status``, ``stop`` or ``generate`` in
another meet there. A ComfyUI's own fleet sits at its per-process socket instead (``addresses``);
``status`` and ``stop`` list those of running processes when nothing answers at the default.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable

from mgpu_backend.fleet import addresses

SUMMARIES = {
    "serve": "run the fleet server in the foreground",
    "status": "show ranks, devices, memory, the current job and the queue",
    "stop": "stop the fleet server and its ranks",
    "make-tiny": "write the deterministic tiny LTX-2 bundle (random weights) to DIR",
    "generate": "run the two-stage LTX-2 job headless and write an mp4",
    "queue": "run an API-format workflow on a running ComfyUI and wait for its outputs",
    "doctor": "check devices, P2P, collectives, the all-to-all kernel and SP on a private short-lived fleet",
}
"""One line per sub-command for ``--help``; a sub-command defined in another module says the same there."""


def _add_socket(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket", default=None,
        help="fleet socket path or tcp://127.0.0.1:PORT (default: $MGPU_SOCKET, else the per-user socket fleet.sock in "
        "the private directory; a ComfyUI's own fleet is at process-<its pid>/fleet.sock there)",
    )  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    from mgpu_backend.fleet.addresses import Address, AddressError
    from mgpu_backend.fleet.controller import DeviceSpec, JobFailed
    from mgpu_backend.fleet.server import Server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        devices = DeviceSpec.parse(args.gpus, args.cpu_ranks)
        devices.check_gpus_visible()
        address = Address.parse(args.socket)
    except (ValueError, AddressError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = Server(address, devices, idle_timeout=args.idle_timeout, parent_pid=args.parent_pid, rank_timeout=args.rank_timeout)
    try:
        server.listen()  # before any rank starts: a bad socket path costs nothing
    except (OSError, AddressError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"error: cannot listen on {address}: {reason}; choose another --socket path (or tcp://127.0.0.1:PORT)", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # another server already listens there
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server.serve_forever()
    except JobFailed as exc:  # the ranks could not start
        print(f"error: the fleet's ranks did not start: {exc}", file=sys.stderr)
        return 1
    return 0


def _client(args: argparse.Namespace):
    from mgpu_backend.fleet.client import FleetClient

    return FleetClient.connect(args.socket, autostart=False)


def _unreachable(args: argparse.Namespace, exc: Exception) -> int:
    """Print why no fleet answered; at the default socket, also the fleets of running processes
    (each ComfyUI has its own), which --socket can name."""
    print(str(exc), file=sys.stderr)
    if args.socket is None and not os.environ.get(addresses.ENV_SOCKET):
        fleets = addresses.process_fleets()
        if fleets:
            print("fleets of running processes (a ComfyUI starts its own); name one with --socket:", file=sys.stderr)
            for pid, socket_path, command in fleets:
                print(f"  {socket_path}  (pid {pid}: {command[:120]})", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    from mgpu_backend.fleet.client import FleetUnavailable, format_status

    try:
        with _client(args) as client:
            status = client.status()
    except FleetUnavailable as exc:
        return _unreachable(args, exc)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(format_status(status))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from mgpu_backend.fleet.client import FleetUnavailable

    try:
        with _client(args) as client:
            client.shutdown()
    except FleetUnavailable as exc:
        return _unreachable(args, exc)
    print("fleet server stopped")
    return 0


def cmd_rank(args: argparse.Namespace) -> int:
    from mgpu_backend.fleet import rank

    rank.main(args.rank, args.world_size, args.fd, args.device, args.store, args.owner_pid)
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from mgpu_backend.bundles.tiny import make_tiny_bundle

    bundle = make_tiny_bundle(args.directory, args.version)
    print(f"tiny LTX-{bundle.version} bundle (random weights) in {bundle.root}:")
    for name in ("checkpoint_path", "distilled_checkpoint_path", "distilled_lora_path", "spatial_upsampler_path", "gemma_root"):
        print(f"  {name}: {getattr(bundle, name)}")
    return 0


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help=SUMMARIES["serve"])
    _add_socket(serve)
    devices = serve.add_mutually_exclusive_group()
    devices.add_argument("--gpus", default=None, help="GPU indices, e.g. 0,1,2,3, or 'all' (default: all visible GPUs)")
    devices.add_argument("--cpu-ranks", type=int, default=None, help="run N CPU ranks with gloo instead of GPUs (default: none, GPUs; one CPU rank without CUDA)")
    serve.add_argument("--idle-timeout", type=float, default=float(os.environ.get("MGPU_IDLE_TIMEOUT", 3600)), help="exit after this many seconds without jobs (0: never; default 3600)")
    serve.add_argument("--rank-timeout", type=float, default=float(os.environ.get("MGPU_RANK_TIMEOUT", 600)), help="fail a job and restart the fleet when no rank progresses for this many seconds (default 600)")
    serve.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)


def _add_status(commands) -> None:
    status = commands.add_parser("status", help=SUMMARIES["status"])
    _add_socket(status)
    status.add_argument("--json", action="store_true", help="print machine-readable JSON (default: a few lines for people)")
    status.set_defaults(func=cmd_status)


def _add_stop(commands) -> None:
    stop = commands.add_parser("stop", help=SUMMARIES["stop"])
    _add_socket(stop)
    stop.set_defaults(func=cmd_stop)


def _add_make_tiny(commands) -> None:
    from mgpu_backend.bundles.configs import VERSIONS

    tiny = commands.add_parser("make-tiny", help=SUMMARIES["make-tiny"])
    tiny.add_argument("directory")
    tiny.add_argument(
        "--version",
        choices=VERSIONS,
        default=VERSIONS[0],
        help="model version whose file layout the bundle follows: 2.0 (19B layout, default) or 2.3 (22B layout)",
    )
    tiny.set_defaults(func=cmd_make_tiny)


def _add_rank(commands) -> None:
    rank = commands.add_parser("rank")  # no help=: argparse then leaves it out of the command list
    for name in ("--rank", "--world-size", "--fd", "--owner-pid"):
        rank.add_argument(name, type=int, required=True)
    rank.add_argument("--device", required=True)
    rank.add_argument("--store", required=True)
    rank.set_defaults(func=cmd_rank)


def _from_module(module: str, function: str) -> Callable[[argparse._SubParsersAction], object]:
    """A sub-command registered by ``module.function(commands)``, the module imported only then."""
    return lambda commands: getattr(importlib.import_module(module), function)(commands)


REGISTER = {
    "serve": _add_serve,
    "status": _add_status,
    "stop": _add_stop,
    "make-tiny": _add_make_tiny,
    "generate": _from_module("mgpu_backend.tools.generate", "add_generate_parser"),
    "queue": _from_module("mgpu_backend.tools.comfy_queue", "add_queue_parser"),
    "doctor": _from_module("mgpu_backend.tools.doctor", "add_doctor_parser"),
    "rank": _add_rank,
}


def build_parser(in_full: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser with the sub-commands named by ``in_full`` (default: all) built in full; every
    other one only listed with its summary, so that nothing it needs is imported."""
    in_full = set(REGISTER) if in_full is None else set(in_full)
    parser = argparse.ArgumentParser(prog="python -m mgpu_backend", description="comfyui-mgpu fleet: LTX-2 on several GPUs")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, register in REGISTER.items():
        if name in in_full:
            register(commands)
        elif name in SUMMARIES:
            commands.add_parser(name, help=SUMMARIES[name])
        else:
            commands.add_parser(name)
    # ``rank`` is internal (the server starts it): list every other command in --help and usage.
    commands.metavar = "{" + ",".join(name for name in commands.choices if name != "rank") + "}"
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((word for word in argv if not word.startswith("-")), None)
    try:
        args = build_parser([command] if command else []).parse_args(argv)
        with addresses.user_socket_by_default():
            return args.func(args)
    except ModuleNotFoundError as exc:  # a Python without torch runs ``queue``, but not the fleet commands
        if not exc.name or exc.name.partition(".")[0] == "mgpu_backend":
            raise
        print(
            f"error: 'python -m mgpu_backend {command}' needs the package {exc.name!r}, which {sys.executable} cannot import; "
            "run it with the Python the project is installed in (pip install -e .)",
            file=sys.stderr,
        )
        return 2
