"""The fleet's wire protocol: length-prefixed frames of a JSON header plus raw tensor bytes.

A frame is ``PREFIX`` (magic, protocol version, header length, payload length) followed by a UTF-8
JSON header and then the payload: the bytes of every tensor the header describes, in order. Tensors
larger than the socket should carry travel as shared-memory segments named in the header instead
(see ``shm``). Every header is validated before anything is allocated for the payload.

This module must never unpickle anything, and never trust a size or dtype it has not checked.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

PROTOCOL_VERSION = 1
MAGIC = b"MGPU"
PREFIX = struct.Struct(">4sHxxIQ")  # magic, version, 2 pad bytes, header length, payload length

MAX_HEADER_BYTES = 1 << 20  # 1 MiB of JSON is far more than any real message needs
MAX_PAYLOAD_BYTES = 1 << 30  # 1 GiB inline; larger tensors must go through shared memory
MAX_TENSORS = 256
MAX_DIMS = 8

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
    if dtype_name not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} sizes")
    if not all(isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 1 << 40 for size in shape):
        raise ProtocolError(f"tensor {name!r}: shape sizes must be non-negative integers")
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes != expected:
        raise ProtocolError(f"tensor {name!r}: nbytes {nbytes!r} does not match shape {shape} of {dtype_name}")
    return name, dtype, tuple(shape), expected


def encode(message: Message) -> list[bytes | memoryview]:
    """The frame for ``message`` as a list of buffers to send in order (no payload copy)."""
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
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(header_bytes), payload_len)
    return [prefix, header_bytes, *buffers]


def parse_header(header_bytes: bytes) -> tuple[dict[str, Any], list[tuple[str, torch.dtype, tuple[int, ...], int]]]:
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    if not isinstance(header.get("type"), str) or not 0 < len(header["type"]) <= 64:
        raise ProtocolError("header needs a 'type' string")
    if not isinstance(header.get("fields", {}), dict):
        raise ProtocolError("'fields' must be an object")
    if "job" in header and not isinstance(header["job"], str):
        raise ProtocolError("'job' must be a string")
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
        if not isinstance(desc.get("segment"), str):
            raise ProtocolError("shared-memory descriptor needs a 'segment' name")
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


def read_frame(read_exact, max_payload: int = MAX_PAYLOAD_BYTES) -> Message:
    """Read and validate one frame through ``read_exact(nbytes) -> bytes-like``."""
    magic, version, header_len, payload_len = PREFIX.unpack(read_exact(PREFIX.size))
    if magic != MAGIC:
        raise ProtocolError("bad magic: not an MGPU frame")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not {PROTOCOL_VERSION}; update both sides")
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds {max_payload}")
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
    """Read one frame from a socket. Raises ProtocolError if malformed, ConnectionClosed at EOF."""
    return read_frame(lambda nbytes: _recv_exact(sock, nbytes), max_payload)


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
    """Large kernel buffers: a 13 MB latent then crosses in a few system calls instead of hundreds."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass
    return sock


def send_message(sock: socket.socket, message: Message) -> None:
    for buffer in encode(message):
        sock.sendall(buffer)
