#!/usr/bin/env bash
# Where the quickstart's RL phase spends its CPU: py-spy (pip install py-spy) samples the trainer, the
# rollout gateway, the scheduler and each engine worker, each in its own process, for 15 s at 50 Hz
# once step 5 has run; benchmarks/pyspy_summary.py then prints each one's top frames.
#
#   bash benchmarks/profile_quickstart.sh [OUT_DIR]        # ~80 s on 2 cores; an idle machine
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/libra-profile}
rm -rf "$OUT" && mkdir -p "$OUT"
.venv/bin/libra up --config configs/quickstart.yaml --run-dir "$OUT/run" --fresh --set trainer.steps=60 \
    > "$OUT/up.log" 2>&1 &
UP=$!
until grep -q "step   5/" "$OUT/up.log"; do sleep 0.5; done
for pid in $(pgrep -f "serve (rollout|scheduler|trainer)|hf_server"); do
  name=$(tr '\0' ' ' < "/proc/$pid/cmdline" | grep -oE "serve [a-z]+|--port [0-9]+" | head -1 | tr ' ' _)
  .venv/bin/py-spy record --nonblocking -r 50 -d 15 -p "$pid" -f raw -o "$OUT/$name.$pid.txt" > /dev/null 2>&1 &
done
wait $UP
.venv/bin/python benchmarks/pyspy_summary.py "$OUT"/*.txt
