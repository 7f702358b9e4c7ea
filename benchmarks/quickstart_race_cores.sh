#!/usr/bin/env bash
# Time to first learning with more cores than dev's 2: benchmarks/quickstart_race.py on the GPU
# machine's idle CPUs, the GPU hidden (every contender runs on CPU, as on dev), once per core count,
# every contender's process tree pinned to that many CPUs (--cores). Carry .whl and .carry
# (benchmarks/gpu_carry.sh); results to $OUT/race_cores_N.json and the tables to stdout.
#
#   bash benchmarks/quickstart_race_cores.sh STEPS CORES... [-- RACE_ARGS...]
#   e.g. bash benchmarks/quickstart_race_cores.sh 35 4 8 -- --only quickstart sync-loop
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/libra-race-out}
mkdir -p "$OUT"
steps=${1:?STEPS}; shift
cores=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do cores+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
source benchmarks/gpu_bootstrap.sh >"$OUT/bootstrap.log" 2>&1 || { cat "$OUT/bootstrap.log"; exit 1; }
export CUDA_VISIBLE_DEVICES=""  # CPU only, as on a machine without a GPU
lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core)" || true
for n in "${cores[@]}"; do
    echo "== $n cores ($(date -u +%H:%M:%S))"
    python3 benchmarks/quickstart_race.py --runs 3 --steps "$steps" --cores "$n" --json "$OUT/race_cores_$n.json" "$@"
done
