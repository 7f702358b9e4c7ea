"""`libra up`'s supervision (libra/supervise.py): the backoff and crash-loop arithmetic, the port
held while a service is down, and real processes that die and are started again."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from libra.supervise import CrashLoop, PortHold, RestartPolicy, Supervisor

POLICY = RestartPolicy(first_delay_s=1, max_delay_s=8, factor=2, max_restarts=3, window_s=100, healthy_after_s=50)


def test_backoff_grows_and_a_crash_loop_gives_up():
    loop = CrashLoop(POLICY)
    assert [loop.crashed(t, 1) for t in (0, 2, 5)] == [1, 2, 4]
    assert loop.crashed(9, 1) is None  # a fourth crash within 100 s: a crash loop
    assert loop.crashed(106, 1) == 8  # the first restart left the window: one more is allowed


def test_a_process_that_ran_well_starts_its_backoff_again():
    loop = CrashLoop(POLICY)
    assert [loop.crashed(t, 1) for t in (0, 2)] == [1, 2]
    assert loop.crashed(60, 55) == 1  # ran 55 s (>= healthy_after_s): back to the first delay
    assert loop.crashed(62, 1) is None  # but three restarts within the window still make a loop


def test_a_held_port_cannot_be_bound_until_released():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hold = PortHold("127.0.0.1", port)
    assert hold.held
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
            bound = True
        except OSError:
            bound = False
    assert not bound
    hold.release()
    with socket.socket() as server:  # free again: a server listens there, and then nobody can hold it
        server.bind(("127.0.0.1", port))
        server.listen()
        assert not PortHold("127.0.0.1", port).held


class Child:
    """A real process the supervisor restarts; `exit_code` is what each start exits with."""

    def __init__(self, exit_code: int, lives_s: float):
        self.exit_code, self.lives_s, self.starts = exit_code, lives_s, 0
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.starts += 1
        code = f"import time, sys; time.sleep({self.lives_s}); sys.exit({self.exit_code})"
        self.process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_dead_process_is_started_again_until_a_crash_loop_stops_it():
    said: list[str] = []
    policy = RestartPolicy(first_delay_s=0.1, max_delay_s=0.2, max_restarts=2, window_s=60)
    crashing, finishing = Child(3, 0.1), Child(0, 0.3)
    supervisor = Supervisor(policy, said.append, said.append, lambda name: f"(log of {name})",
                            finished=lambda name, code: name == "done" and code == 0)
    for name, child in (("crashing", crashing), ("done", finishing)):
        child.start()
        supervisor.add(name, child.start, lambda c=child: c.process)
    reasons: list[str] = []

    def check() -> bool:
        reason = supervisor.check()
        if reason is not None:
            reasons.append(reason)
        return bool(reasons)
    _until(check)
    assert crashing.starts == 3 and supervisor.restarts["crashing"] == 2  # started, then twice again
    assert "crashing exited with code 3" in reasons[0] and "a crash loop" in reasons[0]
    assert "(log of crashing)" in reasons[0]
    assert sum("starting it again in" in line for line in said) == 2
    assert sum("crashing started again" in line for line in said) == 2
    assert finishing.starts == 1  # exited 0 as a finished job: never restarted
    supervisor.release()
