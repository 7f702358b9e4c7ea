"""free_port: a port for a server about to start, never one the kernel may give a connection meanwhile."""

from __future__ import annotations

import random
import socket

from libra import redis_server
from libra.redis_server import PORT_FLOOR, _ephemeral_floor, free_port


def test_ports_come_from_below_the_kernels_ephemeral_range_and_never_twice():
    ceiling = _ephemeral_floor()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_FLOOR <= port < ceiling for port in ports)
    for port in ports[:20]:  # free when handed out: a server can bind it
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_skipped():
    busy = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        redis_server._handed_out.discard(busy)  # as if another process had chosen it

        class Scripted(random.Random):  # the listening port first, then whatever comes
            def __init__(self):
                super().__init__(0)
                self.asked = 0

            def randrange(self, start, stop=None, step=1):
                self.asked += 1
                return busy if self.asked == 1 else super().randrange(start, stop, step)

        rng = Scripted()
        port = free_port(rng=rng)
        assert rng.asked >= 2 and port != busy


def test_the_ephemeral_floor_is_read_from_the_kernel_with_a_default(tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert _ephemeral_floor(str(ranges)) == 40000
    assert _ephemeral_floor(str(tmp_path / "missing")) == 32768
