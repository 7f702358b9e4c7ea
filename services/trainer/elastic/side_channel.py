"""The side channel between a hybrid replica and the core rank of its lane: framed TCP messages.

Owns: the core's lane endpoint (one listening socket per core rank, a link per hybrid) and the
hybrid's connection. Must not know: models, optimizers, membership rules.

Why TCP and not the core's process group: that group has a fixed world; adding a hybrid to it
means building a new group (and NCCL communicators), which is exactly what membership changes must
never do. A socket per hybrid is created and dropped with the hybrid, and the core's process
group (built once at start) is never touched. Control frames always go over the socket. Tensors go
either in the frame (staged through pinned host memory on GPUs: a CPU-staged channel, about
1 GB/s) or, when the core's channel policy opens one at hello (`device_channel`: a private
two-rank NCCL/gloo group per hybrid, device to device), over that pair group: the frame then
carries only the header (`via: "group"`, dtype, shape) and the bytes follow as one broadcast.

Frames and their encoding: `frames`. The pair group: `device_channel`.

    hybrid                                  core rank r (lane endpoint, accept thread + one reader
      │ hello{replica_id, device}    ──▶      thread per connection; frames land in two queues)
      │ ◀── channel{backend, port} (only when a pair group is opened; see device_channel)
      │ ◀── prepare | snapshot{path} | catch_up{step}+grad | active | step{slice, N/W} | bye | error
      │ loaded{step} | caught_up{step} | join_failed{reason} ──▶ control queue (read at boundaries)
      │ grad{step, metrics}+grad            ──▶ gradient queue (waited on with a deadline)
      │ ◀── reduced{step}+grad
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any, Callable

from libra.services.trainer.elastic import device_channel as dc
from libra.services.trainer.elastic.frames import (  # noqa: F401 - CLOSED, Frame: this module's API too
    CLOSED, Encoded, Frame, Staging, encode, parse_address, recv_frame, send_encoded, send_frame)


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
        self.group: dc.PairGroup | None = None  # set before the link is registered, never after
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
        frame = encode(kind, header, tensor, via_group=self.group is not None)
        with self.lock:  # never queue behind the close sentinel (the queue would never drain)
            if not self.open:
                return False
            self.outbox.put(frame)
            return True

    def send(self, kind: str, header: dict[str, Any] | None = None, tensor: Any = None) -> bool:
        """False when the connection is gone (the caller marks the hybrid failed)."""
        if not self.open:
            return False
        frame = encode(kind, header, tensor, via_group=self.group is not None)
        self.outbox.join()  # what was queued before goes first
        return self._send_now(frame)

    def _send_now(self, frame: Encoded) -> bool:
        with self.write_lock:  # not `lock`: queueing must never wait for a transfer in progress
            if not self.open:
                return False
            try:
                send_encoded(self.sock, frame, self.staging, self.group)
                return True
            except OSError:  # dc.ChannelError too: the pair group is then broken
                self.open = False
                return False

    @property
    def channel(self) -> str:
        return self.group.description if self.group is not None else "tcp"

    def start_recv(self, frame: Frame) -> Frame:
        """Post the receive of a frame's tensor over the pair group (the reader thread, in frame order)."""
        if self.group is None:
            return Frame(CLOSED)  # a peer that sends over a group it never opened is not a Libra hybrid
        try:
            frame.pending = self.group.start_recv(frame.header["shape"], frame.header["dtype"])
        except (dc.ChannelError, RuntimeError, TypeError, KeyError):  # broken group, no memory, bad header
            return Frame(CLOSED)
        return frame

    def close(self) -> None:
        with self.lock:
            if self.open:
                self.outbox.put(None)
            self.open = False
        if self.group is not None:
            self.group.close()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class LaneEndpoint:
    """The listening socket of one core rank; hybrids of that rank connect here."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, send_timeout_s: float | None = None,
                 channel: str = "tcp", device: Callable[[], Any] = lambda: "cpu"):
        # A hybrid that stops reading must not block the core: a send that cannot finish within
        # send_timeout_s fails (the caller marks the hybrid failed and the link is dropped). The
        # pair group's operations (and its setup) get the same deadline.
        self.send_timeout_s = send_timeout_s
        if channel not in dc.MODES:
            raise ValueError(f"side channel mode must be one of {dc.MODES}, got {channel!r}")
        self.channel, self.device = channel, device  # device: the core's, read when a hybrid says hello
        self.host = host
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
        failed = self._open_channel(link, hello.header)
        with self._lock:
            old = self._links.get(link.replica_id)
            self._links[link.replica_id] = link
        if old is not None:
            old.close()  # a restarted hybrid process replaces its dead connection
        self._control.put((link.replica_id, hello))
        if failed:
            self._control.put((link.replica_id, Frame("join_failed", {"reason": failed})))
        while True:
            try:
                frame = recv_frame(sock)
            except (OSError, ValueError):
                frame = Frame(CLOSED)
            if frame.header.get("via") == "group":
                frame = link.start_recv(frame)
            if frame.kind in ("grad", CLOSED):
                link.grads.put(frame)
            if frame.kind != "grad":
                self._control.put((link.replica_id, frame))
            if frame.kind == CLOSED:
                link.close()  # also ends its outbox thread
                return

    def _open_channel(self, link: _Link, hello: dict[str, Any]) -> str:
        """Open the hybrid's pair group if the channel policy picks one; why not, or "".

        Blocks this reader thread (the rendezvous waits for the hybrid), never the core's step; the
        link is registered only afterwards, so no frame can overtake the `channel` frame.
        """
        timeout_s = self.send_timeout_s or 60.0
        try:
            link.group = dc.open_core_end(self.channel, self.device(), hello, self.host, timeout_s, link.send)
        except (dc.ChannelError, RuntimeError, ValueError) as error:
            return f"could not open the device channel: {error}"
        return ""

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
        """The next gradient frame of a hybrid (its tensor arrived), a CLOSED frame, or None after
        `timeout_s` (a tensor still in flight over the pair group then counts as missed)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        link = self.link(replica_id)
        if link is None:
            return Frame(CLOSED)
        try:
            frame = link.grads.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None
        if frame.pending is not None:
            try:
                frame.received = frame.pending.result(deadline)
            except dc.ChannelTimeout:
                return None
            except dc.ChannelError:
                return Frame(CLOSED)
        return frame

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

    def __init__(self, endpoint: str, replica_id: str, timeout_s: float = 30.0, device: Any = "cpu"):
        self.host = parse_address(endpoint)[0]
        self.sock = socket.create_connection(parse_address(endpoint), timeout=timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.staging = Staging()
        self.device = device
        self.group: dc.PairGroup | None = None
        send_frame(self.sock, "hello", {"replica_id": replica_id, "channels": ["tcp", "group"],
                                        **dc.device_info(device)})

    def open_group(self, channel: dict[str, Any]) -> None:
        """Join the pair group the core opened for us (the `channel` frame); ChannelError if it fails."""
        self.group = dc.open_hybrid_end(channel, self.host, self.device)

    @property
    def channel(self) -> str:
        return self.group.description if self.group is not None else "tcp"

    def send(self, kind: str, header: dict[str, Any] | None = None, tensor: Any = None) -> None:
        send_encoded(self.sock, encode(kind, header, tensor, via_group=self.group is not None), self.staging,
                     self.group)

    def recv(self) -> Frame:
        frame = recv_frame(self.sock)
        if frame.header.get("via") == "group":
            if self.group is None:
                raise ConnectionError("the core sent a tensor over a pair group that was never opened")
            frame.received = self.group.recv(frame.header["shape"], frame.header["dtype"])
        return frame

    def close(self) -> None:
        if self.group is not None:
            self.group.close(wait_s=10.0)
        self.sock.close()
