"""The side channel between a hybrid replica and the core rank of its lane: framed TCP messages.

Owns: the wire format, the core's lane endpoint (one listening socket per core rank) and the
hybrid's connection. Must not know: models, optimizers, membership rules.

Why plain TCP and not torch.distributed: a process group has a fixed world; adding a hybrid to one
means building a new group (and NCCL communicators), which is exactly what membership changes must
never do. A socket per hybrid is created and dropped with the hybrid, and the core's process
group (built once at start) is never touched. On GPUs the tensors are staged through host memory
(`.cpu()` before send, `.to(device)` after receive): a CPU-staged channel, device-agnostic.

Frame: 4-byte big-endian header length, UTF-8 JSON header, 8-byte big-endian payload length, raw
payload (a contiguous tensor's bytes; dtype and shape are in the header). No pickle: a frame is
data, never code.

    hybrid                                  core rank r (lane endpoint, accept thread + one reader
      │ hello{replica_id}            ──▶      thread per connection; frames land in two queues)
      │ ◀── prepare | snapshot{path} | catch_up{step}+grad | active | step{slice, N/W} | bye | error
      │ loaded{step} | caught_up{step} | join_failed{reason} ──▶ control queue (read at boundaries)
      │ grad{step, metrics}+grad            ──▶ gradient queue (waited on with a deadline)
      │ ◀── reduced{step}+grad
"""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

_HEADER = struct.Struct(">I")
_PAYLOAD = struct.Struct(">Q")
MAX_HEADER = 64 * 1024 * 1024
CLOSED = "closed"  # kind of the frame a reader queues when its connection ends


@dataclass
class Frame:
    kind: str
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytearray = field(default_factory=bytearray)

    def tensor(self) -> Any:
        """The payload as a CPU tensor of the header's dtype and shape (no copy: it views the buffer)."""
        import torch

        dtype = getattr(torch, self.header["dtype"])
        if not self.payload:
            return torch.empty(self.header["shape"], dtype=dtype)
        return torch.frombuffer(self.payload, dtype=torch.uint8).view(dtype).reshape(self.header["shape"])


@dataclass
class Encoded:
    """A frame ready to go: header bytes and either host bytes or a device tensor to stage.

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


def encode(kind: str, header: dict[str, Any] | None = None, tensor: Any = None) -> Encoded:
    import torch

    body = dict(header or {}, kind=kind)
    frame = Encoded(b"")
    size = 0
    if tensor is not None:
        t = tensor.detach()
        body.update(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
        size = t.numel() * t.element_size()
        if t.device.type == "cuda":
            frame.device_tensor, frame.ready = t.contiguous(), torch.cuda.Event()
            frame.ready.record(torch.cuda.current_stream(t.device))
        else:  # any dtype, bf16 too; a view, no copy
            frame.payload = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    encoded = json.dumps(body).encode()
    frame.head = _HEADER.pack(len(encoded)) + encoded + _PAYLOAD.pack(size)
    return frame


def send_encoded(sock: socket.socket, frame: Encoded, staging: Staging | None = None) -> None:
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


class _Link:
    """One hybrid's connection on the core side: a send lock, an ordered outbox, two inbound queues."""

    def __init__(self, sock: socket.socket, replica_id: str):
        self.sock, self.replica_id = sock, replica_id
        self.lock = threading.Lock()  # open flag and queueing
        self.write_lock = threading.Lock()  # one frame on the socket at a time
        self.staging = Staging()  # used under write_lock
        self.grads: queue.Queue[Frame] = queue.Queue()
        self.outbox: queue.Queue[Encoded | None] = queue.Queue()
        self.open = True
        threading.Thread(target=self._drain_outbox, name=f"lane-out-{replica_id}", daemon=True).start()

    def _drain_outbox(self) -> None:
        while True:
            frame = self.outbox.get()
            try:
                if frame is None:
                    return
                self._send_now(frame)
            finally:
                self.outbox.task_done()

    def send_async(self, kind: str, header: dict[str, Any] | None = None, tensor: Any = None) -> bool:
        """Queue a frame (encoded here); frames leave in order, and a later `send` waits for them."""
        frame = encode(kind, header, tensor)
        with self.lock:  # never queue behind the close sentinel (the queue would never drain)
            if not self.open:
                return False
            self.outbox.put(frame)
            return True

    def send(self, kind: str, header: dict[str, Any] | None = None, tensor: Any = None) -> bool:
        """False when the connection is gone (the caller marks the hybrid failed)."""
        if not self.open:
            return False
        frame = encode(kind, header, tensor)
        self.outbox.join()  # what was queued before goes first
        return self._send_now(frame)

    def _send_now(self, frame: Encoded) -> bool:
        with self.write_lock:  # not `lock`: queueing must never wait for a transfer in progress
            if not self.open:
                return False
            try:
                send_encoded(self.sock, frame, self.staging)
                return True
            except OSError:
                self.open = False
                return False

    def close(self) -> None:
        with self.lock:
            if self.open:
                self.outbox.put(None)
            self.open = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class LaneEndpoint:
    """The listening socket of one core rank; hybrids of that rank connect here."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, send_timeout_s: float | None = None):
        # A hybrid that stops reading must not block the core: a send that cannot finish within
        # send_timeout_s fails (the caller marks the hybrid failed and the link is dropped).
        self.send_timeout_s = send_timeout_s
        self._server = socket.create_server((host, port))
        # A wildcard bind is advertised under this host's name (hybrids need an address to dial).
        advertised = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        self.address = f"{advertised}:{self._server.getsockname()[1]}"
        self._links: dict[str, _Link] = {}
        self._control: queue.Queue[tuple[str, Frame]] = queue.Queue()
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept, name=f"lane-accept-{self.address}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.send_timeout_s)
            threading.Thread(target=self._read, args=(sock,), daemon=True).start()

    def _read(self, sock: socket.socket) -> None:
        try:
            hello = recv_frame(sock)
        except (OSError, ValueError):
            sock.close()
            return
        if hello.kind != "hello" or not hello.header.get("replica_id"):
            sock.close()
            return
        link = _Link(sock, str(hello.header["replica_id"]))
        with self._lock:
            old = self._links.get(link.replica_id)
            self._links[link.replica_id] = link
        if old is not None:
            old.close()  # a restarted hybrid process replaces its dead connection
        self._control.put((link.replica_id, hello))
        while True:
            try:
                frame = recv_frame(sock)
            except (OSError, ValueError):
                frame = Frame(CLOSED)
            if frame.kind in ("grad", CLOSED):
                link.grads.put(frame)
            if frame.kind != "grad":
                self._control.put((link.replica_id, frame))
            if frame.kind == CLOSED:
                link.close()  # also ends its outbox thread
                return

    def link(self, replica_id: str) -> _Link | None:
        with self._lock:
            return self._links.get(replica_id)

    def send(self, replica_id: str, kind: str, header: dict[str, Any] | None = None, tensor: Any = None) -> bool:
        link = self.link(replica_id)
        return link.send(kind, header, tensor) if link is not None else False

    def send_async(self, replica_id: str, kind: str, header: dict[str, Any] | None = None,
                   tensor: Any = None) -> bool:
        link = self.link(replica_id)
        return link.send_async(kind, header, tensor) if link is not None else False

    def control_frames(self) -> list[tuple[str, Frame]]:
        """Every control frame (hello, loaded, join_failed, closed) since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self._control.get_nowait())
            except queue.Empty:
                return out

    def wait_grad(self, replica_id: str, timeout_s: float) -> Frame | None:
        """The next gradient frame of a hybrid, a CLOSED frame, or None after `timeout_s`."""
        link = self.link(replica_id)
        if link is None:
            return Frame(CLOSED)
        try:
            return link.grads.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None

    def disconnect(self, replica_id: str) -> None:
        with self._lock:
            link = self._links.pop(replica_id, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        self._closing = True
        self._server.close()
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


class HybridLink:
    """The hybrid's end: connect, say hello, then a plain blocking frame exchange."""

    def __init__(self, endpoint: str, replica_id: str, timeout_s: float = 30.0):
        self.sock = socket.create_connection(parse_address(endpoint), timeout=timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.staging = Staging()
        send_frame(self.sock, "hello", {"replica_id": replica_id})

    def send(self, kind: str, header: dict[str, Any] | None = None, tensor: Any = None) -> None:
        send_frame(self.sock, kind, header, tensor, self.staging)

    def recv(self) -> Frame:
        return recv_frame(self.sock)

    def close(self) -> None:
        self.sock.close()
