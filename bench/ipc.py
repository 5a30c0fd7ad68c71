"""IPC benchmark: socket round trip of a stage-2-sized latent, a large job input reaching every
rank, and the shared-memory frame handoff.

Starts its own fleet server with ``--ranks`` CPU ranks (this measures the plumbing, not the model;
with 2 or more ranks it includes rank 0's relay of each job to the others) and prints a table.
Targets: 13 MB round trip <= 20 ms; 2 GB handoff >= 2 GB/s. A large input goes to the server
as a shared-memory segment that every rank maps itself, so its round trip should not grow with
the input's size beyond the ranks' own reads of it.

    python bench/ipc.py [--ranks 2] [--repeats 10] [--input-mb 256] [--handoff-gb 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mgpu_backend.fleet.client import FleetClient  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--handoff-gb", type=float, default=2.0)
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks of the fleet (default 2)")
    parser.add_argument("--input-mb", type=float, default=256.0, help="size of the large job input (default 256 MB)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        socket_path = str(Path(tmp) / "bench.sock")
        client = FleetClient.connect(socket_path, cpu_ranks=args.ranks, idle_timeout=120)
        try:
            latent = torch.randn(1, 128, 16, 32, 48)  # 12.6 MB: a 1024x1536x121 stage-2 video latent
            client.run("echo", {}, {"latent": latent})  # warm-up
            round_trips = {"handed back": [], "new tensor": []}
            for _ in range(args.repeats):
                for kind, copy in (("handed back", False), ("new tensor", True)):
                    started = time.perf_counter()
                    result = client.run("echo", {"copy": copy}, {"latent": latent})
                    round_trips[kind].append(time.perf_counter() - started)
                    assert torch.equal(result.tensors["latent"], latent)

            large = torch.rand(int(args.input_mb * 1e6 / 8), dtype=torch.float64)  # echo sums it in float64: no copy
            relays = []
            for _ in range(max(3, args.repeats // 3)):
                started = time.perf_counter()
                result = client.run("echo", {}, {"large": large})  # handed back by reference
                relays.append(time.perf_counter() - started)
                assert result.fields["ranks_agreed"] == args.ranks
                del result

            numel = int(args.handoff_gb * 1e9 / 4)
            handoffs = []
            for _ in range(3):
                started = time.perf_counter()
                result = client.run("fill", {"numel": numel})
                values = result.tensors["values"]
                checksum = float(values[::1024].sum())  # touch every page of the mapping
                elapsed = time.perf_counter() - started - result.fields["fill_seconds"]
                handoffs.append(elapsed)
                assert checksum == float(values[::1024].numel())
                del values, result
        finally:
            client.shutdown()

    size_mb = latent.numel() * 4 / 1e6
    nbytes = numel * 4
    print("| measurement | size | median | best | target |")
    print("|---|---|---|---|---|")
    for kind, label in (("handed back", "the input handed back"), ("new tensor", "a new result tensor")):
        seconds = round_trips[kind]
        print(f"| round trip client -> rank 0 -> client, {label} | {size_mb:.1f} MB | {statistics.median(seconds) * 1e3:.1f} ms | {min(seconds) * 1e3:.1f} ms | <= 20 ms |")
    print(f"| large input to all {args.ranks} rank(s) and back, handed back | {large.nbytes / 1e6:.0f} MB | {statistics.median(relays) * 1e3:.1f} ms | {min(relays) * 1e3:.1f} ms | - |")
    print(f"| shared-memory handoff (rank 0 -> client) | {nbytes / 1e9:.2f} GB | {nbytes / statistics.median(handoffs) / 1e9:.2f} GB/s | {nbytes / min(handoffs) / 1e9:.2f} GB/s | >= 2 GB/s |")


if __name__ == "__main__":
    main()
