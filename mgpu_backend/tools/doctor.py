"""``python -m mgpu_backend doctor``: the preflight to run when a multi-GPU setup is slow or broken.

It starts a short-lived fleet of its own (by default in a fresh private temp directory, so a fleet
that is already running is never attached to, queued behind or stopped), runs a few checks on it
and prints one section per check, each line OK / WARN / FAIL (INFO for facts, SKIP for checks that
do not apply), with a plain-language fix for every problem:

1. devices and memory (and whether LTX-2 19B fits: MGPU is a latency tool, not a memory tool);
2. peer-to-peer access between every pair of GPUs;
3. that the fleet starts;
4. all-reduce and all-to-all bandwidth and latency through the fleet's own Comm (NCCL or gloo);
5. whether the CUDA-IPC all-to-all kernel serves the SP exchange, and why or why not;
6. a tiny sequence-parallel faithfulness check on the devices at hand.

Exit code 0 when the fleet can work (warnings allowed), 1 when it cannot (any FAIL), 2 for bad
arguments. The measuring jobs live in ``diagnostics``; this module words the verdicts. It must never
touch a fleet it did not start, and never build the CUDA kernel where there is no CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mgpu_backend import PACKAGE_ROOT
from mgpu_backend.fleet import protocol
from mgpu_backend.fleet.addresses import ENV_SOCKET, Address, AddressError, ensure_private_dir
from mgpu_backend.fleet.client import FleetClient, FleetError, FleetUnavailable
from mgpu_backend.fleet.controller import DeviceSpec

TRANSFORMER_CONFIG_PATH = PACKAGE_ROOT / "configs" / "ltx2-19b-transformer.json"

# LTX-2 19B: 19e9 parameters x 2 bytes of bf16 on every GPU (SP and TDP replicate the weights), plus
# activations; below ~48 GB a GPU cannot hold a generation, however many GPUs share it.
MODEL_WEIGHT_BYTES = 38e9
RECOMMENDED_GPU_BYTES = 48e9
SLOW_GPU_ALL_TO_ALL_GBPS = 10.0  # below a PCIe 4 x16 link: SP exchanges will eat the speed-up

DOCTOR_IDLE_TIMEOUT = 300.0  # the doctor stops its fleet itself; this only guards against a crash
DOCTOR_RANK_TIMEOUT = 120.0  # a hung collective becomes a FAIL naming the rank instead of a hang

GPU_COLLECTIVE_SIZES = (1 << 20, 16 << 20, 64 << 20)
CPU_COLLECTIVE_SIZES = (64 << 10, 1 << 20, 4 << 20)
KERNEL_CHECK_BYTES = 16 << 20

# The SP check's model: the 19B configuration cut to 2 layers of tiny width, keeping its 32 video and
# 32 audio heads so the check accepts exactly the SP degrees a real run accepts.
SP_CHECK_OVERRIDES = {
    "num_layers": 2, "num_attention_heads": 32, "attention_head_dim": 4, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 2, "cross_attention_dim": 128, "audio_cross_attention_dim": 64, "caption_channels": 64,
}  # fmt: skip
SP_CHECK_ARGS: dict = {"seed": 0}  # extra job arguments; the doctor's tests add a reference perturbation here

ENVIRONMENT_PREFIXES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_", "MGPU_", "TORCH_NCCL_")
LEVELS = ("INFO", "SKIP", "OK", "WARN", "FAIL")

P2P_FIX = (
    "The fleet runs without P2P: NCCL routes such pairs through host memory (slower SP exchanges, and with residency "
    "'sharded' every forward gathers (N-1)/N of the transformer that way: docs/techniques.md) and the CUDA-IPC all-to-all kernel "
    "cannot serve them. Check the links with 'nvidia-smi topo -m' (NV# = NVLink, PIX/PXB = same PCIe "
    "switch, SYS = across CPU sockets); on bare metal turn off IOMMU remapping (iommu=pt) or PCIe ACS, in a "
    "VM enable peer-to-peer passthrough; or run the fleet on GPUs that share a switch (--gpus). If a job "
    "hangs, rerun with NCCL_P2P_DISABLE=1: if it then works, P2P is the cause."
)
COLLECTIVE_FIX = (
    "rerun with NCCL_DEBUG=INFO to see the transport NCCL picked; make sure no other process holds the "
    "GPUs (nvidia-smi); if the P2P section warned, try NCCL_P2P_DISABLE=1; the server log is kept at {log}"
)


@dataclass
class Line:
    level: str
    text: str
    fix: str | None = None
    detail: str | None = None

    def to_json(self) -> dict:
        return {key: value for key, value in vars(self).items() if value is not None}


@dataclass
class Section:
    """One check: its lines, and the numbers behind them for ``--json``."""

    key: str
    title: str
    lines: list[Line] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def add(self, level: str, text: str, fix: str | None = None, detail: str | None = None) -> None:
        assert level in LEVELS, level
        self.lines.append(Line(level, text, fix, detail))

    @property
    def status(self) -> str:
        """The worst verdict in the section; SKIP when nothing was judged."""
        judged = [line.level for line in self.lines if line.level in ("OK", "WARN", "FAIL")]
        if judged:
            return max(judged, key=LEVELS.index)
        return "SKIP" if any(line.level == "SKIP" for line in self.lines) else "OK"

    def to_json(self) -> dict:
        return {"title": self.title, "status": self.status, "lines": [line.to_json() for line in self.lines], "data": self.data}


@dataclass
class DoctorReport:
    devices: str
    socket: str
    sections: list[Section] = field(default_factory=list)

    def count(self, level: str) -> int:
        return sum(line.level == level for section in self.sections for line in section.lines)

    @property
    def exit_code(self) -> int:
        return 1 if self.count("FAIL") else 0

    def to_json(self) -> dict:
        return {
            "devices": self.devices,
            "socket": self.socket,
            "exit_code": self.exit_code,
            "failures": self.count("FAIL"),
            "warnings": self.count("WARN"),
            "sections": {section.key: section.to_json() for section in self.sections},
        }


# -- formatting --------------------------------------------------------------------------------------
def _gb(count: float) -> str:
    return f"{count / 1e9:.1f} GB"


def _size(count: int) -> str:
    return f"{count >> 20} MiB" if count >= 1 << 20 else f"{count >> 10} KiB"


def _limit(value: float) -> str:
    return f"{value:.0e}".replace("e-0", "e-")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def _tail(path: Path, lines: int = 15) -> str | None:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or None
    except OSError:
        return None


def format_section(number: int, section: Section) -> str:
    out = [f"[{number}] {section.title}"]
    for line in section.lines:
        out.append(textwrap.fill(line.text, 110, initial_indent=f"  {line.level:<4}  ", subsequent_indent=" " * 8))
        if line.fix:
            out.append(textwrap.fill(line.fix, 110, initial_indent="        fix: ", subsequent_indent=" " * 13))
        if line.detail:
            out.extend(f"        | {text}" for text in line.detail.splitlines())
    return "\n".join(out)


# -- checks run in this process (before and without the fleet) ----------------------------------------
def _host_memory() -> tuple[int, int | None]:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return total, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return total, None


def check_devices(devices: DeviceSpec, rank_memory: list[dict] | None) -> Section:
    """Versions, the devices the fleet runs on, their memory, and whether LTX-2 19B can fit on them.

    ``rank_memory`` is what each rank of the started fleet reported (free memory as a rank sees it),
    or None when the fleet did not start.
    """
    section = Section("devices", "Devices and memory")
    cuda_available = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda_available else None
    section.add("INFO", f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (a CPU build of torch)'}" + (f", NCCL {nccl}" if nccl else ""))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ram_total, ram_available = _host_memory()
    available = f" ({_gb(ram_available)} available)" if ram_available is not None else ""
    section.data.update(
        torch=torch.__version__, cuda=torch.version.cuda, nccl=nccl, cpu_cores=cores, ram_bytes=ram_total, ram_available_bytes=ram_available
    )
    environment = {name: value for name, value in os.environ.items() if name.startswith(ENVIRONMENT_PREFIXES) and name != ENV_SOCKET}
    if environment:
        section.add("INFO", "environment: " + ", ".join(f"{name}={value}" for name, value in sorted(environment.items())))
    section.data["environment"] = environment

    if not devices.gpus:
        section.data["gpus"] = []
        host = f"{cores} cores, {_gb(ram_total)} RAM{available}"
        if cuda_available:
            section.add("INFO", f"CPU ranks chosen ({devices.cpu_ranks}) on a host with {torch.cuda.device_count()} visible GPU(s); {host}",
                        fix="run 'python -m mgpu_backend doctor --gpus all' to check the GPUs")  # fmt: skip
        else:
            fix = (
                "install a CUDA build of torch (see https://pytorch.org/get-started/locally/)"
                if torch.version.cuda is None
                else "check that 'nvidia-smi' lists the GPUs and that CUDA_VISIBLE_DEVICES does not hide them"
            )
            section.add("WARN", f"CPU only: {host}. CPU ranks (gloo) serve tests and the tiny bundle; LTX-2 19B needs GPUs", fix=fix)
        return section

    gpus = []
    for rank, index in enumerate(devices.gpus):
        properties = torch.cuda.get_device_properties(index)
        memory = (rank_memory[rank] if rank_memory and rank < len(rank_memory) else None) or {}
        free = memory.get("free")
        gpus.append({"index": index, "name": properties.name, "total_bytes": properties.total_memory, "free_bytes": free})
        described = f"GPU {index}: {properties.name}, {_gb(properties.total_memory)} total, " + (
            f"{_gb(free)} free as its rank sees it" if free is not None else "free memory unknown (the fleet did not start)"
        )
        if properties.total_memory < RECOMMENDED_GPU_BYTES:
            section.add(
                "WARN",
                f"{described}: too small to hold LTX-2 19B whole (~{_gb(MODEL_WEIGHT_BYTES)} of bf16 weights plus "
                "activations); residency 'sharded' spreads the transformer over the fleet's GPUs (1/N each, gathered "
                "block by block), fp8-cast halves it",
                fix=f"load with residency 'sharded' (and quantization 'fp8-cast' on 24 GB cards), or use GPUs with at least {_gb(RECOMMENDED_GPU_BYTES)} each",
            )
        elif free is not None and free < RECOMMENDED_GPU_BYTES:
            section.add(
                "WARN",
                f"{described}: other processes hold {_gb(properties.total_memory - free)}, leaving less than the "
                f"~{_gb(RECOMMENDED_GPU_BYTES)} LTX-2 19B needs",
                fix="stop the processes 'nvidia-smi' lists on this GPU (an old fleet: 'python -m mgpu_backend stop'), "
                "or choose other GPUs with --gpus",
            )
        else:
            section.add("OK", f"{described}; room for LTX-2 19B (~{_gb(MODEL_WEIGHT_BYTES)} of bf16 weights per GPU)")
    section.data["gpus"] = gpus
    return section


def check_p2p(devices: DeviceSpec) -> Section:
    section = Section("p2p", "Peer-to-peer access between GPUs")
    if not devices.gpus:
        section.add("SKIP", "not applicable: CPU ranks exchange through gloo")
        section.data["matrix"] = None
        return section
    if len(devices.gpus) == 1:
        section.add("SKIP", "one GPU: there is no pair to check")
        section.data["matrix"] = None
        return section
    matrix = [[None if a == b else bool(torch.cuda.can_device_access_peer(a, b)) for b in devices.gpus] for a in devices.gpus]
    section.data.update(gpus=list(devices.gpus), matrix=matrix)
    width = max(5, *(len(f"GPU{gpu}") + 1 for gpu in devices.gpus))
    header = " " * width + "".join(f"{'GPU' + str(gpu):>{width}}" for gpu in devices.gpus)
    rows = [header] + [
        f"{'GPU' + str(a):<{width}}" + "".join(f"{'-' if ok is None else 'yes' if ok else 'NO':>{width}}" for ok in row)
        for a, row in zip(devices.gpus, matrix)
    ]
    section.add("INFO", "can_device_access_peer(row -> column):", detail="\n".join(rows))
    missing = [(a, b) for a, row in zip(devices.gpus, matrix) for b, ok in zip(devices.gpus, row) if ok is False]
    if missing:
        pairs = ", ".join(f"{a}->{b}" for a, b in missing)
        section.add("WARN", f"{len(missing)} GPU pair(s) without peer access: {pairs}", fix=P2P_FIX)
    else:
        section.add("OK", f"every pair of the {len(devices.gpus)} GPUs has peer access")
    return section


# -- the fleet ---------------------------------------------------------------------------------------
@contextmanager
def _without_env(name: str) -> Iterator[None]:
    """``FleetClient.connect`` never starts a server while MGPU_SOCKET names one; the doctor must."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def start_fleet(devices: DeviceSpec, address: Address) -> tuple[Section, FleetClient | None]:
    section = Section("fleet", "Fleet start-up")
    section.data.update(socket=str(address), log=str(address.directory / "server.log"))
    try:
        ensure_private_dir(address.directory)
    except (OSError, AddressError) as exc:
        section.add(
            "FAIL",
            f"cannot use {address.directory} for the doctor's fleet socket: {exc}",
            fix="pass --socket a path in a directory you own and may create (e.g. /tmp/mgpu-doctor/fleet.sock), or "
            "leave --socket out: the doctor then uses a fresh private temporary directory",
        )
        return section, None
    started = time.monotonic()
    try:
        with _without_env(ENV_SOCKET):
            client = FleetClient.connect(
                str(address), autostart=True, gpus=",".join(map(str, devices.gpus)) or None, cpu_ranks=devices.cpu_ranks or None,
                idle_timeout=DOCTOR_IDLE_TIMEOUT, rank_timeout=DOCTOR_RANK_TIMEOUT,
            )  # fmt: skip
        status = client.status()
    except (FleetError, OSError) as exc:
        log = address.directory / "server.log"
        section.add(
            "FAIL",
            f"the fleet on {devices.describe()} did not start: {exc}",
            fix=f"read the server log {log} (its end is below). Usual causes: GPUs held by other processes "
            "(nvidia-smi), a torch build that does not match the driver (python -c 'import torch; "
            "print(torch.cuda.is_available())'), or more CPU ranks than this machine can hold",
            detail=_tail(log),
        )
        return section, None
    seconds = time.monotonic() - started
    ranks = status.get("ranks", [])
    section.data.update(start_seconds=round(seconds, 3), world_size=len(ranks), server_pid=status.get("server_pid"), ranks=ranks)
    backend = "NCCL" if devices.gpus else "gloo"
    section.add("OK", f"fleet up in {seconds:.1f} s: {len(ranks)} rank(s), compute collectives over {backend}")
    for rank in ranks:
        section.add("INFO", f"rank {rank['rank']}: pid {rank['pid']} on {rank['device']}" + ("" if rank.get("alive", True) else " (DEAD)"))
    return section, client


def _wait_for_exit(pid: int, timeout: float = 20.0) -> bool:
    """Wait until the doctor's server (and with it its ranks) is gone, so the doctor never leaves
    processes holding GPUs; reaps it when it is this process's child."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:  # not our child: it is gone once the pid is
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.1)
    return False


def _job_failure(section: Section, what: str, exc: FleetError, fix: str) -> None:
    where = f" on rank {exc.rank}" if exc.rank is not None else ""
    detail = "\n".join(exc.traceback.strip().splitlines()[-8:]) if exc.traceback else None
    section.add("FAIL", f"{what} failed{where}: {exc}", fix=fix, detail=detail)


def check_collectives(client: FleetClient, devices: DeviceSpec, log: str) -> Section:
    section = Section("collectives", "Collective bandwidth through the fleet's Comm")
    if devices.world_size == 1:
        section.add("SKIP", "one rank: nothing is exchanged, so there is no collective to measure")
        return section
    on_gpu = bool(devices.gpus)
    sizes = GPU_COLLECTIVE_SIZES if on_gpu else CPU_COLLECTIVE_SIZES
    args = {"sizes_bytes": list(sizes), "iterations": 20 if on_gpu else 5, "warmup": 3 if on_gpu else 1}
    try:
        result = client.run("doctor_collectives", args).fields
    except FleetError as exc:
        _job_failure(section, "an all-reduce / all-to-all check", exc, COLLECTIVE_FIX.format(log=log))
        return section
    world = result["world_size"]
    # nccl-tests' convention: bus bandwidth scales algorithm bandwidth by the share of data that crosses links.
    bus_factor = {"all_reduce": 2 * (world - 1) / world, "all_to_all": (world - 1) / world}
    for measurement in result["results"]:
        measurement["algbw_gbps"] = measurement["bytes"] / measurement["seconds"] / 1e9
        measurement["busbw_gbps"] = measurement["algbw_gbps"] * bus_factor[measurement["op"]]
    section.data.update(backend=result["backend"], world_size=world, results=result["results"])
    rows = [f"{'size':>8}  {'all-reduce':>22}  {'all-to-all':>22}"]
    by_size: dict[int, dict[str, dict]] = {}
    for measurement in result["results"]:
        by_size.setdefault(measurement["bytes"], {})[measurement["op"]] = measurement
    for count, ops in by_size.items():
        cells = [f"{ops[op]['algbw_gbps']:7.2f} GB/s {_duration(ops[op]['seconds']):>10}" for op in ("all_reduce", "all_to_all")]
        rows.append(f"{_size(count):>8}  {cells[0]:>22}  {cells[1]:>22}")
    section.add("OK", f"all-reduce and all-to-all deliver correct data on all {world} ranks ({result['backend']}); "
                "algorithm bandwidth and time per call:", detail="\n".join(rows))  # fmt: skip
    largest = by_size[max(by_size)]["all_to_all"]
    if on_gpu and largest["algbw_gbps"] < SLOW_GPU_ALL_TO_ALL_GBPS:
        section.add(
            "WARN",
            f"all-to-all of {_size(largest['bytes'])} moves only {largest['algbw_gbps']:.1f} GB/s: SP's exchanges "
            "will eat much of its speed-up",
            fix="check the P2P section and 'nvidia-smi topo -m'; NCCL_DEBUG=INFO shows whether NCCL uses P2P/NVLink or "
            "falls back to SHM or the network; prefer GPUs joined by NVLink or one PCIe switch",
        )
    elif not on_gpu:
        section.add("INFO", "CPU ranks over gloo: these figures describe the test setup, not a GPU machine")
    return section


def check_all_to_all_kernel(client: FleetClient, devices: DeviceSpec, log: str) -> Section:
    section = Section("all_to_all_kernel", "CUDA-IPC all-to-all kernel")
    if not devices.gpus:
        section.add("SKIP", "not used: CPU ranks exchange through gloo; the kernel copies between GPUs only (nothing was built)")
        section.data["choice"] = None
        return section
    if devices.world_size == 1:
        section.add("SKIP", "not used: one GPU runs SP at degree 1, with no all-to-all to replace")
        section.data["choice"] = None
        return section
    try:
        result = client.run("doctor_all_to_all_kernel", {"bytes": KERNEL_CHECK_BYTES}).fields
    except FleetError as exc:
        _job_failure(section, "installing the all-to-all kernel", exc,
                     f"set MGPU_ALL_TO_ALL=torch to keep torch.distributed for SP, and report this output; server log: {log}")  # fmt: skip
        return section
    section.data.update(result)
    reasons = "; ".join(result["reasons"]) or "no reason logged"
    if result["choice"] == "cuda-ipc":
        difference = result["max_abs_diff_vs_torch"]
        if difference != 0.0:
            section.add("FAIL", f"the CUDA-IPC kernel delivered different data than torch.distributed (max abs difference {difference:g})",
                        fix="set MGPU_ALL_TO_ALL=torch so SP uses torch.distributed, and report this output")  # fmt: skip
            return section
        size, kernel, reference = result["bytes"], result["kernel_seconds"], result["torch_seconds"]
        section.add(
            "OK",
            f"the CUDA-IPC kernel works here, bit-identical to torch.distributed; {_size(size)}: "
            f"{size / kernel / 1e9:.1f} GB/s ({_duration(kernel)}) vs torch.distributed {size / reference / 1e9:.1f} GB/s "
            f"({_duration(reference)}); SP uses it with MGPU_ALL_TO_ALL=ipc, NCCL otherwise",
            detail=reasons,
        )
    elif os.environ.get("MGPU_ALL_TO_ALL", "").strip().lower() == "torch":
        section.add("OK", f"torch.distributed by choice (MGPU_ALL_TO_ALL=torch): {reasons}")
    else:
        section.add(
            "WARN",
            f"SP all-to-all falls back to torch.distributed (works, slower): {reasons}",
            fix="the reason says what would enable the kernel: CUDA with peer access between the GPUs (see the P2P "
            "section), and for its one-time build a CUDA toolkit (nvcc, or CUDA_HOME pointing at one) and ninja",
        )
    return section


def sp_check_config() -> tuple[dict, str]:
    """The SP check's transformer configuration and where its non-size options came from: the 19B
    configuration in a source checkout, else the tiny bundle's (an installed wheel has no configs/)."""
    if TRANSFORMER_CONFIG_PATH.is_file():
        transformer, source = json.loads(TRANSFORMER_CONFIG_PATH.read_text())["transformer"], str(TRANSFORMER_CONFIG_PATH)
    else:
        from mgpu_backend.bundles.tiny import TRANSFORMER_CONFIG

        transformer, source = dict(TRANSFORMER_CONFIG), "mgpu_backend.bundles.tiny.TRANSFORMER_CONFIG"
    return {"transformer": {**transformer, **SP_CHECK_OVERRIDES}}, source


def check_sequence_parallel(client: FleetClient, devices: DeviceSpec, log: str) -> Section:
    section = Section("sp_check", "Sequence-parallel faithfulness")
    config, source = sp_check_config()
    try:
        result = client.run("doctor_sp_check", {"config": config, **SP_CHECK_ARGS}).fields
    except FleetError as exc:
        _job_failure(section, "the SP check", exc, f"report this output (server log: {log}); meanwhile run stage 1 without SP (--parallel guidance)")
        return section
    section.data.update(result, config_source=source)
    heads = SP_CHECK_OVERRIDES["num_attention_heads"]
    degree, groups = result["sp_degree"], result["groups"]
    exchange = f"{result['exchange']} exchange" if degree > 1 else "no exchange at degree 1"
    section.add(
        "INFO",
        f"2-layer random LTX-2 transformer ({heads} heads, fp32), {result['video_tokens']} video + {result['audio_tokens']} "
        f"audio tokens: SP degree {degree} over ranks {groups[0]} ({exchange}) against the same model unsharded",
    )
    if degree < devices.world_size:
        section.add(
            "WARN",
            f"{devices.world_size} ranks do not divide the {heads} attention heads: SP can use at most {degree} of them "
            f"per group ({len(groups)} groups side by side, each running its own guidance passes)",
            fix="use 2, 4 or 8 GPUs to let one SP group span the whole fleet",
        )
    difference, warn_above, fail_above = result["max_abs_diff"], result["warn_above"], result["fail_above"]
    fix = (
        "do not trust SP results here: rerun with MGPU_ALL_TO_ALL=torch to rule out the CUDA-IPC kernel, run stage 1 "
        "without SP meanwhile (--parallel guidance), and report the 'doctor --json' output"
    )
    if not result["finite"]:
        section.add("FAIL", "the model produced NaN or inf values", fix=fix)
    elif difference > fail_above or math.isnan(difference):
        section.add("FAIL", f"SP disagrees with the unsharded model: max abs difference {difference:.3g} "
                    f"(outputs up to {result['output_scale']:.3g}; OK below {_limit(warn_above)})", fix=fix)  # fmt: skip
    elif difference > warn_above:
        section.add(
            "WARN",
            f"SP differs from the unsharded model by {difference:.3g}: more than fp32 rounding ({_limit(warn_above)}), "
            "less than a real disagreement",
            fix="TF32 may be on (torch.backends.cuda.matmul.allow_tf32, NVIDIA_TF32_OVERRIDE); if it is not, report this output",
        )
    else:
        section.add("OK", f"SP matches the unsharded model: max abs difference {difference:.3g} (OK below {_limit(warn_above)} in fp32)")
    return section


def _not_run(key: str, title: str, why: str) -> Section:
    section = Section(key, title)
    section.add("SKIP", f"not run: {why}")
    return section


def run_doctor(devices: DeviceSpec, socket_path: str | None = None, on_section: Callable[[Section], None] | None = None) -> DoctorReport:
    """Start a private fleet on ``devices``, run every check, stop the fleet, return the report.

    ``socket_path`` places the fleet's socket (default: a fresh private temporary directory, removed
    afterwards unless something failed, so its server log stays readable). ``on_section`` sees each
    section as soon as it is done.
    """
    own_directory = None
    if socket_path is None:
        own_directory = Path(tempfile.mkdtemp(prefix="mgpu-doctor-"))
        socket_path = str(own_directory / "fleet.sock")
    address = Address.parse(socket_path)
    report = DoctorReport(devices.describe(), str(address))

    def done(section: Section) -> None:
        report.sections.append(section)
        if on_section is not None:
            on_section(section)

    p2p = check_p2p(devices)  # before the fleet: peer access is what a hanging fleet most often lacks
    fleet, client = start_fleet(devices, address)
    try:
        rank_memory = [rank.get("memory") for rank in fleet.data.get("ranks", [])] if client else None
        done(check_devices(devices, rank_memory))
        done(p2p)
        done(fleet)
        checks = (
            ("collectives", "Collective bandwidth through the fleet's Comm", check_collectives),
            ("all_to_all_kernel", "CUDA-IPC all-to-all kernel", check_all_to_all_kernel),
            ("sp_check", "Sequence-parallel faithfulness", check_sequence_parallel),
        )
        lost = None
        for key, title, check in checks:
            if client is None or lost is not None:
                done(_not_run(key, title, lost or "the fleet did not start (see above)"))
                continue
            try:
                done(check(client, devices, fleet.data["log"]))
            except (OSError, protocol.ConnectionClosed, protocol.ProtocolError, FleetUnavailable) as exc:
                lost = f"the connection to the doctor's fleet server broke during '{title}'"
                section = Section(key, title)
                section.add("FAIL", f"{lost}: {type(exc).__name__}: {exc}", fix=f"read the server log {fleet.data['log']}",
                            detail=_tail(Path(fleet.data["log"])))  # fmt: skip
                done(section)
    finally:
        if client is not None:
            try:
                client.shutdown()
            except (OSError, protocol.ConnectionClosed, protocol.ProtocolError):
                pass  # already gone
            finally:
                client.close()
            _wait_for_exit(fleet.data["server_pid"])
    if own_directory is not None and report.exit_code == 0:
        shutil.rmtree(own_directory, ignore_errors=True)
    return report


# -- command line ------------------------------------------------------------------------------------
def add_doctor_parser(commands) -> argparse.ArgumentParser:
    """Register ``doctor`` on the CLI's sub-command parsers."""
    parser = commands.add_parser(
        "doctor", help="check devices, P2P, collectives, the all-to-all kernel and SP on a private short-lived fleet"
    )
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--gpus", default=None, help="GPU indices to check, e.g. 0,1,2,3, or 'all' (default: all visible GPUs)")
    devices.add_argument("--cpu-ranks", type=int, default=None, help="check N CPU ranks with gloo instead of GPUs")
    parser.add_argument(
        "--socket", default=None,
        help="socket path for the doctor's own fleet (default: a fresh private temporary directory); never one a fleet is using",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object with every check instead of text")
    parser.set_defaults(func=cmd_doctor)
    return parser


def _devices_from_arguments(gpus: str | None, cpu_ranks: int | None) -> DeviceSpec:
    """The devices to check, or ValueError saying what is wrong with the arguments."""
    if cpu_ranks is not None and cpu_ranks < 1:
        raise ValueError(f"--cpu-ranks must be at least 1, got {cpu_ranks}")
    devices = DeviceSpec.parse(gpus, cpu_ranks)
    visible = torch.cuda.device_count() if devices.gpus else 0
    absent = [gpu for gpu in devices.gpus if not 0 <= gpu < visible]
    if absent and not visible:
        raise ValueError(f"GPU {absent[0]} is not visible: no CUDA GPU is; use --cpu-ranks N to check CPU ranks")
    if absent:
        raise ValueError(f"GPU {absent[0]} is not visible: this process sees GPUs 0-{visible - 1}; pick from those or use --gpus all")
    return devices


def _check_socket_is_free(socket_path: str) -> None:
    """ValueError if a fleet already answers at ``socket_path``: the doctor must not disturb it."""
    try:
        FleetClient.connect(socket_path, autostart=False).close()
    except (FleetError, OSError, AddressError):
        return
    raise ValueError(
        f"a fleet server already answers at {socket_path}; the doctor starts its own fleet, so give --socket an "
        "unused path or leave it out"
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    try:
        devices = _devices_from_arguments(args.gpus, args.cpu_ranks)
        if args.socket is not None:
            Address.parse(args.socket)
            _check_socket_is_free(args.socket)
    except (ValueError, AddressError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if args.json:
        report = run_doctor(devices, args.socket)
        print(json.dumps(report.to_json(), indent=2))
        return report.exit_code

    print(f"comfyui-mgpu doctor: starting a private short-lived fleet on {devices.describe()}...", flush=True)
    numbers = iter(range(1, 100))
    report = run_doctor(devices, args.socket, on_section=lambda section: print("\n" + format_section(next(numbers), section), flush=True))
    failures, warnings = report.count("FAIL"), report.count("WARN")
    if failures:
        log = Path(report.socket).parent / "server.log"
        kept = f" (the doctor's server log stays at {log})" if log.exists() else ""
        print(f"\nresult: {failures} failure(s), {warnings} warning(s): the fleet cannot work as it is; fix the FAIL lines first{kept}")
    else:
        print(f"\nresult: the fleet can work ({warnings} warning(s))")
    return report.exit_code
