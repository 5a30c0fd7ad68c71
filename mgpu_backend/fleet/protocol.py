"""The fleet's wire protocol: length-prefixed frames of a JSON header plus raw tensor bytes.

A frame is ``PREFIX`` (magic, protocol version, header length, payload length) followed by a UTF-8
JSON header and then the payload: the bytes of every tensor the header describes, in order. Tensors
larger than the socket should carry travel as shared-memory segments named in the header instead
(see ``shm``). Every header is validated before anything is allocated for the payload; frames from
an untrusted peer (``recv_untrusted``: the server's clients) are read into a buffer that grows only
as bytes arrive, under a deadline, so a declared size or a stalled sender pins nothing. The
handshake's proofs (``handshake_proof``) let each side show it holds the token without sending it.

This module must never unpickle anything, and never trust a size or dtype it has not checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

PROTOCOL_VERSION = 2
MAGIC = b"MGPU"
PREFIX = struct.Struct(">4sHxxIQ")  # magic, version, 2 pad bytes, header length, payload length

MAX_HEADER_BYTES = 1 << 20  # 1 MiB of JSON is far more than any real message needs
HANDSHAKE_HEADER_BYTES = 4096  # before a peer has proved itself, its frames are tiny
MAX_PAYLOAD_BYTES = 1 << 30  # 1 GiB inline; larger tensors must go through shared memory
MAX_TENSORS = 256
MAX_DIMS = 8
# Every size and the element count (zero sizes counted as one, as strides are) stay far below 2**63,
# so no shape can overflow a stride or a byte count, even in a tensor of zero bytes.
MAX_DIM_SIZE = 1 << 32
MAX_ELEMENTS = 1 << 36
MAX_JSON_DEPTH = 32  # header nesting; real messages use fewer than 8 levels
MAX_JSON_INT = 1 << 63

# Reading an untrusted frame: memory grows as bytes arrive, never from a declared size, and a frame
# must arrive whole within FRAME_BASE_SECONDS plus its payload at FRAME_MIN_BYTES_PER_SECOND.
READ_CHUNK_BYTES = 1 << 20
FRAME_BASE_SECONDS = 10.0
FRAME_MIN_BYTES_PER_SECOND = 16 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class ProtocolError(Exception):
    """A frame that breaks the protocol. The connection that sent it is closed after an error reply."""


class FrameTimeout(ProtocolError):
    """A frame (or a handshake) did not arrive whole before its deadline."""


PREVIEW_MAX_BYTES = 16 << 20
"""A ``preview`` event carries one small image strip; anything bigger is not a preview."""


def preview_frames(message: Message) -> torch.Tensor:
    """The frames of a ``preview`` event: one tensor ``frames``, uint8 ``[n, height, width, 3]``,
    at most ``PREVIEW_MAX_BYTES``, with integer ``stage``, ``step`` and ``total`` fields (stage a string)."""
    frames = message.tensors.get("frames")
    if message.type != "preview" or set(message.tensors) != {"frames"} or message.shm:
        raise ProtocolError("a preview event carries exactly one inline tensor named 'frames'")
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
        raise ProtocolError(f"preview frames must be uint8 [n, height, width, 3], got {frames.dtype} {list(frames.shape)}")
    if frames.numel() > PREVIEW_MAX_BYTES:
        raise ProtocolError(f"preview of {frames.numel()} bytes exceeds {PREVIEW_MAX_BYTES}")
    fields = message.fields
    if not isinstance(fields.get("stage"), str) or not all(
        isinstance(fields.get(name), int) and not isinstance(fields.get(name), bool) for name in ("step", "total")
    ):
        raise ProtocolError("a preview event needs a 'stage' string and integer 'step' and 'total' fields")
    return frames


class ConnectionClosed(Exception):
    """The peer closed the connection (cleanly, or by dying)."""


@dataclass
class Message:
    """One frame: a type, an optional job id, JSON fields and named tensors."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    job: str | None = None
    shm: list[dict[str, Any]] = field(default_factory=list)  # shared-memory tensor descriptors


NONCE_HEX_DIGITS = 64


def handshake_proof(token: str, role: str, client_nonce: str, server_nonce: str) -> str:
    """What ``role`` ('server' or 'client') shows to prove it holds the token, without sending it:
    an HMAC of both sides' fresh nonces under the token. The role is part of the message, so one
    side's proof can never be replayed as the other's."""
    message = f"mgpu-handshake-v{PROTOCOL_VERSION}:{role}:{client_nonce}:{server_nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proof_matches(given: Any, expected: str) -> bool:
    return isinstance(given, str) and given.isascii() and hmac.compare_digest(given, expected)


def is_nonce(value: Any) -> bool:
    return isinstance(value, str) and len(value) == NONCE_HEX_DIGITS and all(c in "0123456789abcdef" for c in value)


def tensor_descriptor(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.dtype not in DTYPE_NAMES:
        raise ProtocolError(f"tensor {name!r} has dtype {tensor.dtype}, which the protocol does not carry")
    return {
        "name": name,
        "dtype": DTYPE_NAMES[tensor.dtype],
        "shape": list(tensor.shape),
        "nbytes": tensor.numel() * tensor.element_size(),
    }


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor in C order, without a copy when it is already contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def validate_descriptor(desc: Any) -> tuple[str, torch.dtype, tuple[int, ...], int]:
    """Check one tensor descriptor from an untrusted header; return (name, dtype, shape, nbytes)."""
    if not isinstance(desc, dict):
        raise ProtocolError("tensor descriptor must be an object")
    name, dtype_name, shape, nbytes = desc.get("name"), desc.get("dtype"), desc.get("shape"), desc.get("nbytes")
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        raise ProtocolError("tensor name must be a string of 1-128 characters")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:  # (a list is not even hashable)
        raise ProtocolError(f"tensor {name!r}: unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} sizes")
    if not all(isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_DIM_SIZE for size in shape):
        raise ProtocolError(f"tensor {name!r}: shape sizes must be integers from 0 to {MAX_DIM_SIZE}")
    if math.prod(max(size, 1) for size in shape) > MAX_ELEMENTS:
        raise ProtocolError(f"tensor {name!r}: shape {shape} has more than {MAX_ELEMENTS} elements")
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes != expected:
        raise ProtocolError(f"tensor {name!r}: nbytes {nbytes!r} does not match shape {shape} of {dtype_name}")
    return name, dtype, tuple(shape), expected


SMALL_FRAME_BYTES = 64 << 10  # a frame up to this size is sent in one write


def encode(message: Message) -> list[bytes | memoryview]:
    """The frame for ``message`` as a list of buffers to send in order: prefix and header in one
    buffer, the whole frame in one when it is small (one write, one TCP segment: no waiting on
    Nagle's algorithm), larger tensor payloads as they are (no copy)."""
    descriptors, buffers = [], []
    for name, tensor in message.tensors.items():
        descriptors.append(tensor_descriptor(name, tensor))
        buffers.append(tensor_bytes(tensor))
    header = {"type": message.type, "fields": message.fields, "tensors": descriptors}
    if message.job is not None:
        header["job"] = message.job
    if message.shm:
        header["shm"] = message.shm
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    payload_len = sum(len(buffer) for buffer in buffers)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_len > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD_BYTES}; use shared memory")
    head = PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(header_bytes), payload_len) + header_bytes
    if len(head) + payload_len <= SMALL_FRAME_BYTES:
        return [b"".join([head, *buffers])]
    return [head, *buffers]


def _check_json(value: Any) -> None:
    """Refuse what json.loads lets through but nothing downstream can use: deep nesting, strings
    that cannot be encoded again (lone surrogates), integers beyond 64 bits, NaN and infinities."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ProtocolError(f"header is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((key, depth + 1) for key in item)
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ProtocolError("header holds a string that is not valid Unicode (a lone surrogate)") from None
        elif isinstance(item, bool) or item is None:
            pass
        elif isinstance(item, int):
            if not -MAX_JSON_INT <= item < MAX_JSON_INT:
                raise ProtocolError("header holds an integer beyond 64 bits")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ProtocolError("header holds NaN or an infinity")


def parse_header(header_bytes: bytes) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...], int]]]:
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also huge int literals
        raise ProtocolError(f"header is not valid JSON: {str(exc)[:200]}") from None
    _check_json(header)
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    if not isinstance(header.get("type"), str) or not 0 < len(header["type"]) <= 64:
        raise ProtocolError("header needs a 'type' string")
    if not isinstance(header.get("fields", {}), dict):
        raise ProtocolError("'fields' must be an object")
    if "job" in header and not (isinstance(header["job"], str) and len(header["job"]) <= 64):
        raise ProtocolError("'job' must be a string of at most 64 characters")
    tensors = header.get("tensors", [])
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise ProtocolError(f"'tensors' must be a list of at most {MAX_TENSORS} descriptors")
    descriptors = [validate_descriptor(desc) for desc in tensors]
    if len({name for name, *_ in descriptors}) != len(descriptors):
        raise ProtocolError("tensor names must be unique")
    shm = header.get("shm", [])
    if not isinstance(shm, list) or len(shm) > MAX_TENSORS:
        raise ProtocolError("'shm' must be a list of descriptors")
    for desc in shm:
        validate_descriptor(desc)
        if not isinstance(desc.get("segment"), str) or not 0 < len(desc["segment"]) <= 128:
            raise ProtocolError("shared-memory descriptor needs a 'segment' name of 1-128 characters")
    return header, descriptors


def _recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    received = 0
    while received < nbytes:
        try:
            count = sock.recv_into(view[received:], nbytes - received)
        except ConnectionResetError:
            raise ConnectionClosed("connection reset") from None
        if count == 0:
            raise ConnectionClosed("peer closed the connection")
        received += count
    return buffer


class ByteBudget:
    """Bytes that frames being read may hold at once, shared by every connection of a server."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self.lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self.lock:
            self.used -= nbytes


class _UntrustedReader:
    """``read_exact`` for frames from an untrusted peer: a buffer that grows by chunks as bytes
    arrive (a declared size reserves nothing), taken from a shared ``budget``, and a deadline that
    starts at the frame's first byte (or is given: the handshake's), so a peer can neither pin
    memory nor trickle a frame forever."""

    def __init__(self, sock: socket.socket, deadline: float | None, budget: ByteBudget | None = None) -> None:
        self.sock, self.deadline, self.fixed_deadline = sock, deadline, deadline is not None
        self.budget, self.taken = budget, 0
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    def allow(self, payload_len: int) -> None:
        if not self.fixed_deadline and self.deadline is not None:
            self.deadline += payload_len / FRAME_MIN_BYTES_PER_SECOND

    def __call__(self, nbytes: int) -> bytearray:
        buffer = bytearray()
        while len(buffer) < nbytes:
            if self.deadline is not None:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0 or not self.poller.poll(remaining * 1000):
                    what = "the handshake" if self.fixed_deadline else "a frame"
                    raise FrameTimeout(f"{what} did not arrive whole in time; send whole frames without pausing")
            want = min(READ_CHUNK_BYTES, nbytes - len(buffer))
            if self.budget is not None:
                if not self.budget.take(want):
                    raise ProtocolError(
                        f"the server is already reading {self.budget.limit / 2**30:.1f} GiB of frames; retry later, "
                        "or send large tensors through shared memory"
                    )
                self.taken += want
            try:
                chunk = self.sock.recv(want)
            except (ConnectionResetError, BrokenPipeError):
                raise ConnectionClosed("connection reset") from None
            if not chunk:
                raise ConnectionClosed("peer closed the connection")
            if self.deadline is None:
                self.deadline = time.monotonic() + FRAME_BASE_SECONDS
            buffer += chunk
        return buffer


def read_frame(read_exact, max_payload: int = MAX_PAYLOAD_BYTES, on_sizes=None, max_header: int = MAX_HEADER_BYTES) -> Message:
    """Read and validate one frame through ``read_exact(nbytes) -> bytes-like``; ``on_sizes`` hears
    the payload length once the prefix is checked."""
    magic, version, header_len, payload_len = PREFIX.unpack(read_exact(PREFIX.size))
    if magic != MAGIC:
        raise ProtocolError("bad magic: not an MGPU frame")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not {PROTOCOL_VERSION}; update both sides")
    if header_len > max_header:
        raise ProtocolError(f"header of {header_len} bytes exceeds {max_header}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds {max_payload}")
    if on_sizes is not None:
        on_sizes(payload_len)
    header, descriptors = parse_header(bytes(read_exact(header_len)))
    if sum(nbytes for *_, nbytes in descriptors) != payload_len:
        raise ProtocolError("payload length does not match the tensor descriptors")
    tensors = {name: bytes_to_tensor(read_exact(nbytes), dtype, shape) for name, dtype, shape, nbytes in descriptors}
    return Message(
        type=header["type"],
        fields=header.get("fields", {}),
        tensors=tensors,
        job=header.get("job"),
        shm=header.get("shm", []),
    )


def recv_message(sock: socket.socket, max_payload: int = MAX_PAYLOAD_BYTES) -> Message:
    """Read one frame from a trusted peer. Raises ProtocolError if malformed, ConnectionClosed at EOF."""
    return read_frame(lambda nbytes: _recv_exact(sock, nbytes), max_payload)


def recv_untrusted(
    sock: socket.socket,
    max_payload: int = MAX_PAYLOAD_BYTES,
    deadline: float | None = None,
    max_header: int = MAX_HEADER_BYTES,
    budget: ByteBudget | None = None,
) -> Message:
    """Read one frame from a peer that may be hostile (the server's clients): memory is reserved
    only as bytes arrive, from ``budget`` while the frame is being read, and the frame must be whole
    by ``deadline`` (``time.monotonic()``), or by its own deadline counted from its first byte.
    The socket must be blocking (no timeout)."""
    reader = _UntrustedReader(sock, deadline, budget)
    try:
        return read_frame(reader, max_payload, on_sizes=reader.allow, max_header=max_header)
    finally:
        if budget is not None:
            budget.give(reader.taken)


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Parse one whole frame held in memory (used to relay a job from rank 0 to the other ranks)."""
    view = memoryview(frame)
    offset = 0

    def read_exact(nbytes: int) -> bytearray:
        nonlocal offset
        if offset + nbytes > len(view):
            raise ProtocolError("frame is truncated")
        chunk = bytearray(view[offset : offset + nbytes])
        offset += nbytes
        return chunk

    message = read_frame(read_exact)
    if offset != len(view):
        raise ProtocolError("trailing bytes after the frame")
    return message


def bytes_to_tensor(raw: bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    storage_dtype = torch.uint8 if dtype == torch.bool else dtype
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    tensor = torch.frombuffer(raw, dtype=torch.uint8).view(storage_dtype).reshape(shape)
    return tensor.to(torch.bool) if dtype == torch.bool else tensor


SOCKET_BUFFER_BYTES = 4 << 20


def tune_socket(sock: socket.socket) -> socket.socket:
    """Large kernel buffers: a 13 MB latent then crosses in a few system calls instead of hundreds.
    Over TCP, no Nagle delay: a request's last segment otherwise waits for the peer's delayed ACK
    (tens of milliseconds per request)."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
    return sock


def send_message(sock: socket.socket, message: Message) -> None:
    for buffer in encode(message):
        sock.sendall(buffer)
