#!/usr/bin/env bash
# Seconds from launching the quickstart to the end of its first GRPO step (and that step's wait and
# train times, from the trainer's log): the start-up as a user feels it, one number a run.
#
#   bash benchmarks/first_step.sh [RUNS] [NICE] [KEY=VALUE ...]
#       NICE > 0: every thread of the rollout side (gateway, scheduler, planner, elastic, engines) reniced;
#       KEY=VALUE: config overrides, each passed as --set (e.g. up.zygote=false)
# Each run is `libra up --config configs/quickstart.yaml --set trainer.steps=2` in a fresh run
# directory under /tmp; an idle machine is assumed.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
NICE=${2:-0}
SETS=()
for override in "${@:3}"; do SETS+=(--set "$override"); done
for run in $(seq 1 "$RUNS"); do
  OUT=$(mktemp -d /tmp/libra-first-step.XXXXXX)
  start=$(date +%s.%N)
  .venv/bin/libra up --config configs/quickstart.yaml --run-dir "$OUT/run" --fresh --set trainer.steps=2 \
      ${SETS[@]+"${SETS[@]}"} > "$OUT/up.log" 2>&1 &
  UP=$!
  if [ "$NICE" != 0 ]; then
    ( for _ in $(seq 1 300); do
        sleep 0.2
        for pid in $(pgrep -f "serve (rollout|scheduler|planner|elastic)|hf_server" || true); do
          for task in /proc/"$pid"/task/*; do renice -n "$NICE" -p "${task##*/}" > /dev/null 2>&1 || true; done
        done
      done ) &
    RENICE=$!
  fi
  wait "$UP"
  [ "$NICE" != 0 ] && kill "$RENICE" 2> /dev/null || true
  .venv/bin/python - "$start" "$OUT/run/logs/trainer.log" <<'PY'
import datetime, json, sys
start = float(sys.argv[1])
for line in open(sys.argv[2]):
    record = json.loads(line)
    if record.get("event") == "step":
        ended = datetime.datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
        print(f"first step done {ended - start:.2f} s after launch (its wait {record['wait_s']} s, train {record['train_s']} s)")
        break
PY
  rm -rf "$OUT"
done
