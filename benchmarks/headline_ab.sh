#!/usr/bin/env bash
# Two commits side by side on real processes: benchmarks/headline_cpu.py run from a worktree of
# BASE (the baseline) and from this tree, alternately, one run of each design per round
# (benchmarks/ab_trees.sh, which flips the order every round).
#
#   bash benchmarks/headline_ab.sh BASE [ROUNDS] [OUT_DIR] [-- headline_cpu.py options, e.g. --only a b]
#
# Each run's record and history go to OUT_DIR/{base,this}-ROUND (benchmarks/admission_spread.py and
# sim_vs_real.py read them), its JSON line to OUT_DIR/{base,this}-ROUND.json, its output to
# OUT_DIR/{base,this}-ROUND.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
POSITIONAL=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do POSITIONAL+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift  # what is left goes to headline_cpu.py
[ ${#POSITIONAL[@]} -ge 1 ] || { echo "usage: headline_ab.sh BASE [ROUNDS] [OUT_DIR] [-- options]" >&2; exit 2; }
exec bash benchmarks/ab_trees.sh "${POSITIONAL[@]}" -- benchmarks/headline_cpu.py --runs 1 --steps 30 \
    --keep-runs "{out}" --json "{out}.json" --plot "{out}.png" "$@"
