"""The real hybrid process, except that it dies in the middle of a gradient transfer (tests only).

Same arguments as `python -m libra.services.trainer.elastic.hybrid`. Once the file named by
$LIBRA_TEST_DIE_FLAG exists, the next gradient's header goes out and the process SIGKILLs itself
before the bytes do: over a pair group the core is then waiting in a receive that the dead peer
will never complete.
"""

from __future__ import annotations

import os
import signal
import sys

from libra.services.trainer.elastic import hybrid, side_channel
from libra.services.trainer.elastic.frames import encode


class DyingLink(side_channel.HybridLink):
    def send(self, kind, header=None, tensor=None) -> None:
        if kind == "grad" and os.path.exists(os.environ["LIBRA_TEST_DIE_FLAG"]):
            self.sock.sendall(encode(kind, header, tensor, via_group=self.group is not None).head)
            os.kill(os.getpid(), signal.SIGKILL)
        super().send(kind, header, tensor)


if __name__ == "__main__":
    side_channel.HybridLink = DyingLink  # hybrid.main looks it up when it connects
    sys.exit(hybrid.main())
