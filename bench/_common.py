"""Shared helpers of the bench scripts: device timing, random weights, markdown tables, machine line.

Every bench script prints one markdown table on stdout and nothing else (progress goes to stderr),
and with ``--out PATH`` also writes the table under a one-line header saying which command ran on
which machine and when, so a result pasted into docs/ carries its provenance.

This module never loads checkpoints or downloads anything, and never talks to other ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from mgpu_backend.fleet.shared_gpu import refuse_for_speed  # noqa: E402 - after the path line above

from mgpu_backend.bundles.random_weights import materialize_random_  # noqa: E402,F401 - one recipe for random weights


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure_logging() -> None:
    """The project's own one-line reports (tiles applied, decode statistics) go to stderr too."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send anything the measured code prints to stderr, so stdout holds the table only."""
    configure_logging()
    with contextlib.redirect_stdout(sys.stderr):
        yield


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name} asked for, but torch sees no CUDA device; use --device cpu with --tiny")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def bench_device(name: str | None, tiny: bool, what: str = "the full-size model (19B parameters)") -> tuple[torch.device, torch.dtype]:
    """The device a bench runs on (made current on a GPU) and its dtype; full size refuses the CPU."""
    device = resolve_device(name)
    if device.type != "cuda" and not tiny:
        raise SystemExit(f"{what} needs a GPU: use --device cuda, or --tiny on a CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, bench_dtype(device)


def bench_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs, as the pipeline runs; fp32 on CPU, where bf16 kernels are slow and unrepresentative."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        hardware = f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        hardware = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{hardware}, torch {torch.__version__}, Python {platform.python_version()}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IntervalTimer:
    """Times intervals of device work: CUDA events on a GPU (no synchronisation inside the measured
    code, so the intervals can sit inside a model call), wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[object, object]] = []

    @contextlib.contextmanager
    def interval(self) -> Iterator[None]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._pending.append((start, end))

    def milliseconds(self) -> list[float]:
        """Every recorded interval in order (waits for the device), and forgets them."""
        synchronize(self.device)
        if self.device.type == "cuda":
            values = [start.elapsed_time(end) for start, end in self._pending]
        else:
            values = [(end - start) * 1e3 for start, end in self._pending]
        self._pending = []
        return values


def time_calls(call: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls after ``warmup`` untimed ones, each call ending in a
    device synchronisation (so host overhead between kernels counts, as it does in a real step)."""
    for _ in range(warmup):
        call()
    synchronize(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_text(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    return f"{torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB"


# --------------------------------------------------------------------------------------------------
# Random weights at any size, made on the device itself
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(device: torch.device) -> str:
    """The line a result in docs/ stands under: which command ran on which machine, and when."""
    command = "python " + " ".join(shlex.quote(arg) for arg in sys.argv)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"`{command}` on {machine_description(device)}, {date}"


def emit(table: str, device: torch.device, out: str | None) -> None:
    """Print the table on stdout; with ``out`` also write it under a command/machine/date line."""
    print(table, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(provenance(device) + "\n\n" + table + "\n")
        log(f"table written to {out}")


def append_out(text: str, device: torch.device, out: str) -> None:
    """Append ``text`` to ``out`` under a command/machine/date line (a file that gathers several runs)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as file:
        file.write(f"\n{provenance(device)}\n\n{text}\n")
    log(f"results appended to {out}")


def bench_parser(description: str, *, tiny_help: str, warmup: int, repeats: int, unit: str, seed_help: str = "seed of the random weights and inputs") -> argparse.ArgumentParser:
    """The options every GPU bench takes: --tiny, --device, --warmup, --repeats, --seed, --out."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed {unit} (default {warmup})")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"timed {unit}; the median is reported (default {repeats})")
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument("--out", help="also write the table, under a command/machine/date line, to this file")
    return parser


def run_bench(parser: argparse.ArgumentParser, measure: Callable[[argparse.Namespace], str]) -> None:
    """Parse, check, measure with the logs on stderr, and print (and --out) the table."""
    args = parser.parse_args()
    refuse_for_speed(Path(sys.argv[0]).name)  # ranks sharing one GPU give no speed figures
    if args.warmup < 0 or args.repeats < 1:
        parser.error(f"--warmup must be >= 0 and --repeats >= 1, got {args.warmup} and {args.repeats}")
    if args.tiny and args.device is None:
        args.device = "cpu"
    with stdout_to_stderr():
        table = measure(args)
    emit(table, resolve_device(args.device), args.out)


class HostMemoryWatch:
    """The lowest ``MemAvailable`` of /proc/meminfo while a run goes on (sampled every 0.2 s on a thread):
    at full size a 22B checkpoint, its LoRA, Gemma and the ranks' host copies share the host's memory."""

    def __init__(self, every: float = 0.2) -> None:
        import threading

        self.every, self.lowest, self.total = every, None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    @staticmethod
    def _meminfo() -> dict[str, int]:
        with open("/proc/meminfo") as lines:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.split()[1:2] and line.split()[1].isdigit()}

    def _watch(self) -> None:
        while not self._stop.is_set():
            info = self._meminfo()
            self.total = info.get("MemTotal")
            available = info.get("MemAvailable")
            if available is not None and (self.lowest is None or available < self.lowest):
                self.lowest = available
            self._stop.wait(self.every)

    def __enter__(self) -> HostMemoryWatch:
        if Path("/proc/meminfo").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def describe(self) -> str:
        if self.lowest is None:
            return "host memory not watched (no /proc/meminfo)"
        return f"host memory available at its lowest {self.lowest / 1e9:.1f} GB of {self.total / 1e9:.1f} GB"
