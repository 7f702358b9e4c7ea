"""The side channel's wire format: framed messages over a socket, and tensors in them.

Owns: encoding and decoding frames, staging CUDA tensors through a pinned host buffer, and handing
a frame's tensor to the pair group (`device_channel`) when the link has one. Must not know:
endpoints, links, models, membership.

Frame: 4-byte big-endian header length, UTF-8 JSON header, 8-byte big-endian payload length, raw
payload (a contiguous tensor's bytes; dtype and shape are in the header). No pickle: a frame is
data, never code.

A frame whose tensor goes over the pair group carries `via: "group"` with dtype and shape and no
payload; the tensor's bytes follow as one broadcast on the group.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from libra.services.trainer.elastic import device_channel as dc

_HEADER = struct.Struct(">I")
_PAYLOAD = struct.Struct(">Q")
MAX_HEADER = 64 * 1024 * 1024
CLOSED = "closed"  # kind of the frame a reader queues when its connection ends


@dataclass
class Frame:
    kind: str
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytearray = field(default_factory=bytearray)
    pending: Any = None  # a receive over the pair group in flight (core side, until wait_grad)
    received: Any = None  # the tensor that came over the pair group

    def tensor(self) -> Any:
        """The tensor: the one received over the pair group, else the payload as a CPU tensor of
        the header's dtype and shape (no copy: it views the buffer)."""
        import torch

        if self.received is not None:
            return self.received
        dtype = getattr(torch, self.header["dtype"])
        if not self.payload:
            return torch.empty(self.header["shape"], dtype=dtype)
        return torch.frombuffer(self.payload, dtype=torch.uint8).view(dtype).reshape(self.header["shape"])


@dataclass
class Encoded:
    """A frame ready to go: header bytes and either host bytes, a device tensor to stage, or a
    tensor for the pair group (the sender broadcasts it after the head, behind the same event).

    Encoding happens in the caller's thread and costs nothing on the training stream: a CUDA
    tensor only gets an event recorded after it. The sender (the link's outbox thread, or the
    caller under the write lock) copies it into a reusable pinned host buffer on a side stream
    that waits for that event, then `sendall`s it; the training stream is never synchronised and
    host memory is pinned once per link, not once per frame.
    """

    head: bytes
    payload: Any = b""
    device_tensor: Any = None
    ready: Any = None  # torch.cuda.Event recorded after the tensor was produced
    group_tensor: Any = None  # sent over the pair group after the head (the head says via "group")


class Staging:
    """One reusable pinned host buffer and copy stream (used under one writer at a time)."""

    def __init__(self) -> None:
        self.buffer: Any = None
        self.stream: Any = None

    def host_bytes(self, tensor: Any, ready: Any) -> Any:
        import torch

        flat = tensor.reshape(-1)
        if self.buffer is None or self.buffer.numel() < flat.numel() or self.buffer.dtype != flat.dtype:
            self.buffer = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
            self.stream = torch.cuda.Stream(flat.device)
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            self.buffer[: flat.numel()].copy_(flat, non_blocking=True)
        self.stream.synchronize()
        return memoryview(self.buffer[: flat.numel()].view(torch.uint8).numpy())


def encode(kind: str, header: dict[str, Any] | None = None, tensor: Any = None, via_group: bool = False) -> Encoded:
    import torch

    body = dict(header or {}, kind=kind)
    frame = Encoded(b"")
    size = 0
    if tensor is not None:
        t = tensor.detach().contiguous()
        body.update(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
        if t.device.type == "cuda":  # staged or broadcast once the tensor is produced
            frame.ready = torch.cuda.Event()
            frame.ready.record(torch.cuda.current_stream(t.device))
        if via_group:  # the bytes follow over the pair group: no payload
            body["via"] = "group"
            frame.group_tensor = t
        else:
            size = t.numel() * t.element_size()
            if t.device.type == "cuda":
                frame.device_tensor = t
            else:  # any dtype, bf16 too; a view, no copy
                frame.payload = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    encoded = json.dumps(body).encode()
    frame.head = _HEADER.pack(len(encoded)) + encoded + _PAYLOAD.pack(size)
    return frame


def send_encoded(sock: socket.socket, frame: Encoded, staging: Staging | None = None,
                 group: "dc.PairGroup | None" = None) -> None:
    if frame.group_tensor is not None:
        if group is None:
            raise ConnectionError("a tensor frame for the pair group, but no pair group is open")
        sock.sendall(frame.head)
        group.send(frame.group_tensor, frame.ready)  # returns once the peer has it
        return
    payload = frame.payload
    if frame.device_tensor is not None:
        payload = (staging or Staging()).host_bytes(frame.device_tensor, frame.ready)
    sock.sendall(frame.head)
    if len(payload):
        sock.sendall(payload)


def send_frame(sock: socket.socket, kind: str, header: dict[str, Any] | None = None, tensor: Any = None,
               staging: Staging | None = None) -> None:
    send_encoded(sock, encode(kind, header, tensor), staging)


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        try:
            count = sock.recv_into(view[got:], size - got)  # few calls: each one needs the GIL
        except socket.timeout:
            continue  # the timeout bounds sends only; an idle peer is not a dead one
        if not count:
            raise ConnectionError("side channel closed by the peer")
        got += count
    return buffer


def recv_frame(sock: socket.socket) -> Frame:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_HEADER:
        raise ConnectionError(f"side channel: header of {size} bytes is not a Libra frame")
    header = json.loads(_recv_exact(sock, size))
    (length,) = _PAYLOAD.unpack(_recv_exact(sock, _PAYLOAD.size))
    return Frame(header.pop("kind"), header, _recv_exact(sock, length) if length else bytearray())


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint {address!r} must be HOST:PORT")
    return host, int(port)
