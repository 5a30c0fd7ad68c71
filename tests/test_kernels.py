"""mgpu_kernels/: the CUDA-IPC all-to-all and the collective choice between it and torch.distributed.

CPU tests (everywhere): the exchange layout the kernel copies by, the Comm hook, and the fallback
selection (no CUDA, a build failure on one rank, a peer buffer that cannot be opened). GPU tests
(``-m gpu``): several processes share the one GPU, exchange through CUDA IPC, and must equal, bit
for bit, the reference built from the inputs and the one built from the inputs gathered over gloo;
a peer that never arrives must turn into ``AllToAllTimeout`` within the timeout.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import mgpu_kernels
from mgpu_kernels import build as kernel_build
from mgpu_kernels import install as kernel_install
from mgpu_kernels.ipc_all_to_all import ExchangeLayout
from mgpu_backend.parallel.comm import Comm
from tests.dist_harness import run_ranks

# (shape, scatter_dim, gather_dim): the SP exchanges (qkv token->head, output head->token), odd
# sizes that force 2-byte copy units, equal dims, negative dims, and 1-D.
SHAPES = [
    ((3, 1, 40, 8, 16), 3, 2),
    ((1, 96, 8, 16), 1, 2),
    ((2, 1, 24, 8, 16), 3, 2),
    ((64,), 0, 0),
    ((2, 12, 5, 3), 1, 1),
    ((4, 1000, 7), 1, 0),
    ((8, 6, 9), 0, -1),
    ((5, 8, 3, 2), -3, 2),
]


def _reference(inputs: list[torch.Tensor], rank: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """What ``rank`` receives: chunk ``rank`` of every rank's input, concatenated in rank order."""
    world = len(inputs)
    return torch.cat([x.chunk(world, dim=scatter_dim)[rank] for x in inputs], dim=gather_dim)


def _inputs(shape, dtype, world: int, case: int) -> list[torch.Tensor]:
    """Every rank's input of one case, the same on every rank (each rank builds all of them)."""
    tensors = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(1000 * case + rank)
        tensors.append(torch.randn(shape, generator=generator).to(dtype))
    return tensors


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _emulate_kernel(layout: ExchangeLayout, inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What the kernel writes into ``rank``'s receive buffer: its index formula, element by element."""
    world = layout.world_size
    flat = torch.arange(layout.chunk_numel)
    inner, gather_inner = layout.inner, layout.gather_inner
    received = torch.full((layout.chunk_numel * world,), float("nan"))
    for sender, x in enumerate(inputs):
        source = (flat // inner) * world * inner + rank * inner + flat % inner
        target = (flat // gather_inner) * world * gather_inner + sender * gather_inner + flat % gather_inner
        received[target] = x.reshape(-1)[source]
    return received.view(layout.output_shape)


# --- CPU: layout, hook, selection ---------------------------------------------------------------


def test_kernel_index_formula_puts_every_element_where_all_to_all_does():
    worst = 0.0
    cases = 0
    for world in (2, 3, 4, 8):
        for case, (shape, scatter_dim, gather_dim) in enumerate(SHAPES):
            shape = list(shape)
            shape[scatter_dim] *= world  # make the scatter dim divide by every world size
            layout = ExchangeLayout.of(tuple(shape), scatter_dim, gather_dim, world)
            inputs = _inputs(tuple(shape), torch.float32, world, case)
            for rank in range(world):
                expected = _reference(inputs, rank, scatter_dim, gather_dim)
                emulated = _emulate_kernel(layout, inputs, rank)
                assert emulated.shape == expected.shape == layout.output_shape, (shape, scatter_dim, gather_dim)
                assert not emulated.isnan().any(), f"elements left unwritten for {shape} {scatter_dim}->{gather_dim}"
                worst = max(worst, _max_abs(emulated, expected))
                cases += 1
    assert worst == 0.0, f"emulated kernel differs from the reference by up to {worst} over {cases} cases"


def test_exchange_layout_refuses_a_scatter_dim_that_does_not_divide_and_says_how_to_pad():
    with pytest.raises(ValueError, match=r"size 30 does not divide by 4; pad it to 32"):
        ExchangeLayout.of((1, 30, 8), 1, 2, 4)
    with pytest.raises(ValueError, match=r"scatter_dim 3 is out of range"):
        ExchangeLayout.of((1, 30, 8), 3, 2, 2)


def _rank_hook_routes_and_restores():
    comm = Comm.world()
    x = torch.arange(24, dtype=torch.float32).view(2, 12) + 100 * comm.rank
    calls = []

    def marked_exchange(tensor, scatter_dim, gather_dim):
        calls.append((tuple(tensor.shape), scatter_dim, gather_dim))
        return torch.full((7,), float(comm.rank))

    comm.use_all_to_all(marked_exchange)
    routed = comm.all_to_all(x, 1, 0)
    comm.use_all_to_all(None)
    restored = comm.all_to_all(x, 1, 0)
    fallback = comm.torch_all_to_all(x, 1, 0)
    return calls, routed, restored, fallback


def test_comm_all_to_all_runs_the_installed_exchange_and_none_restores_torch_distributed():
    results = run_ranks(2, _rank_hook_routes_and_restores)
    inputs = [torch.arange(24, dtype=torch.float32).view(2, 12) + 100 * rank for rank in range(2)]
    for rank, (calls, routed, restored, fallback) in enumerate(results):
        assert calls == [((2, 12), 1, 0)], calls
        assert torch.equal(routed, torch.full((7,), float(rank))), routed
        expected = _reference(inputs, rank, 1, 0)
        assert torch.equal(restored, expected), f"rank {rank}: max abs diff {_max_abs(restored, expected)}"
        assert torch.equal(fallback, expected), f"rank {rank}: max abs diff {_max_abs(fallback, expected)}"
    assert Comm(None).all_to_all(inputs[0], 1, 0) is inputs[0]


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _capture_kernel_logs() -> _LogLines:
    handler = _LogLines()
    logger = logging.getLogger("mgpu_kernels")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler


def _exchange_after_install(comm: Comm, case: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = _inputs((2, 4 * comm.world_size, 3), torch.float32, comm.world_size, case)
    return comm.all_to_all(inputs[comm.rank], 1, 2), _reference(inputs, comm.rank, 1, 2)


def _rank_without_cuda():
    torch.cuda.is_available = lambda: False  # this rank process only
    logs = _capture_kernel_logs()
    comm = Comm.world()
    choices = [mgpu_kernels.install_fast_all_to_all(comm), mgpu_kernels.install_fast_all_to_all(comm)]
    received, expected = _exchange_after_install(comm, case=1)
    return choices, logs.lines, received, expected


def test_without_cuda_every_rank_keeps_torch_distributed_and_logs_why_once():
    for rank, (choices, lines, received, expected) in enumerate(run_ranks(2, _rank_without_cuda)):
        assert choices == ["torch.distributed", "torch.distributed"], choices
        fallback_lines = [line for line in lines if "CUDA IPC kernel not used" in line]
        assert fallback_lines == [
            "all-to-all over ranks [0, 1]: torch.distributed (gloo); CUDA IPC kernel not used: "
            "every rank: CUDA is not available in this process"
        ], lines
        assert torch.equal(received, expected), f"rank {rank}: max abs diff {_max_abs(received, expected)}"


class _FakeExchange:
    """Stands in for IpcAllToAll on a CPU machine: records what the selection asks of it."""

    def __init__(self, fail_open: bool) -> None:
        self.fail_open = fail_open
        self.steps: list[str] = []

    def allocate(self) -> bytes:
        self.steps.append("allocate")
        return bytes(64)

    def open_peers(self, handles) -> None:
        self.steps.append(f"open {len(handles)}")
        if self.fail_open:
            raise RuntimeError("CUDA IPC all-to-all: opening the receive buffer of peer 0 failed: peer access is not supported")

    def release_local(self) -> None:
        self.steps.append("release")

    def close(self) -> None:
        self.steps.append("close")


def _rank_with_one_failing_rank(failure: str):
    comm = Comm.world()
    logs = _capture_kernel_logs()
    fake = _FakeExchange(fail_open=failure == "open" and comm.rank == 1)

    def local_exchange(*args, **kwargs):
        if failure == "build" and comm.rank == 1:
            raise mgpu_kernels.KernelUnavailable("building ipc_all_to_all.cu in /cache failed: RuntimeError: nvcc exploded")
        return fake

    kernel_install._local_exchange = local_exchange
    choice = mgpu_kernels.install_fast_all_to_all(comm)
    received, expected = _exchange_after_install(comm, case=2)
    return choice, fake.steps, logs.lines, received, expected


def test_a_build_failure_on_one_rank_makes_every_rank_fall_back():
    results = run_ranks(2, _rank_with_one_failing_rank, "build")
    for rank, (choice, steps, lines, received, expected) in enumerate(results):
        assert choice == "torch.distributed", (rank, choice)
        assert steps == (["allocate", "release"] if rank == 0 else []), (rank, steps)
        assert any("rank 1: building ipc_all_to_all.cu in /cache failed: RuntimeError: nvcc exploded" in line
                   for line in lines), lines
        assert torch.equal(received, expected), f"rank {rank}: max abs diff {_max_abs(received, expected)}"


def test_a_peer_buffer_that_cannot_be_opened_makes_every_rank_fall_back():
    results = run_ranks(2, _rank_with_one_failing_rank, "open")
    for rank, (choice, steps, lines, received, expected) in enumerate(results):
        assert choice == "torch.distributed", (rank, choice)
        assert steps == ["allocate", "open 2", "close"], (rank, steps)
        assert any("rank 1: RuntimeError: CUDA IPC all-to-all: opening the receive buffer of peer 0 failed" in line
                   for line in lines), lines
        assert torch.equal(received, expected), f"rank {rank}: max abs diff {_max_abs(received, expected)}"


def test_mgpu_all_to_all_torch_switches_the_kernel_off(monkeypatch):
    monkeypatch.setenv("MGPU_ALL_TO_ALL", "torch")
    with pytest.raises(mgpu_kernels.KernelUnavailable, match="MGPU_ALL_TO_ALL=torch asks for torch.distributed"):
        kernel_install._local_exchange(Comm(None), None, 30.0, 1 << 20, 1 << 30)
    monkeypatch.setenv("MGPU_ALL_TO_ALL", "fast")
    with pytest.raises(ValueError, match="must be 'ipc', 'auto' or 'torch', got 'fast'"):
        kernel_install._local_exchange(Comm(None), None, 30.0, 1 << 20, 1 << 30)


def test_a_failed_build_becomes_a_reason_not_an_exception(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def failing_load(**kwargs):
        raise RuntimeError("Error building extension 'mgpu_ipc_all_to_all': nvcc fatal")

    monkeypatch.setenv(kernel_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernel_build, "_why_not_buildable", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    outcome = kernel_build._build_and_open()
    assert isinstance(outcome, mgpu_kernels.KernelUnavailable), outcome
    assert "ipc_all_to_all.cu" in str(outcome) and "failed: RuntimeError: Error building extension" in str(outcome)
    assert str(tmp_path) in str(outcome), str(outcome)


# --- GPU: several processes on the one GPU, exchanging over CUDA IPC -------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gather_over_gloo(comm: Comm, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's actual input, gathered as raw bytes through gloo (which moves uint8 in every
    torch version, unlike bf16 or a list all-to-all)."""
    raw = tensor.contiguous().view(-1).view(torch.uint8)
    gathered = comm.all_gather(raw.unsqueeze(0), dim=0)
    return [row.view(tensor.dtype).view(tensor.shape) for row in gathered.unbind(0)]


def _rank_kernel_against_references(timeout_s: float):
    torch.cuda.set_device(0)
    comm = Comm.world()
    world = comm.world_size
    choice = mgpu_kernels.install_fast_all_to_all(comm, timeout_s=timeout_s, buffer_bytes=1 << 20)
    exchange = kernel_install._installed.get(comm)
    first_capacity = exchange.capacity if exchange else 0
    report = []
    cases = [(shape, s, g, False) for shape, s, g in SHAPES] + [
        ((3, 1, 512, 32, 64), 3, 2, False),  # 6 MiB bf16 per rank: past the first buffer, so it grows
        ((4, 8, 6), 1, 2, True),  # a non-contiguous input (a transposed view)
    ]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for case, (shape, scatter_dim, gather_dim, transposed) in enumerate(cases):
            shape = list(shape)
            shape[scatter_dim] *= world
            inputs = _inputs(tuple(shape), dtype, world, case)
            if transposed:
                inputs = [x.transpose(0, 2) for x in inputs]
            expected = _reference(inputs, comm.rank, scatter_dim, gather_dim)
            on_gpu = comm.all_to_all(inputs[comm.rank].cuda(), scatter_dim, gather_dim)
            gathered = _reference(_gather_over_gloo(comm, inputs[comm.rank]), comm.rank, scatter_dim, gather_dim)
            report.append((str(dtype), tuple(shape), scatter_dim, gather_dim,
                           _max_abs(on_gpu.cpu(), expected), bool(torch.equal(on_gpu.cpu(), expected)),
                           _max_abs(on_gpu.cpu(), gathered)))
        # An input 2 bytes past an aligned address: the kernel must not read it with 16-byte loads.
        flat = _inputs((1 + 64 * world,), dtype, world, 99)
        offset = [x[1:] for x in flat]
        on_gpu = comm.all_to_all(flat[comm.rank].cuda()[1:], 0, 0)
        expected = _reference(offset, comm.rank, 0, 0)
        report.append((str(dtype), "offset view", 0, 0, _max_abs(on_gpu.cpu(), expected),
                       bool(torch.equal(on_gpu.cpu(), expected)), 0.0))
    # A CPU tensor on a Comm with the kernel installed goes to the torch.distributed path (recorded
    # here rather than run: the GPU machine's torch 2.11 gloo has no list all-to-all).
    delegated = []
    comm.torch_all_to_all = lambda tensor, s, g: delegated.append((tensor.device.type, s, g)) or tensor
    comm.all_to_all(torch.zeros(2, 4 * world), 1, 0)
    return choice, first_capacity, exchange.capacity if exchange else 0, exchange.epoch if exchange else 0, report, delegated


def _assert_kernel_matches(world: int) -> None:
    results = run_ranks(world, _rank_kernel_against_references, 20.0)
    for rank, (choice, first_capacity, last_capacity, epochs, report, delegated) in enumerate(results):
        assert choice == "cuda-ipc", f"rank {rank} fell back to {choice}"
        assert last_capacity > first_capacity, f"rank {rank}: the receive buffer never grew ({first_capacity})"
        assert epochs == len(report), f"rank {rank}: {epochs} kernel launches for {len(report)} exchanges"
        bad = [row for row in report if not row[5] or row[6] != 0.0]
        worst = max(row[4] for row in report)
        assert not bad, f"rank {rank}: {len(bad)} of {len(report)} exchanges differ (worst max abs diff {worst}): {bad[:4]}"
        assert delegated == [("cpu", 1, 0)], f"rank {rank}: a CPU tensor was not handed to torch.distributed: {delegated}"


@pytest.mark.gpu
@gpu
def test_cuda_ipc_all_to_all_equals_gathered_reference_bf16_fp16_fp32_two_ranks_one_gpu():
    _assert_kernel_matches(2)


@pytest.mark.gpu
@gpu
def test_cuda_ipc_all_to_all_equals_gathered_reference_bf16_fp16_fp32_four_ranks_one_gpu():
    _assert_kernel_matches(4)


def _rank_with_a_missing_peer(timeout_s: float):
    torch.cuda.set_device(0)
    comm = Comm.world()
    choice = mgpu_kernels.install_fast_all_to_all(comm, timeout_s=timeout_s)
    message, later = "", ""
    if comm.rank == 0:  # rank 1 never enters the exchange
        x = torch.randn(4, 64, device="cuda")
        try:
            comm.all_to_all(x, 1, 0)
        except mgpu_kernels.AllToAllTimeout as timeout:
            message = str(timeout)
        try:
            comm.all_to_all(x, 1, 0)
        except RuntimeError as error:
            later = str(error)
    dist.barrier()  # rank 1 stays alive (its buffer mapped) until rank 0 has given up
    return choice, message, later


@pytest.mark.gpu
@gpu
def test_cuda_ipc_all_to_all_raises_its_1_s_timeout_error_then_stays_out_of_service_when_a_peer_never_arrives():
    (choice, message, later), (choice_1, _, _) = run_ranks(2, _rank_with_a_missing_peer, 1.0)
    assert choice == choice_1 == "cuda-ipc", (choice, choice_1)
    assert message.startswith("all-to-all peer 1 did not arrive within 1.0 s"), message
    assert "out of service after an earlier failure" in later, later
