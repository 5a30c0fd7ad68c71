"""Command line: ``python -m mgpu_backend serve | status | stop | make-tiny | generate | ...``.

Each sub-command is a small function; the heavy modules are imported only by the command that
needs them, so ``status`` answers quickly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _add_socket(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, help="fleet socket path or tcp://127.0.0.1:PORT (default: $MGPU_SOCKET or a private per-user socket)")


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


def cmd_status(args: argparse.Namespace) -> int:
    from mgpu_backend.fleet.client import FleetUnavailable, format_status

    try:
        with _client(args) as client:
            status = client.status()
    except FleetUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return 1
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
        print(str(exc), file=sys.stderr)
        return 1
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mgpu_backend", description="comfyui-mgpu fleet: LTX-2 on several GPUs")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the fleet server in the foreground")
    _add_socket(serve)
    devices = serve.add_mutually_exclusive_group()
    devices.add_argument("--gpus", default=None, help="GPU indices, e.g. 0,1,2,3, or 'all' (default: all visible GPUs)")
    devices.add_argument("--cpu-ranks", type=int, default=None, help="run N CPU ranks with gloo instead of GPUs (default: none, GPUs; one CPU rank without CUDA)")
    serve.add_argument("--idle-timeout", type=float, default=float(os.environ.get("MGPU_IDLE_TIMEOUT", 3600)), help="exit after this many seconds without jobs (0: never; default 3600)")
    serve.add_argument("--rank-timeout", type=float, default=float(os.environ.get("MGPU_RANK_TIMEOUT", 600)), help="fail a job and restart the fleet when no rank progresses for this many seconds (default 600)")
    serve.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)

    status = commands.add_parser("status", help="show ranks, devices, memory, the current job and the queue")
    _add_socket(status)
    status.add_argument("--json", action="store_true", help="print machine-readable JSON (default: a few lines for people)")
    status.set_defaults(func=cmd_status)

    stop = commands.add_parser("stop", help="stop the fleet server and its ranks")
    _add_socket(stop)
    stop.set_defaults(func=cmd_stop)

    tiny = commands.add_parser("make-tiny", help="write the deterministic tiny LTX-2 bundle (random weights) to DIR")
    tiny.add_argument("directory")
    from mgpu_backend.bundles.configs import VERSIONS

    tiny.add_argument(
        "--version",
        choices=VERSIONS,
        default=VERSIONS[0],
        help="model version whose file layout the bundle follows: 2.0 (19B layout, default) or 2.3 (22B layout)",
    )
    tiny.set_defaults(func=cmd_make_tiny)

    from mgpu_backend.tools.comfy_queue import add_queue_parser
    from mgpu_backend.tools.doctor import add_doctor_parser
    from mgpu_backend.tools.generate import add_generate_parser

    add_generate_parser(commands)
    add_queue_parser(commands)
    add_doctor_parser(commands)

    rank = commands.add_parser("rank")  # no help=: argparse then leaves it out of the command list
    for name in ("--rank", "--world-size", "--fd", "--owner-pid"):
        rank.add_argument(name, type=int, required=True)
    rank.add_argument("--device", required=True)
    rank.add_argument("--store", required=True)
    rank.set_defaults(func=cmd_rank)
    # ``rank`` is internal (the server starts it): list every other command in --help and usage.
    commands.metavar = "{" + ",".join(name for name in commands.choices if name != "rank") + "}"
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
