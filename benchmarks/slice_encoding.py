"""What sending a hybrid its slice costs the core: the slice as JSON lists against `slice_to_wire`.

Both encode the same random slice (16 sequences of 512 tokens, 500 of them generated, as in
`gpu_session.sh elastic`) to the header text the side channel sends; medians of 20 runs each, in
this process, side by side.

    python benchmarks/slice_encoding.py [--sequences 16 --tokens 512]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from libra.services.trainer.backend import TrainSequence
    from libra.services.trainer.elastic.work import slice_from_wire, slice_to_wire

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = 12
    response = args.tokens - prompt
    slice_ = [TrainSequence([rng.randrange(150_000) for _ in range(args.tokens)], prompt, [1] * response,
                            [-3 * rng.random() for _ in range(response)], rng.random()) for _ in range(args.sequences)]

    def as_lists() -> str:  # what the step frame carried before
        return json.dumps([{"token_ids": list(s.token_ids), "prompt_length": s.prompt_length,
                            "loss_mask": list(s.loss_mask), "behaviour_logprobs": list(s.behaviour_logprobs),
                            "advantage": s.advantage} for s in slice_])

    def as_wire() -> str:
        return json.dumps(slice_to_wire(slice_))

    rows = {}
    for name, fn in (("json lists", as_lists), ("slice_to_wire", as_wire)):
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            text = fn()
            times.append(time.perf_counter() - began)
        rows[name] = (statistics.median(times), len(text))
    assert slice_from_wire(json.loads(as_wire())) == slice_  # exact
    base = rows["json lists"][0]
    print(f"{args.sequences} sequences x {args.tokens} tokens")
    for name, (seconds, size) in rows.items():
        print(f"  {name:<14} {seconds * 1e3:7.2f} ms  {size / 1e3:7.1f} kB  {base / seconds:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
